// ResidentModel: the whole model's parameters and gradients held at once, run
// block by block with the same BlockRunner the sliding-window engine uses.
// It is the reference the engine is checked against ("offload changes
// nothing"), and what `evaluate` falls back to for models that fit.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "engine/model/model_spec.h"
#include "engine/run/block_runner.h"

namespace strider {

struct StepLoss {
  double loss = 0;            // mean over valid tokens of the whole batch
  int64_t valid_tokens = 0;
  // Output of each non-head block (embedding, layers), all micro-batches
  // concatenated along the batch dimension; filled only when asked for.
  std::vector<at::Tensor> block_outputs;
};

class ResidentModel {
 public:
  ResidentModel(ModelSpec spec, ComputeOptions options, at::Device device = at::kCPU);

  // Copies `tensor` into the parameter `name` (a checkpoint name), converting
  // dtype; throws naming the tensor on an unknown name or a wrong shape.
  void set_param(const std::string& name, const at::Tensor& tensor);
  // A view of parameter / gradient `name` (compute dtype / fp32).
  at::Tensor param(const std::string& name) const;
  at::Tensor grad(const std::string& name) const;
  // Every parameter name, in block order.
  std::vector<std::string> param_names() const;

  // Zeroes gradients, then forward and backward over `input_ids` / `labels`
  // ([batch, seq], int64) split into `micro_batches`, accumulating gradients
  // of the mean loss over all valid tokens. `positions` ([batch, seq] int64,
  // or undefined): rows that pack documents (BatchPositions), per
  // micro-batch as the engine takes them. `attention_mask` ([batch, seq]
  // int64 of 0 and 1, or undefined): padding, left out of the load-balancing
  // loss (Engine::step).
  StepLoss forward_backward(const at::Tensor& input_ids, const at::Tensor& labels,
                            int64_t micro_batches, bool keep_outputs = false, const at::Tensor& positions = {},
                            const at::Tensor& attention_mask = {});

  // Each sparse layer's routing of `input_ids` ([batch, seq] int64, one
  // micro-batch) in a forward with the current parameters: its tokens'
  // chosen experts, int64 [batch x seq, top_k] (MoeStep::routes), in layer
  // order.
  std::vector<at::Tensor> routing(const at::Tensor& input_ids);

  const ModelSpec& spec() const { return spec_; }
  at::Tensor block_params(int64_t b) const { return params_[b]; }
  at::Tensor block_grads(int64_t b) const { return grads_[b]; }

 private:
  std::pair<int64_t, const TensorSlot*> locate(const std::string& name) const;

  ModelSpec spec_;
  ComputeOptions options_;
  at::Device device_;
  std::vector<ParamLayout> layouts_;
  std::vector<at::Tensor> params_;  // flat, compute dtype
  std::vector<at::Tensor> grads_;   // flat, fp32
};

}  // namespace strider
