// A decoder layer's random weights for the tests of gpu/blocks and
// gpu/attention: Llama's tensors, and Qwen3's biases and q/k norms where the
// BlockDims ask for them.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "gpu/blocks/blocks.h"

namespace strider {

// Random weights in `dtype` (norm weights near 1), and zeroed fp32 accumulators.
struct Layer {
  TensorMap w, grads;
};
inline Layer random_layer(const BlockDims& d, at::ScalarType dtype, uint64_t seed, at::Device device = at::kCPU) {
  at::manual_seed(seed);
  const int64_t q = d.heads * d.head_dim, kv = d.kv_heads * d.head_dim;
  Layer l;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool norm = false) {
    at::Tensor t = at::randn(shape) * (norm ? 0.1 : 0.2);
    if (norm) t += 1;
    l.w.emplace(name, t.to(device, dtype));
    l.grads.emplace(name, at::zeros(shape, at::TensorOptions(at::kFloat).device(device)));
  };
  add("input_layernorm.weight", {d.hidden}, true);
  add("self_attn.q_proj.weight", {q, d.hidden});
  add("self_attn.k_proj.weight", {kv, d.hidden});
  add("self_attn.v_proj.weight", {kv, d.hidden});
  add("self_attn.o_proj.weight", {d.hidden, q});
  if (d.qkv_bias) {
    add("self_attn.q_proj.bias", {q});
    add("self_attn.k_proj.bias", {kv});
    add("self_attn.v_proj.bias", {kv});
  }
  if (d.o_bias) add("self_attn.o_proj.bias", {d.hidden});
  if (d.qk_norm) {
    add("self_attn.q_norm.weight", {d.head_dim}, true);
    add("self_attn.k_norm.weight", {d.head_dim}, true);
  }
  add("post_attention_layernorm.weight", {d.hidden}, true);
  add("mlp.gate_proj.weight", {d.intermediate, d.hidden});
  add("mlp.up_proj.weight", {d.intermediate, d.hidden});
  add("mlp.down_proj.weight", {d.hidden, d.intermediate});
  if (d.mlp_bias) {
    add("mlp.gate_proj.bias", {d.intermediate});
    add("mlp.up_proj.bias", {d.intermediate});
    add("mlp.down_proj.bias", {d.hidden});
  }
  return l;
}

}  // namespace strider
