// What gpu/blocks.cpp and gpu/moe.cpp share inside a decoder layer: a named
// weight, and the MLP's gate activation (BlockDims::act) with its backward.
#pragma once

#include <ATen/ATen.h>

#include <string_view>

#include "gpu/blocks.h"
#include "host/error.h"

namespace strider::block_parts {

inline const at::Tensor& weight(const TensorMap& w, std::string_view name) {
  auto it = w.find(name);
  STRIDER_CHECK(it != w.end(), "model block: weight '{}' is missing", name);
  return it->second;
}

// act(gate), in place or not.
inline void activate_(const BlockDims& d, at::Tensor& gate) {
  if (d.act == Activation::kGeluTanh) at::gelu_(gate, "tanh");
  else at::silu_(gate);
}
inline at::Tensor activate(const BlockDims& d, const at::Tensor& gate) {
  return d.act == Activation::kGeluTanh ? at::gelu(gate, "tanh") : at::silu(gate);
}
// d(loss)/d(gate) from d(loss)/d(act(gate)), as autograd computes it.
inline at::Tensor activate_backward(const BlockDims& d, const at::Tensor& grad, const at::Tensor& gate) {
  return d.act == Activation::kGeluTanh ? at::gelu_backward(grad, gate, "tanh") : at::silu_backward(grad, gate);
}

}  // namespace strider::block_parts
