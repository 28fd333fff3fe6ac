#include "gpu/blocks.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
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

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
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

// The layer's forward on tensors that may require grad (shared by the plain
// forward and the recompute).
at::Tensor layer(const BlockDims& d, const TensorMap& w, const RopeTables& rope, const at::Tensor& x) {
  const int64_t b = x.size(0), s = x.size(1);
  STRIDER_CHECK(d.sliding_window == 0 || s <= d.sliding_window,
                "sequence length {} exceeds the model's sliding window {}; strider computes full "
                "causal attention only", s, d.sliding_window);
  at::Tensor h = rms_norm(x, weight(w, "input_layernorm.weight"), d.rms_eps);
  at::Tensor q = linear(h, w, "self_attn.q_proj").view({b, s, d.heads, d.head_dim});
  at::Tensor k = linear(h, w, "self_attn.k_proj").view({b, s, d.kv_heads, d.head_dim});
  at::Tensor v = linear(h, w, "self_attn.v_proj").view({b, s, d.kv_heads, d.head_dim});
  if (d.qk_norm) {
    q = rms_norm(q, weight(w, "self_attn.q_norm.weight"), d.rms_eps);
    k = rms_norm(k, weight(w, "self_attn.k_norm.weight"), d.rms_eps);
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  v = v.transpose(1, 2);
  // [s, head_dim] broadcasts over batch and heads.
  q = q * rope.cos + rotate_half(q) * rope.sin;
  k = k * rope.cos + rotate_half(k) * rope.sin;
  if (d.kv_heads != d.heads) {
    const int64_t rep = d.heads / d.kv_heads;
    k = k.repeat_interleave(rep, 1);
    v = v.repeat_interleave(rep, 1);
  }
  at::Tensor a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
  a = a.transpose(1, 2).reshape({b, s, d.heads * d.head_dim});
  at::Tensor x1 = x + linear(a, w, "self_attn.o_proj");
  at::Tensor h2 = rms_norm(x1, weight(w, "post_attention_layernorm.weight"), d.rms_eps);
  at::Tensor mlp = linear(at::silu(linear(h2, w, "mlp.gate_proj")) * linear(h2, w, "mlp.up_proj"), w,
                          "mlp.down_proj");
  return x1 + mlp;
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
                         const at::Tensor& x) {
  at::NoGradGuard no_grad;
  return layer(d, w, rope, x);
}

at::Tensor layer_backward(const BlockDims& d, const TensorMap& w, const RopeTables& rope,
                          const at::Tensor& x, const at::Tensor& grad_out, TensorMap& grads) {
  at::AutoGradMode enable(true);
  // Leaves that alias the unit's memory: autograd reads them, never writes.
  TensorMap leaves;
  std::vector<at::Tensor> inputs;
  at::Tensor xin = x.detach().requires_grad_(true);
  inputs.push_back(xin);
  for (const auto& [name, t] : w) {
    at::Tensor leaf = t.detach().requires_grad_(true);
    leaves.emplace(name, leaf);
    inputs.push_back(leaf);
  }
  at::Tensor out = layer(d, leaves, rope, xin);
  std::vector<at::Tensor> g = torch::autograd::grad({out}, inputs, {grad_out});
  size_t i = 1;
  for (const auto& [name, t] : w) {
    auto it = grads.find(name);
    STRIDER_CHECK(it != grads.end(), "model block: no gradient accumulator for '{}'", name);
    it->second.add_(g[i++]);
  }
  return g[0];
}

}  // namespace strider
