// The strider custom ops' schemas, declared once. Each device registers its
// own implementation in its own file (ops_cpu.cpp, later ops_cuda.cpp).
#include <torch/library.h>

TORCH_LIBRARY(strider, m) {
  // The resident reference: loss, each non-head block's output and every
  // parameter's gradient for one batch, computed block by block with the same
  // code the sliding-window engine runs. `params` follow `names` (checkpoint
  // names); their dtype (float32 or bfloat16) is the compute dtype. Gradients
  // come back in `names` order, fp32.
  m.def("resident_loss_and_grads(str config_json, str[] names, Tensor[] params, Tensor input_ids, "
        "Tensor labels, int micro_batches, int vocab_chunk, Tensor? attention_mask=None) -> (Tensor loss, "
        "Tensor[] block_outputs, "
        "Tensor[] grads)");
  // What a training checkpoint (engine/checkpoint/train_checkpoint.h) says about itself,
  // as JSON text: the directory used, step, model and engine configs, the
  // caller's extra. No tensors: implemented once for every device
  // (CompositeImplicitAutograd, in engine_class.cpp).
  m.def("inspect_training_checkpoint(str dir) -> str");
  // Each sparse layer's routing of input_ids by the resident model
  // (ResidentModel::routing): int64 [tokens, top_k] per layer.
  m.def("resident_routing(str config_json, str[] names, Tensor[] params, Tensor input_ids) -> Tensor[]");
}
