// Meta implementations of the strider ops (schemas in ops_schema.cpp): the
// outputs' shapes and dtypes without computing them, from the model's
// config.json as ModelSpec reads it, so that FakeTensorMode and torch.compile
// (torch.library.opcheck's fake-tensor and AOT checks) can trace a call. Sizes
// are symbolic where the inputs' are (a dynamic batch or sequence).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "python_shim/op_spec.h"

namespace strider {
namespace {

// Loss (fp64 scalar), each non-head block's output [batch, seq, hidden] in
// the compute dtype, each parameter's gradient in fp32 (ops_cpu.cpp).
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> resident_loss_and_grads_meta(
    c10::string_view config_json, c10::List<std::string> names, at::TensorList params,
    const at::Tensor& input_ids, const at::Tensor& labels, int64_t micro_batches, int64_t vocab_chunk,
    const std::optional<at::Tensor>& attention_mask) {
  TORCH_CHECK(names.size() == params.size(), "names (", names.size(), ") and params (", params.size(),
              ") differ in length");
  TORCH_CHECK(!params.empty(), "no parameters given");
  TORCH_CHECK(input_ids.dim() == 2, "input_ids must be [batch, seq]");
  const ModelSpec spec = op_model_spec(config_json);
  const auto out_options = params[0].options();
  std::vector<at::Tensor> outputs;
  for (int64_t b = 0; b + 1 < spec.num_blocks(); ++b)
    outputs.push_back(at::empty_symint({input_ids.sym_size(0), input_ids.sym_size(1), spec.dims.hidden}, out_options));
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : params) grads.push_back(at::empty_symint(p.sym_sizes(), p.options().dtype(at::kFloat)));
  return {at::empty({}, input_ids.options().dtype(at::kDouble)), outputs, grads};
}

// Each sparse layer's routing: int64 [batch x seq, top_k].
std::vector<at::Tensor> resident_routing_meta(c10::string_view config_json, c10::List<std::string> names,
                                              at::TensorList params, const at::Tensor& input_ids) {
  TORCH_CHECK(input_ids.dim() == 2, "input_ids must be [batch, seq]");
  const ModelSpec spec = op_model_spec(config_json);
  std::vector<at::Tensor> out;
  for (int64_t l = 0; l < spec.layers; ++l)
    if (spec.sparse(l))
      out.push_back(at::empty_symint({input_ids.sym_size(0) * input_ids.sym_size(1), spec.dims.moe.top_k},
                                     input_ids.options().dtype(at::kLong)));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(strider, Meta, m) {
  m.impl("resident_loss_and_grads", &resident_loss_and_grads_meta);
  m.impl("resident_routing", &resident_routing_meta);
}

}  // namespace strider
