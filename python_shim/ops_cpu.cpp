// CPU implementations of the strider ops (schemas in ops_schema.cpp).
#include <torch/library.h>

#include <nlohmann/json.hpp>

#include "engine/resident_model.h"
#include "host/error.h"

namespace strider {
namespace {

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> resident_loss_and_grads(
    c10::string_view config_json, c10::List<std::string> names, at::TensorList params,
    const at::Tensor& input_ids, const at::Tensor& labels, int64_t micro_batches, int64_t vocab_chunk,
    const std::optional<at::Tensor>& attention_mask) {
  TORCH_CHECK(names.size() == params.size(), "names (", names.size(), ") and params (", params.size(),
              ") differ in length");
  TORCH_CHECK(!params.empty(), "no parameters given");
  try {
    auto cfg = nlohmann::json::parse(std::string_view(config_json.data(), config_json.size()));
    ModelSpec spec = ModelSpec::from_json(cfg, "config_json");
    ComputeOptions opts{params[0].scalar_type(), vocab_chunk};
    ResidentModel model(spec, opts);
    for (size_t i = 0; i < names.size(); ++i) model.set_param(names.get(i), params[i]);
    StepLoss r = model.forward_backward(input_ids, labels, micro_batches, /*keep_outputs=*/true, {},
                                        attention_mask.value_or(at::Tensor()));
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < names.size(); ++i) grads.push_back(model.grad(names.get(i)).clone());
    return {at::scalar_tensor(r.loss, at::kDouble), r.block_outputs, grads};
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what());  // surfaces in Python as RuntimeError with our message
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "config_json: ", e.what());
  }
}

std::vector<at::Tensor> resident_routing(c10::string_view config_json, c10::List<std::string> names,
                                         at::TensorList params, const at::Tensor& input_ids) {
  TORCH_CHECK(names.size() == params.size() && !params.empty(), "names (", names.size(), ") and params (",
              params.size(), ") must be as many, and some");
  try {
    ModelSpec spec = ModelSpec::from_json(nlohmann::json::parse(std::string_view(config_json.data(), config_json.size())),
                                          "config_json");
    ResidentModel model(spec, ComputeOptions{.dtype = params[0].scalar_type()});
    for (size_t i = 0; i < names.size(); ++i) model.set_param(names.get(i), params[i]);
    return model.routing(input_ids);
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what());
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "config_json: ", e.what());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(strider, CPU, m) {
  m.impl("resident_loss_and_grads", &resident_loss_and_grads);
  m.impl("resident_routing", &resident_routing);
}

}  // namespace strider
