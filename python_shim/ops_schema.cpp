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
  // The plan strider.Engine would run by (python_shim/engine_plan.h), as
  // `strider plan --json` prints it: the same model config and engine config
  // JSON the Engine takes, a device spec ("cpu", "cuda", "sim:rtx4090"; no
  // such device need exist where the budget is given) and its budget in
  // bytes (0: the device's default). No tensors, like the next.
  m.def("plan(str model_config_json, str engine_config_json, str device, int device_budget_bytes) -> str");
  // The rules between an engine config's settings that no field states
  // alone (engine/config/engine_config_json.h, settings_problems): each
  // broken one's field, the other field it is held against, and its text.
  // strider.EngineConfig.validate asks here.
  m.def("settings_problems(str engine_config_json) -> (str[] fields, str[] others, str[] texts)");
  // Each sparse layer's routing of input_ids by the resident model
  // (ResidentModel::routing): int64 [tokens, top_k] per layer.
  m.def("resident_routing(str config_json, str[] names, Tensor[] params, Tensor input_ids) -> Tensor[]");
}
