// CPU implementations of the strider ops (schemas in ops_schema.cpp).
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "engine/run/resident_model.h"
#include "host/error.h"
#include "python_shim/op_spec.h"

namespace strider {
namespace {

// The resident model of a config.json text with the given parameters (the
// compute dtype theirs); a ModelSpec error or bad JSON surfaces in Python as
// a RuntimeError with its message.
template <class F>
auto with_resident(c10::string_view config_json, const c10::List<std::string>& names, at::TensorList params,
                   int64_t vocab_chunk, F&& use) {
  // The op is opaque: its backward runs ATen's autograd inside (the blocks'
  // recomputation), whatever the caller's dispatch state. A Python dispatch
  // mode around the call (torch.library.opcheck's schema check, a profiler's
  // mode) sees this op, not its inner ops, and the keys a mode's redispatch
  // excludes (autograd's) are dispatched again inside.
  const c10::impl::LocalDispatchKeySet tls = c10::impl::tls_local_dispatch_key_set();
  const c10::DispatchKeySet python{c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot};
  c10::impl::ForceDispatchKeyGuard opaque(tls.included_ - python,
                                          (tls.excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView) | python);
  TORCH_CHECK(names.size() == params.size(), "names (", names.size(), ") and params (", params.size(),
              ") differ in length");
  TORCH_CHECK(!params.empty(), "no parameters given");
  const ModelSpec spec = op_model_spec(config_json);
  try {
    ResidentModel model(spec, ComputeOptions{params[0].scalar_type(), vocab_chunk});
    for (size_t i = 0; i < names.size(); ++i) model.set_param(names.get(i), params[i]);
    return use(model);
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> resident_loss_and_grads(
    c10::string_view config_json, c10::List<std::string> names, at::TensorList params,
    const at::Tensor& input_ids, const at::Tensor& labels, int64_t micro_batches, int64_t vocab_chunk,
    const std::optional<at::Tensor>& attention_mask) {
  return with_resident(config_json, names, params, vocab_chunk, [&](ResidentModel& model) {
    StepLoss r = model.forward_backward(input_ids, labels, micro_batches, /*keep_outputs=*/true, {},
                                        attention_mask.value_or(at::Tensor()));
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < names.size(); ++i) grads.push_back(model.grad(names.get(i)).clone());
    return std::tuple{at::scalar_tensor(r.loss, at::kDouble), r.block_outputs, grads};
  });
}

std::vector<at::Tensor> resident_routing(c10::string_view config_json, c10::List<std::string> names,
                                         at::TensorList params, const at::Tensor& input_ids) {
  return with_resident(config_json, names, params, ComputeOptions{}.vocab_chunk,
                       [&](ResidentModel& model) { return model.routing(input_ids); });
}

}  // namespace

TORCH_LIBRARY_IMPL(strider, CPU, m) {
  m.impl("resident_loss_and_grads", &resident_loss_and_grads);
  m.impl("resident_routing", &resident_routing);
}

}  // namespace strider
