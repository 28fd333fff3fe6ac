#include "gpu/attention.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "gpu/block_parts.h"
#include "gpu/softcap_attention.h"
#include "host/error.h"

namespace strider {
namespace {

using block_parts::weight;

// at::_fused_sdp_choice's answers (sdp::SDPBackend in ATen's internal
// sdp_utils_cpp.h): math (unfused) and flash attention.
constexpr int64_t kSdpMath = 0, kSdpFlash = 1;

at::Tensor norm(const BlockDims& d, const TensorMap& w, const char* name, const at::Tensor& x) {
  return rms_norm(x, weight(w, name), d.rms_eps, d.norm);
}

// Attention over s positions that plain causal attention does not give: a
// sliding window below the sequence, or rows that pack documents. The
// additive mask (0 where query i sees key j: j <= i, i - window < j, the
// same document; -inf elsewhere) in the compute dtype, [s, s] for every row,
// or [b, 1, s, s] with documents; SDPA reads it for every head. Undefined
// where causal attention is all there is (is_causal). SDPA would turn a
// boolean mask into this itself; built here, it is built once per call.
at::Tensor attention_mask(const BlockDims& d, const at::Tensor& docs, int64_t s, const at::TensorOptions& options) {
  const bool windowed = d.sliding_window > 0 && s > d.sliding_window;
  if (!windowed && !docs.defined()) return {};
  const at::Tensor i = at::arange(s, options.dtype(at::kLong)).unsqueeze(1), j = i.view({1, s});
  at::Tensor hidden = j > i;
  if (windowed) hidden.logical_or_(j <= i - d.sliding_window);
  if (docs.defined()) hidden = hidden.logical_or(docs.unsqueeze(2) != docs.unsqueeze(1)).unsqueeze(1);
  return at::zeros(hidden.sizes(), options).masked_fill_(hidden, -std::numeric_limits<double>::infinity());
}

// SDPA's operands, [b, heads (or kv_heads), s, head_dim] each, after the q/k
// norms and RoPE, and how it is called.
struct Sdpa {
  at::Tensor q, k, v, mask;
  bool causal = true, grouped = false;
  std::optional<double> scale;
  int64_t choice = kSdpMath;
  std::optional<at::Tensor> attn_mask() const { return mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt; }
};

Sdpa sdpa_operands(const BlockDims& d, const TensorMap& w, const TokenLayout& layout, at::Tensor q_proj,
                   at::Tensor k_proj, at::Tensor v_proj) {
  const int64_t b = q_proj.size(0), s = q_proj.size(1);
  if (d.qk_norm && d.qk_norm_whole) {  // OLMo 2: over the whole projection, before the heads
    q_proj = norm(d, w, "self_attn.q_norm.weight", q_proj);
    k_proj = norm(d, w, "self_attn.k_norm.weight", k_proj);
  }
  Sdpa op;
  op.q = q_proj.view({b, s, d.heads, d.head_dim});
  op.k = k_proj.view({b, s, d.kv_heads, d.head_dim});
  op.v = v_proj.view({b, s, d.kv_heads, d.head_dim});
  q_proj = k_proj = v_proj = at::Tensor();  // the callers' own references go as the core replaces them
  if (d.qk_norm && !d.qk_norm_whole) {
    op.q = norm(d, w, "self_attn.q_norm.weight", op.q);
    op.k = norm(d, w, "self_attn.k_norm.weight", op.k);
  }
  op.q = apply_rope(op.q, layout.rope).transpose(1, 2);
  op.k = apply_rope(op.k, layout.rope).transpose(1, 2);
  op.v = op.v.transpose(1, 2);
  if (d.attn_softcap > 0) return op;  // Gemma 2: softcap_attention, below
  // enable_gqa: each group of heads / kv_heads query heads reads its K/V head
  // in place; no repeated K/V is materialised. The CPU picks its flash
  // kernel (no S x S scores) for grouped K/V with and without grad, and so
  // does CUDA in 16 bits. Where no fused kernel takes grouped K/V (fp32 on
  // CUDA: flash wants 16 bits, memory-efficient equal heads), ATen would
  // fall back to math (S x S scores); repeated K/V let memory-efficient run.
  // A sliding window below the sequence, or packed documents: an additive
  // mask (causality in it), which the CPU's flash kernel and CUDA's
  // memory-efficient one read (CUDA's flash kernel takes no mask); O(s^2)
  // bytes (per row with documents), in the working-memory model.
  op.grouped = d.kv_heads != d.heads;
  op.scale = d.attn_scale > 0 ? std::optional<double>(d.attn_scale) : std::nullopt;
  op.mask = attention_mask(d, layout.docs, s, op.q.options());
  op.causal = !op.mask.defined();
  // The kernel, asked for tensors without grad, so that a kept layer's
  // forward (no grad) and its backward (grad) agree on it: whether the
  // forward kept a log-sum-exp is what the backward reads from this.
  auto choice = [&] {
    return at::_fused_sdp_choice(op.q.detach(), op.k.detach(), op.v.detach(), op.attn_mask(), 0.0, op.causal,
                                 op.scale, op.grouped);
  };
  op.choice = choice();
  if (op.grouped && op.choice == kSdpMath) {
    op.k = op.k.repeat_interleave(d.heads / d.kv_heads, 1);
    op.v = op.v.repeat_interleave(d.heads / d.kv_heads, 1);
    op.grouped = false;
    op.choice = choice();
  }
  return op;
}

// Whether the kernel SDPA runs for `op` has a backward the engine calls
// itself: the flash kernel's, on the CPU; on CUDA, where SDPA calls it
// without padding the head (a multiple of 8 features).
bool has_backward(const BlockDims& d, const Sdpa& op) {
  if (d.attn_softcap > 0 || op.choice != kSdpFlash) return false;
  return op.q.is_cpu() || (op.q.is_cuda() && !op.mask.defined() && d.head_dim % 8 == 0);
}

// The kernel's log-sum-exp ([b, heads, s] fp32) in a kept layer's flat
// `lse`, laid out as the kernel lays it out: the CPU's flash kernel writes
// it token-major ([b, s, heads] transposed), CUDA's [b, heads, s].
at::Tensor lse_view(const at::Tensor& flat, const at::Tensor& q) {
  const int64_t b = q.size(0), heads = q.size(1), s = q.size(2);
  return q.is_cpu() ? flat.view({b, s, heads}).transpose(1, 2) : flat.view({b, heads, s});
}

// [b, heads, s, head_dim] -> [b, s, heads * head_dim] (o_proj's input).
at::Tensor merge_heads(const at::Tensor& a) {
  return a.transpose(1, 2).reshape({a.size(0), a.size(2), a.size(1) * a.size(3)});
}

// The core on `op` (consumed), as o_proj's input; `lse` (a kept layer's):
// the kernel's log-sum-exp written there where it has a backward to call
// (else zeros).
at::Tensor run_core(const BlockDims& d, const TokenLayout& layout, Sdpa& op, const at::Tensor& lse) {
  at::Tensor a;
  if (d.attn_softcap > 0) {  // Gemma 2: no SDPA kernel soft-caps the scores
    const double scale = d.attn_scale > 0 ? d.attn_scale : 1.0 / std::sqrt(double(d.head_dim));
    a = softcap_attention(op.q, op.k, op.v, scale, d.attn_softcap, d.sliding_window, 0, layout.docs);
  } else if (!lse.defined() || !has_backward(d, op)) {
    if (lse.defined()) lse.zero_();
    a = at::scaled_dot_product_attention(op.q, op.k, op.v, op.attn_mask(), 0.0, op.causal, op.scale, op.grouped);
  } else if (op.q.is_cpu()) {  // the kernel SDPA dispatches to, the same call, keeping its log-sum-exp
    at::Tensor logsumexp;
    std::tie(a, logsumexp) =
        at::_scaled_dot_product_flash_attention_for_cpu(op.q, op.k, op.v, 0.0, op.causal, op.attn_mask(), op.scale);
    lse_view(lse, op.q).copy_(logsumexp);
  } else {
    auto r = at::_scaled_dot_product_flash_attention(op.q, op.k, op.v, 0.0, op.causal, false, op.scale);
    a = std::get<0>(r);
    lse_view(lse, op.q).copy_(std::get<1>(r));
  }
  op = {};
  return merge_heads(a);
}

}  // namespace

// Without materialising rotate_half (a concatenation the size of x): the
// products of the halves are subtracted from / added to x * cos in place.
// Each element sees the same roundings (a product, a product, a sum), so the
// same bits. In place on `out` is safe under autograd: x * cos saves cos,
// not its result. Applied before heads are transposed, so that x's gradient
// keeps x's layout, as transformers' does.
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope) {
  const int64_t dim = rope.cos.size(-1);
  if (dim < x.size(-1))  // partial rotary (Phi-4-mini): the first dim features rotate, the rest pass
    return at::cat({apply_rope(x.narrow(-1, 0, dim), rope), x.narrow(-1, dim, x.size(-1) - dim)}, -1);
  const int64_t half = x.size(-1) / 2;
  const at::Tensor cos = rope.cos.unsqueeze(-2), sin = rope.sin.unsqueeze(-2);  // [(b,) s, 1, head_dim]
  at::Tensor out = x * cos;
  out.slice(-1, 0, half).sub_(x.slice(-1, half) * sin.slice(-1, 0, half));
  out.slice(-1, half).add_(x.slice(-1, 0, half) * sin.slice(-1, half));
  return out;
}

at::Tensor attention_core(const BlockDims& d, const TensorMap& w, const TokenLayout& layout, at::Tensor q_proj,
                          at::Tensor k_proj, at::Tensor v_proj, const LayerSaved* keep) {
  Sdpa op = sdpa_operands(d, w, layout, std::move(q_proj), std::move(k_proj), std::move(v_proj));
  at::Tensor out = run_core(d, layout, op, keep ? keep->lse : at::Tensor());
  if (keep && keep->attn.defined()) keep->attn.copy_(out.view({-1, d.heads * d.head_dim}));
  return out;
}

AttentionGraph attention_graph(const BlockDims& d, const TensorMap& w, const TokenLayout& layout,
                               const std::vector<at::Tensor>& inputs, const LayerSaved* kept) {
  AttentionGraph g;
  at::AutoGradMode enable(true);
  const int64_t b = inputs[0].size(0), s = inputs[0].size(1);
  Sdpa op = sdpa_operands(d, w, layout, inputs[0], inputs[1], inputs[2]);
  if (kept && kept->lse.defined() && has_backward(d, op)) {
    g.out = kept->attn.view({b, s, d.heads * d.head_dim});
    g.kept_out = kept->attn.view({b, s, d.heads, d.head_dim}).transpose(1, 2);
    g.lse = lse_view(kept->lse, op.q);
    g.q = std::move(op.q), g.k = std::move(op.k), g.v = std::move(op.v), g.mask = std::move(op.mask);
    g.causal = op.causal;
    g.scale = op.scale;
    return g;
  }
  g.graph_out = run_core(d, layout, op, {});
  g.out = g.graph_out.detach();
  return g;
}

std::vector<at::Tensor> attention_grads(AttentionGraph& g, const std::vector<at::Tensor>& inputs,
                                        const at::Tensor& da) {
  if (!g.direct()) {
    at::AutoGradMode enable(true);
    std::vector<at::Tensor> out = torch::autograd::grad({g.graph_out}, inputs, {da.view(g.graph_out.sizes())});
    g = {};
    return out;
  }
  // What autograd's SDPA node would call: the kernel's backward, given the
  // output's gradient in the output's own layout.
  const int64_t b = g.q.size(0), heads = g.q.size(1), s = g.q.size(2);
  const at::Tensor dout = da.view({b, s, heads, -1}).transpose(1, 2);
  at::Tensor dq, dk, dv;
  {
    at::NoGradGuard no_grad;
    const std::optional<at::Tensor> mask = g.mask.defined() ? std::optional<at::Tensor>(g.mask) : std::nullopt;
    const at::Tensor q = g.q.detach(), k = g.k.detach(), v = g.v.detach();
    if (q.is_cpu()) {
      std::tie(dq, dk, dv) = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          dout, q, k, v, g.kept_out, g.lse, 0.0, g.causal, mask, g.scale);
    } else {
      // No dropout: the random state's seed and offset are read by neither.
      const at::Tensor seed = at::zeros({}, at::kLong), offset = at::zeros({}, at::kLong);
      std::tie(dq, dk, dv) = at::_scaled_dot_product_flash_attention_backward(
          dout, q, k, v, g.kept_out, g.lse, at::Tensor(), at::Tensor(), s, s, 0.0, g.causal, seed, offset, g.scale);
    }
  }
  at::AutoGradMode enable(true);
  std::vector<at::Tensor> out = torch::autograd::grad({g.q, g.k, g.v}, inputs, {dq, dk, dv});
  g = {};
  return out;
}

}  // namespace strider
