#include "gpu/blocks.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <string_view>
#include <vector>

#include "host/error.h"

namespace strider {
namespace {

const at::Tensor& weight(const TensorMap& w, std::string_view name) {
  auto it = w.find(name);
  STRIDER_CHECK(it != w.end(), "model block: weight '{}' is missing", name);
  return it->second;
}
at::Tensor optional_weight(const TensorMap& w, std::string_view name) {
  auto it = w.find(name);
  return it == w.end() ? at::Tensor() : it->second;
}

at::Tensor linear(const at::Tensor& x, const TensorMap& w, const std::string& proj) {
  return at::linear(x, weight(w, proj + ".weight"), optional_weight(w, proj + ".bias"));
}

// x * cos + rotate_half(x) * sin for x [b, s, heads, head_dim], as
// transformers computes it, without materialising rotate_half (a
// concatenation the size of x): the products of the halves are subtracted
// from / added to x * cos in place. Each element sees the same roundings (a
// product, a product, a sum), so the same bits. In place on `out` is safe
// under autograd: x * cos saves cos, not its result. Applied before heads are
// transposed, so that x's gradient keeps x's layout, as transformers' does.
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor cos = rope.cos.unsqueeze(1), sin = rope.sin.unsqueeze(1);  // [s, 1, head_dim]
  at::Tensor out = x * cos;
  out.slice(-1, 0, half).sub_(x.slice(-1, half) * sin.slice(-1, 0, half));
  out.slice(-1, half).add_(x.slice(-1, 0, half) * sin.slice(-1, half));
  return out;
}

// Inverse frequencies in fp32, including the rope_type's scaling.
at::Tensor inv_freq(const RopeDims& r, int64_t head_dim) {
  at::Tensor exps = at::arange(0, head_dim, 2, at::kLong).to(at::kFloat) / double(head_dim);
  at::Tensor inv = at::pow(r.theta, exps).reciprocal();
  switch (r.type) {
    case RopeType::kDefault: return inv;
    case RopeType::kLinear: return inv / r.factor;
    case RopeType::kLlama3: {
      const double old_ctx = double(r.original_max_position);
      const double low_wavelen = old_ctx / r.low_freq_factor;
      const double high_wavelen = old_ctx / r.high_freq_factor;
      at::Tensor wavelen = 2 * M_PI / inv;
      at::Tensor scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
      at::Tensor smooth = (old_ctx / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
      at::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
      at::Tensor medium = at::logical_not(wavelen < high_wavelen) & at::logical_not(wavelen > low_wavelen);
      return at::where(medium, smoothed, scaled);
    }
  }
  return inv;
}

// at::_fused_sdp_choice's answer for the math (unfused) backend
// (sdp::SDPBackend::math in ATen's internal sdp_utils_cpp.h).
constexpr int64_t kSdpMath = 0;

// The attention half of the layer: x1 = x + o_proj(attention(norm(x))), on
// tensors that may require grad (shared by the plain forward and the
// recompute).
at::Tensor attention_part(const BlockDims& d, const TensorMap& w, const RopeTables& rope,
                          const at::Tensor& x) {
  const int64_t b = x.size(0), s = x.size(1);
  STRIDER_CHECK(d.sliding_window == 0 || s <= d.sliding_window,
                "sequence length {} exceeds the model's sliding window {}; strider computes full "
                "causal attention only", s, d.sliding_window);
  at::Tensor h = rms_norm(x, weight(w, "input_layernorm.weight"), d.rms_eps);
  at::Tensor q = linear(h, w, "self_attn.q_proj").view({b, s, d.heads, d.head_dim});
  at::Tensor k = linear(h, w, "self_attn.k_proj").view({b, s, d.kv_heads, d.head_dim});
  at::Tensor v = linear(h, w, "self_attn.v_proj").view({b, s, d.kv_heads, d.head_dim});
  h = at::Tensor();
  if (d.qk_norm) {
    q = rms_norm(q, weight(w, "self_attn.q_norm.weight"), d.rms_eps);
    k = rms_norm(k, weight(w, "self_attn.k_norm.weight"), d.rms_eps);
  }
  q = apply_rope(q, rope).transpose(1, 2);
  k = apply_rope(k, rope).transpose(1, 2);
  v = v.transpose(1, 2);
  // enable_gqa: each group of heads / kv_heads query heads reads its K/V head
  // in place; no repeated K/V is materialised. The CPU picks its flash
  // kernel (no S x S scores) for grouped K/V with and without grad, and so
  // does CUDA in 16 bits. Where no fused kernel takes grouped K/V (fp32 on
  // CUDA: flash wants 16 bits, memory-efficient equal heads), ATen would
  // fall back to math (S x S scores); repeated K/V let memory-efficient run.
  bool grouped = d.kv_heads != d.heads;
  if (grouped && at::_fused_sdp_choice(q, k, v, {}, 0.0, /*is_causal=*/true, std::nullopt,
                                       /*enable_gqa=*/true) == kSdpMath) {
    k = k.repeat_interleave(d.heads / d.kv_heads, 1);
    v = v.repeat_interleave(d.heads / d.kv_heads, 1);
    grouped = false;
  }
  at::Tensor a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, std::nullopt,
                                                  /*enable_gqa=*/grouped);
  q = k = v = at::Tensor();
  a = a.transpose(1, 2).reshape({b, s, d.heads * d.head_dim});
  return x + linear(a, w, "self_attn.o_proj");
}

// The MLP half without its residual: mlp(norm(x1)), for x1 [..., hidden].
at::Tensor mlp_part(const BlockDims& d, const TensorMap& w, const at::Tensor& x1) {
  at::Tensor h = rms_norm(x1, weight(w, "post_attention_layernorm.weight"), d.rms_eps);
  at::Tensor act = linear(h, w, "mlp.gate_proj");
  if (at::GradMode::is_enabled()) {
    act = at::silu(act) * linear(h, w, "mlp.up_proj");
  } else {  // in place: two [tokens, intermediate] tensors alive, not three; the same bits
    at::silu_(act);
    act.mul_(linear(h, w, "mlp.up_proj"));
  }
  h = at::Tensor();
  return linear(act, w, "mlp.down_proj");
}

// Which half of the layer a parameter belongs to (names as in gpu/blocks.h).
bool in_mlp_part(std::string_view name) {
  return name.starts_with("mlp.") || name == "post_attention_layernorm.weight";
}

// Tokens per MLP tile for n tokens: all of them when untiled.
int64_t tile_tokens(int64_t token_tile, int64_t n) {
  STRIDER_CHECK(token_tile >= 0, "token tile {} must be >= 0 (0: untiled)", token_tile);
  return token_tile == 0 || token_tile > n ? n : token_tile;
}

// Adds each gradient g[i] into the fp32 accumulator of names[i].
void accumulate(TensorMap& grads, const std::vector<std::string_view>& names,
                const std::vector<at::Tensor>& g, size_t first) {
  for (size_t i = 0; i < names.size(); ++i) {
    auto it = grads.find(names[i]);
    STRIDER_CHECK(it != grads.end(), "model block: no gradient accumulator for '{}'", names[i]);
    it->second.add_(g[first + i]);
  }
}

}  // namespace

RopeTables rope_tables(const RopeDims& rope, int64_t head_dim, int64_t seq, at::ScalarType dtype,
                       at::Device device) {
  at::Tensor inv = inv_freq(rope, head_dim);
  at::Tensor pos = at::arange(seq, at::kLong).to(at::kFloat);
  at::Tensor freqs = at::outer(pos, inv);           // [seq, head_dim / 2], fp32
  at::Tensor emb = at::cat({freqs, freqs}, -1);     // [seq, head_dim]
  return {emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (xf * at::rsqrt(var + eps)).to(x.scalar_type());
}

at::Tensor embedding_forward(const at::Tensor& weight, const at::Tensor& ids) {
  return at::embedding(weight, ids);
}

void embedding_backward(const at::Tensor& ids, const at::Tensor& grad_out, at::Tensor& grad_weight) {
  const int64_t hidden = grad_weight.size(1);
  grad_weight.index_add_(0, ids.reshape({-1}), grad_out.reshape({-1, hidden}).to(at::kFloat));
}

void embedding_shard_forward(const at::Tensor& rows, int64_t v0, const at::Tensor& ids, const at::Tensor& out) {
  const int64_t n = rows.size(0), hidden = rows.size(1);
  at::Tensor flat_ids = ids.reshape({-1});
  at::Tensor sel = ((flat_ids >= v0) & (flat_ids < v0 + n)).nonzero().squeeze(1);  // token positions, in order
  at::Tensor flat_out = out.view({-1, hidden});
  flat_out.index_copy_(0, sel, rows.index_select(0, flat_ids.index_select(0, sel) - v0));
}

void embedding_shard_backward(const at::Tensor& ids, int64_t v0, const at::Tensor& grad_out,
                              const at::Tensor& grad_rows) {
  const int64_t n = grad_rows.size(0), hidden = grad_rows.size(1);
  at::Tensor flat_ids = ids.reshape({-1});
  at::Tensor sel = ((flat_ids >= v0) & (flat_ids < v0 + n)).nonzero().squeeze(1);
  grad_rows.index_add_(0, flat_ids.index_select(0, sel) - v0,
                       grad_out.reshape({-1, hidden}).index_select(0, sel).to(at::kFloat));
}

at::Tensor layer_forward(const BlockDims& d, const TensorMap& w, const RopeTables& rope,
                         const at::Tensor& x, int64_t token_tile) {
  at::NoGradGuard no_grad;
  at::Tensor x1 = attention_part(d, w, rope, x);
  // x1 + mlp, tile by tile, in place: x1 is ours (a fresh sum), and the sum
  // rounds the same in place as out of place.
  const int64_t n = x1.size(0) * x1.size(1);
  const int64_t tile = tile_tokens(token_tile, n);
  at::Tensor flat = x1.contiguous().view({n, d.hidden});
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    at::Tensor t = flat.slice(0, t0, std::min(n, t0 + tile));
    t.add_(mlp_part(d, w, t));
  }
  return flat.view(x1.sizes());
}

at::Tensor layer_backward(const BlockDims& d, const TensorMap& w, const RopeTables& rope,
                          const at::Tensor& x, const at::Tensor& grad_out, TensorMap& grads,
                          int64_t token_tile) {
  at::AutoGradMode enable(true);
  // Leaves that alias the unit's memory: autograd reads them, never writes.
  // Split by half, so that each backward returns only its own half's gradients.
  TensorMap leaves;
  std::vector<std::string_view> attn_names, mlp_names;
  std::vector<at::Tensor> attn_inputs(1), mlp_inputs(1);  // [0]: the half's input
  for (const auto& [name, t] : w) {
    at::Tensor leaf = t.detach().requires_grad_(true);
    const bool mlp = in_mlp_part(name);
    (mlp ? mlp_names : attn_names).push_back(name);
    (mlp ? mlp_inputs : attn_inputs).push_back(leaf);
    leaves.emplace(name, leaf);
  }

  // 1. Attention, recomputed with autograd; its graph waits for step 3.
  attn_inputs[0] = x.detach().requires_grad_(true);
  at::Tensor x1 = attention_part(d, leaves, rope, attn_inputs[0]);

  // 2. The MLP tile by tile: recompute the tile with autograd, back-propagate
  // it, add its weight gradients to the accumulators, keep d(loss)/d(x1) for
  // its tokens. The residual is part of the tile's graph so that autograd
  // sums x1's gradients (residual, and in fp32 the norm's two uses of x1) in
  // the order one graph over the whole layer would: untiled, the same bits.
  const int64_t n = x1.size(0) * x1.size(1);
  const int64_t tile = tile_tokens(token_tile, n);
  const at::Tensor x1_flat = x1.detach().reshape({n, d.hidden});
  const at::Tensor gout_flat = grad_out.reshape({n, d.hidden});
  at::Tensor gx1 = at::empty({n, d.hidden}, x1.options());
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    mlp_inputs[0] = x1_flat.slice(0, t0, t1).detach().requires_grad_(true);
    at::Tensor y = mlp_inputs[0] + mlp_part(d, leaves, mlp_inputs[0]);
    std::vector<at::Tensor> g = torch::autograd::grad({y}, mlp_inputs, {gout_flat.slice(0, t0, t1)});
    accumulate(grads, mlp_names, g, 1);
    gx1.slice(0, t0, t1).copy_(g[0]);
  }
  mlp_inputs.clear();

  // 3. Attention's backward from d(loss)/d(x1).
  std::vector<at::Tensor> g = torch::autograd::grad({x1}, attn_inputs, {gx1.view(x1.sizes())});
  accumulate(grads, attn_names, g, 1);
  return g[0];
}

}  // namespace strider
