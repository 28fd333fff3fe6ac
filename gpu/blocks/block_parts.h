// What gpu/blocks/blocks.cpp, gpu/blocks/moe.cpp and gpu/blocks/layer_cut.cpp share inside a
// decoder layer: a named weight, the MLP's gate activation (BlockDims::act)
// with its backward, the projections and their gradients, and the attention
// half of a layer, forward and backward, in the steps the whole layer and a
// layer cut into sub-layer pieces both take.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "gpu/blocks/attention.h"
#include "gpu/blocks/blocks.h"
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

// Tokens per tile (the MLP's, the attention half's projections') for n
// tokens: all of them when untiled; a negative tile is refused.
int64_t tile_tokens(int64_t token_tile, int64_t n);

// The norms around a layer's two residual branches (BlockDims::norm_placement),
// by checkpoint name; nullptr where the layer has none.
struct NormNames {
  const char *attn_pre, *attn_post, *mlp_pre, *mlp_post;
};
NormNames norm_names(const BlockDims& d);
// x through the norm `name`, or as it is where the layer has none there.
at::Tensor maybe_norm(const BlockDims& d, const TensorMap& w, const char* name, const at::Tensor& x);

// The projections `projs` of one input x, each x W^T (+ b) plus its LoRA
// adapter's share; one of them.
std::vector<at::Tensor> linears(const BlockDims& d, const at::Tensor& x, const TensorMap& w,
                                std::initializer_list<const char*> projs);
at::Tensor linear(const BlockDims& d, const at::Tensor& x, const TensorMap& w, const char* proj);
// A residual branch's output y as it is added to the stream: its post-norm
// `post` (nullptr: none), then Granite's residual_multiplier, in place.
at::Tensor branch(const BlockDims& d, const TensorMap& w, const char* post, at::Tensor y);
// Adds dL/dW = dy^T x (and dL/db) of the projection `proj` into its fp32
// accumulators in `grads`, where it has them (frozen: none).
void add_linear_grads(TensorMap& grads, const std::string& proj, const at::Tensor& dy, const at::Tensor& x);
// d(loss)/dx of the projections `projs` of x, given their output gradients
// `dys`, adding their adapters' gradients on the way.
at::Tensor linears_input_grad(const BlockDims& d, const TensorMap& w, TensorMap& grads,
                              std::initializer_list<const char*> projs, const std::vector<at::Tensor>& dys,
                              const at::Tensor& x);
// A fresh leaf that aliases t: autograd reads it, never writes it.
at::Tensor leaf(const at::Tensor& t);

// The attention half's forward: x1 = x + attention(x) ([b, s, hidden]),
// tiles as layer_forward's; `save` receives q, k, v and the core's part of
// LayerSaved. No grad.
at::Tensor attention_forward(const BlockDims& d, const TensorMap& w, const TokenLayout& layout, const at::Tensor& x,
                             int64_t token_tile, const LayerSaved* save);

// The attention half's backward in two steps around the MLP's. First the
// core's graph from the projections (kept in `saved`, or recomputed from x),
// its output a ([tokens, heads * head_dim]) and x1 (kept, or recomputed: the
// forward's bits).
struct AttentionRecompute {
  AttentionGraph core;
  at::Tensor a_flat, x1;
  bool qk_norm_grads = false;  // the q/k norms' weights train
};
AttentionRecompute attention_recompute(const BlockDims& d, const TensorMap& w, const TensorMap& grads,
                                       const TokenLayout& layout, const at::Tensor& x, int64_t token_tile,
                                       const LayerSaved* saved);
// d(loss)/d(x1) rows into `gx1`, from the MLP input's gradient dh2 (the
// MLP's pre-norm's output; consumed) and the stream's gradient `gout`, for
// rows x1 of the residual stream: the pre-norm's backward by autograd (its
// weight's gradient added where it trains), plus the residual.
void mlp_input_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const at::Tensor& x1,
                        at::Tensor dh2, const at::Tensor& gout, const at::Tensor& gx1);
// Then, given gx1 = d(loss)/d(x1) ([tokens, hidden], ours: the input's
// gradient is summed into it), o_proj's, the core's, the q/k/v projections'
// and the input norm's gradients added into `grads`; returns d(loss)/dx.
// Consumes `r`.
at::Tensor attention_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const at::Tensor& x,
                              AttentionRecompute& r, at::Tensor gx1, int64_t token_tile);

}  // namespace strider::block_parts
