#include "gpu/blocks/attention.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "gpu/blocks/block_parts.h"
#include "gpu/blocks/softcap_attention.h"
#include "host/error.h"

namespace strider {
namespace {

using block_parts::weight;

// at::_fused_sdp_choice's answers (sdp::SDPBackend in ATen's internal
// sdp_utils_cpp.h): math (unfused) and flash attention.
constexpr int64_t kSdpMath = 0, kSdpFlash = 1;
constexpr double kInf = std::numeric_limits<double>::infinity();

at::Tensor norm(const BlockDims& d, const TensorMap& w, const char* name, const at::Tensor& x) {
  return rms_norm(x, weight(w, name), d.rms_eps, d.norm);
}

at::Tensor leaf(const at::Tensor& t) { return t.detach().requires_grad_(true); }

// A sliding window below the sequence: queries see only the window's keys.
bool windowed(const BlockDims& d, int64_t s) { return d.sliding_window > 0 && s > d.sliding_window; }

// The additive mask of queries [q0, q1) over keys [k0, k1): 0 where query i
// sees key j (j <= i, i - window < j, the same document), -inf elsewhere, in
// the compute dtype: [q1 - q0, k1 - k0] for every row, or [b, 1, q1 - q0,
// k1 - k0] with documents; SDPA reads it for every head. SDPA would turn a
// boolean mask into this itself; built here, it is built once per call.
at::Tensor attention_mask(const BlockDims& d, const at::Tensor& docs, int64_t s, int64_t q0, int64_t q1, int64_t k0,
                          int64_t k1, const at::TensorOptions& options) {
  const at::TensorOptions idx = options.dtype(at::kLong);
  const at::Tensor i = at::arange(q0, q1, idx).unsqueeze(1), j = at::arange(k0, k1, idx).view({1, k1 - k0});
  at::Tensor hidden = j > i;
  if (windowed(d, s)) hidden.logical_or_(j <= i - d.sliding_window);
  if (docs.defined())
    hidden = hidden.logical_or(docs.slice(1, q0, q1).unsqueeze(2) != docs.slice(1, k0, k1).unsqueeze(1)).unsqueeze(1);
  return at::zeros(hidden.sizes(), options).masked_fill_(hidden, -kInf);
}

using Keys = AttentionKeys;  // gpu/blocks/attention.h

Keys keys(const BlockDims& d, const TensorMap& w, const TokenLayout& layout, at::Tensor k_proj, at::Tensor v_proj) {
  const int64_t b = k_proj.size(0), s = k_proj.size(1);
  if (d.qk_norm && d.qk_norm_whole) k_proj = norm(d, w, "self_attn.k_norm.weight", k_proj);  // OLMo 2
  Keys K;
  K.k = k_proj.view({b, s, d.kv_heads, d.head_dim});
  K.v = v_proj.view({b, s, d.kv_heads, d.head_dim}).transpose(1, 2);
  k_proj = v_proj = at::Tensor();
  if (d.qk_norm && !d.qk_norm_whole) K.k = norm(d, w, "self_attn.k_norm.weight", K.k);
  K.k = apply_rope(K.k, layout.rope).transpose(1, 2);
  K.masked = windowed(d, s) || layout.docs.defined();
  K.scale = d.attn_scale > 0 ? std::optional<double>(d.attn_scale) : std::nullopt;
  return K;
}

// The queries of positions [t0, t0 + tq) from their projections q_proj [b,
// tq, heads x head_dim]: [b, heads, tq, head_dim], after the q norm and
// RoPE (the same ops, element by element, for any tile).
at::Tensor queries(const BlockDims& d, const TensorMap& w, const TokenLayout& layout, at::Tensor q_proj, int64_t t0) {
  const int64_t b = q_proj.size(0), tq = q_proj.size(1);
  if (d.qk_norm && d.qk_norm_whole) q_proj = norm(d, w, "self_attn.q_norm.weight", q_proj);  // OLMo 2
  at::Tensor q = q_proj.view({b, tq, d.heads, d.head_dim});
  q_proj = at::Tensor();
  if (d.qk_norm && !d.qk_norm_whole) q = norm(d, w, "self_attn.q_norm.weight", q);
  const RopeTables rope{layout.rope.cos.narrow(-2, t0, tq), layout.rope.sin.narrow(-2, t0, tq)};
  return apply_rope(q, rope).transpose(1, 2);
}

// The kernel for the first tile's call (queries q0, t0 = 0), asked for
// tensors without grad, so that a kept layer's forward (no grad) and its
// backward (grad) agree on it: whether the forward kept a log-sum-exp is
// what the backward reads from this. enable_gqa: each group of heads /
// kv_heads query heads reads its K/V head in place; no repeated K/V is
// materialised. The CPU picks its flash kernel (no S x S scores) for grouped
// K/V with and without grad, and so does CUDA in 16 bits. Where no fused
// kernel takes grouped K/V (fp32 on CUDA: flash wants 16 bits,
// memory-efficient equal heads), ATen would fall back to math (S x S
// scores); repeated K/V let memory-efficient run. A window below the
// sequence, or packed documents: an additive mask (causality in it), which
// the CPU's flash kernel and CUDA's memory-efficient one read (CUDA's flash
// kernel takes no mask). Then whether the kernel has a backward the engine
// calls itself: the flash kernel's, on the CPU; on CUDA, where SDPA calls it
// without padding the head (a multiple of 8 features).
void choose(const BlockDims& d, const TokenLayout& layout, Keys& K, const at::Tensor& q0, AttentionPath path) {
  const int64_t b = q0.size(0), tq = q0.size(2);
  K.grouped = d.kv_heads != d.heads;
  if (d.attn_softcap > 0) return;  // Gemma 2: softcap_attention, no SDPA
  // The mask's values are not read: an allocation of its shape will do.
  const at::Tensor mask = !K.masked ? at::Tensor()
                          : at::empty(layout.docs.defined() ? at::IntArrayRef{b, 1, tq, tq} : at::IntArrayRef{tq, tq},
                                      q0.options());
  auto choice = [&] {
    return at::_fused_sdp_choice(q0.detach(), K.k.narrow(2, 0, tq).detach(), K.v.narrow(2, 0, tq).detach(),
                                 mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt, 0.0, !K.masked,
                                 K.scale, K.grouped);
  };
  K.choice = choice();
  if (K.grouped && K.choice == kSdpMath) {
    K.k = K.k.repeat_interleave(d.heads / d.kv_heads, 1);
    K.v = K.v.repeat_interleave(d.heads / d.kv_heads, 1);
    K.grouped = false;
    K.choice = choice();
  }
  K.direct = path == AttentionPath::kAuto && K.choice == kSdpFlash &&
             (q0.is_cpu() || (q0.is_cuda() && !K.masked && d.head_dim % 8 == 0));
}

// One kernel call of a tile: its keys [k0, k1), and its mask or causality.
struct Part {
  int64_t k0 = 0, k1 = 0;
  at::Tensor mask;
  bool causal = false, before = false;  // before: keys before the tile's first query
  std::optional<at::Tensor> attn_mask() const { return mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt; }
};

// The calls of queries [t0, t1): with a kernel whose backward is called
// directly, the keys before t0 (all seen but for a window's or documents'
// mask) and the tile's own square (causal); else one call over every key
// the tile sees, a mask giving its causal offset. The one tile [0, s) is
// one call either way.
std::vector<Part> parts(const BlockDims& d, const TokenLayout& layout, const Keys& K, int64_t t0, int64_t t1) {
  const int64_t s = K.k.size(2);
  const int64_t k0 = windowed(d, s) ? std::max<int64_t>(0, t0 - d.sliding_window + 1) : 0;
  const at::TensorOptions options = K.k.options().requires_grad(false);
  auto mask = [&](int64_t a, int64_t e) { return attention_mask(d, layout.docs, s, t0, t1, a, e, options); };
  if (!K.direct) {
    Part p{k0, t1};
    if ((K.masked || t0 > 0) && d.attn_softcap == 0) p.mask = mask(k0, t1);  // (softcap_attention masks itself)
    p.causal = !p.mask.defined();
    return {p};
  }
  std::vector<Part> out;
  if (t0 > k0) out.push_back({k0, t0, K.masked ? mask(k0, t0) : at::Tensor(), false, true});
  out.push_back({t0, t1, K.masked ? mask(t0, t1) : at::Tensor(), !K.masked});
  return out;
}

at::Tensor keys_of(const at::Tensor& t, const Part& p) { return t.narrow(2, p.k0, p.k1 - p.k0); }

// A part through the flash kernel: its output [b, heads, tq, head_dim] and
// log-sum-exp [b, heads, tq] (fp32). A query that sees none of the part's
// keys (a mask hides them all) gets log-sum-exp -inf and output 0 here (the
// CPU kernel writes 0 for both).
std::pair<at::Tensor, at::Tensor> flash(const at::Tensor& q, const Keys& K, const Part& p) {
  at::Tensor out, lse;
  if (q.is_cpu()) {
    std::tie(out, lse) = at::_scaled_dot_product_flash_attention_for_cpu(q, keys_of(K.k, p), keys_of(K.v, p), 0.0,
                                                                        p.causal, p.attn_mask(), K.scale);
  } else {
    auto r = at::_scaled_dot_product_flash_attention(q, keys_of(K.k, p), keys_of(K.v, p), 0.0, p.causal, false,
                                                     K.scale);
    out = std::get<0>(r), lse = std::get<1>(r);
  }
  if (p.before && p.mask.defined()) {  // (a tile's own square shows each query itself)
    const at::Tensor hidden = (p.mask == 0).any(-1).logical_not_();  // [tq] or [b, 1, tq]
    lse = lse.masked_fill(hidden, -kInf);
    out = out.masked_fill(hidden.unsqueeze(-1), 0);
  }
  return {out, lse};
}

// The tile's output from its parts' (the softmax over all its keys):
// weighted by exp(part's lse - merged lse), summed in fp32.
void merge(at::Tensor& out, at::Tensor& lse, const at::Tensor& out2, const at::Tensor& lse2) {
  const at::Tensor merged = at::logaddexp(lse, lse2);
  const at::Tensor w1 = (lse - merged).exp_().unsqueeze(-1), w2 = (lse2 - merged).exp_().unsqueeze(-1);
  out = out.to(at::kFloat).mul_(w1).add_(out2.to(at::kFloat).mul_(w2)).to(out2.scalar_type());
  lse = merged;
}

// A tile's core on q (its queries) as one differentiable call: SDPA over
// the part's keys, or (one tile) soft-capped attention.
at::Tensor tile_call(const BlockDims& d, const TokenLayout& layout, const Keys& K, const at::Tensor& q,
                     const Part& p, const at::Tensor& k, const at::Tensor& v) {
  if (d.attn_softcap > 0) {  // Gemma 2: no SDPA kernel soft-caps the scores
    const double scale = d.attn_scale > 0 ? d.attn_scale : 1.0 / std::sqrt(double(d.head_dim));
    return softcap_attention(q, k, v, scale, d.attn_softcap, d.sliding_window, 0, layout.docs);
  }
  return at::scaled_dot_product_attention(q, k, v, p.attn_mask(), 0.0, p.causal, K.scale, K.grouped);
}

// The kernel's log-sum-exp ([b, heads, s] fp32) in a kept layer's flat
// `lse`, laid out as the kernel lays it out: the CPU's flash kernel writes
// it token-major ([b, s, heads] transposed), CUDA's [b, heads, s].
at::Tensor lse_view(const at::Tensor& flat, const BlockDims& d, int64_t b, int64_t s) {
  return flat.is_cpu() ? flat.view({b, s, d.heads}).transpose(1, 2) : flat.view({b, d.heads, s});
}

// The core's forward over the tiles, no grad, as o_proj's input ([b, s,
// heads * head_dim]); with a kernel whose backward is called, its
// log-sum-exp into `lse` (where defined). q0: the first tile's queries
// (consumed); q_proj (consumed): the projections, released before the
// kernel runs where there is one tile (as the untiled core always did).
at::Tensor run_tiles(const BlockDims& d, const TensorMap& w, const TokenLayout& layout, at::Tensor q_proj,
                     at::Tensor q0, const Keys& K, int64_t tile, const at::Tensor& lse) {
  at::NoGradGuard no_grad;
  const int64_t b = q0.size(0), s = K.k.size(2);
  if (tile >= s) q_proj = at::Tensor();
  at::Tensor out;
  for (int64_t t0 = 0; t0 < s; t0 += tile) {
    const int64_t t1 = std::min(s, t0 + tile);
    at::Tensor q = t0 == 0 ? std::move(q0) : queries(d, w, layout, q_proj.narrow(1, t0, t1 - t0), t0);
    at::Tensor o, l;
    for (const Part& p : parts(d, layout, K, t0, t1)) {
      if (!K.direct) {
        o = tile_call(d, layout, K, q, p, keys_of(K.k, p), keys_of(K.v, p));
      } else if (!o.defined()) {
        std::tie(o, l) = flash(q, K, p);
      } else {
        auto [o2, l2] = flash(q, K, p);
        merge(o, l, o2, l2);
      }
    }
    q = at::Tensor();
    if (lse.defined() && l.defined()) lse.narrow(2, t0, t1 - t0).copy_(l);
    if (tile >= s) return o.transpose(1, 2).reshape({b, s, d.heads * d.head_dim});  // one tile: its heads merged
    if (!out.defined()) out = at::empty({b, s, d.heads * d.head_dim}, o.options());
    out.view({b, s, d.heads, d.head_dim}).narrow(1, t0, t1 - t0).copy_(o.transpose(1, 2));
  }
  return out;
}

// Soft-capped attention tiles its scores itself: one query tile here.
int64_t checked_tile(const BlockDims& d, int64_t tile, int64_t s) {
  STRIDER_CHECK(tile >= 1, "attention: query tile {} must be >= 1", tile);
  return d.attn_softcap > 0 ? s : std::min(tile, s);
}

}  // namespace

int64_t attention_query_tile(const BlockDims& d, int64_t b, int64_t s, int64_t token_tile) {
  if (token_tile <= 0 || token_tile >= b * s || d.attn_softcap > 0) return s;
  return std::max<int64_t>(1, token_tile / b);
}

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
                          at::Tensor k_proj, at::Tensor v_proj, int64_t tile, const LayerSaved* keep,
                          AttentionPath path) {
  at::NoGradGuard no_grad;
  const int64_t b = q_proj.size(0), s = q_proj.size(1);
  tile = checked_tile(d, tile, s);
  Keys K = keys(d, w, layout, std::move(k_proj), std::move(v_proj));
  at::Tensor q0 = queries(d, w, layout, q_proj.narrow(1, 0, tile), 0);
  choose(d, layout, K, q0, path);
  const bool lse = keep && keep->lse.defined();
  const at::Tensor out = run_tiles(d, w, layout, std::move(q_proj), std::move(q0), K, tile,
                                   lse && K.direct ? lse_view(keep->lse, d, b, s) : at::Tensor());
  if (lse && !K.direct) keep->lse.zero_();
  if (keep && keep->attn.defined()) keep->attn.copy_(out.view({-1, d.heads * d.head_dim}));
  return out;
}

AttentionGraph attention_graph(const BlockDims& d, const TensorMap& w, bool norm_grads, const TokenLayout& layout,
                               const at::Tensor& q_proj, const at::Tensor& k_proj, const at::Tensor& v_proj,
                               int64_t tile, const LayerSaved* kept, AttentionPath path) {
  const int64_t b = q_proj.size(0), s = q_proj.size(1);
  AttentionGraph g;
  g.d = &d, g.layout = &layout, g.w = w, g.norm_grads = norm_grads, g.tile = checked_tile(d, tile, s);
  g.q_proj = q_proj.detach();
  Keys K;
  {
    at::AutoGradMode enable(true);
    g.k_leaf = leaf(k_proj), g.v_leaf = leaf(v_proj);
    K = keys(d, g.w, layout, g.k_leaf, g.v_leaf);
  }
  at::Tensor q0;
  {
    at::NoGradGuard no_grad;
    q0 = queries(d, g.w, layout, g.q_proj.narrow(1, 0, g.tile), 0);
  }
  {
    at::AutoGradMode enable(true);  // K and V repeated (math's grouped K/V) keep their graph
    choose(d, layout, K, q0, path);
  }
  g.keys = K;
  if (K.direct && kept && kept->lse.defined()) {
    g.out = kept->attn.view({b, s, d.heads * d.head_dim});
    g.lse = lse_view(kept->lse, d, b, s);
  } else if (!K.direct && g.tile < s && kept && kept->attn.defined()) {
    g.out = kept->attn.view({b, s, d.heads * d.head_dim});
  } else if (K.direct || g.tile < s) {  // the forward again, as a kept layer's forward ran it
    if (K.direct) g.lse = lse_view(at::empty({b * s * d.heads}, q_proj.options().dtype(at::kFloat)), d, b, s);
    g.out = run_tiles(d, g.w, layout, g.q_proj, std::move(q0), K.detached(), g.tile, g.lse);
  } else {  // one tile, rebuilt with autograd: its output is the forward's
    q0 = at::Tensor();
    at::AutoGradMode enable(true);
    g.q_leaf = leaf(q_proj);
    const at::Tensor q = queries(d, g.w, layout, g.q_leaf, 0);
    const Part p = parts(d, layout, K, 0, s)[0];
    const at::Tensor a = tile_call(d, layout, K, q, p, K.k, K.v);
    g.graph_out = a.transpose(1, 2).reshape({b, s, d.heads * d.head_dim});
    g.out = g.graph_out.detach();
  }
  return g;
}

AttentionGrads attention_grads(AttentionGraph& g, const at::Tensor& da) {
  const BlockDims& d = *g.d;
  const TokenLayout& layout = *g.layout;
  const int64_t b = g.q_proj.size(0), s = g.q_proj.size(1);
  const bool norms = g.norm_grads;
  auto norm_leaf = [&](const char* name) { return g.w.at(name); };
  AttentionGrads r;
  if (g.graph_out.defined()) {  // one tile rebuilt: its graph, from the projections' leaves
    at::AutoGradMode enable(true);
    std::vector<at::Tensor> inputs{g.q_leaf, g.k_leaf, g.v_leaf};
    if (norms) inputs.insert(inputs.end(), {norm_leaf("self_attn.q_norm.weight"), norm_leaf("self_attn.k_norm.weight")});
    std::vector<at::Tensor> out = torch::autograd::grad({g.graph_out}, inputs, {da.view(g.graph_out.sizes())});
    r = {out[0], out[1], out[2]};
    if (norms) r.q_norm = out[3], r.k_norm = out[4];
    g = {};
    return r;
  }
  const Keys K = g.keys.detached();
  // Each key's gradient sums its share from every tile that sees it: in
  // fp32 across tiles (one tile: the kernel's, as it is).
  const bool one = g.tile >= s;
  at::Tensor dk = one ? at::Tensor() : at::zeros(K.k.sizes(), K.k.options().dtype(at::kFloat));
  at::Tensor dv = one ? at::Tensor() : at::zeros(K.v.sizes(), K.v.options().dtype(at::kFloat));
  r.q = at::empty(g.q_proj.sizes(), g.q_proj.options());
  const at::Tensor da4 = da.view({b, s, d.heads, d.head_dim});
  for (int64_t t0 = 0; t0 < s; t0 += g.tile) {
    const int64_t t1 = std::min(s, t0 + g.tile), tq = t1 - t0;
    const at::Tensor dout = da4.narrow(1, t0, tq).transpose(1, 2);
    at::Tensor q_leaf = leaf(g.q_proj.narrow(1, t0, tq)), q;
    {
      at::AutoGradMode enable(true);
      q = queries(d, g.w, layout, q_leaf, t0);
    }
    at::Tensor dq;
    auto add_keys = [&](at::Tensor& acc, const Part& p, at::Tensor part) {
      if (one) acc = std::move(part);
      else keys_of(acc, p).add_(part);
    };
    if (K.direct) {  // each part's share by the kernel's backward, from the merged output and log-sum-exp
      at::NoGradGuard no_grad;
      const at::Tensor out = g.out.view({b, s, d.heads, d.head_dim}).narrow(1, t0, tq).transpose(1, 2);
      const at::Tensor lse = g.lse.narrow(2, t0, tq), qd = q.detach();
      for (const Part& p : parts(d, layout, K, t0, t1)) {
        at::Tensor dq_p, dk_p, dv_p;
        const at::Tensor k = keys_of(K.k, p), v = keys_of(K.v, p);
        if (qd.is_cpu()) {
          std::tie(dq_p, dk_p, dv_p) = at::_scaled_dot_product_flash_attention_for_cpu_backward(
              dout, qd, k, v, out, lse, 0.0, p.causal, p.attn_mask(), K.scale);
        } else {
          // No dropout: the random state's seed and offset are read by neither.
          const at::Tensor seed = at::zeros({}, at::kLong), offset = at::zeros({}, at::kLong);
          std::tie(dq_p, dk_p, dv_p) = at::_scaled_dot_product_flash_attention_backward(
              dout, qd, k, v, out, lse, at::Tensor(), at::Tensor(), tq, p.k1 - p.k0, 0.0, p.causal, seed, offset,
              K.scale);
        }
        dq = dq.defined() ? dq.add_(dq_p) : dq_p;
        add_keys(dk, p, std::move(dk_p));
        add_keys(dv, p, std::move(dv_p));
      }
    } else {  // the tile's one call rebuilt with autograd
      const Part p = parts(d, layout, K, t0, t1)[0];
      at::AutoGradMode enable(true);
      const at::Tensor k = leaf(keys_of(K.k, p)), v = leaf(keys_of(K.v, p));
      std::vector<at::Tensor> out =
          torch::autograd::grad({tile_call(d, layout, K, q, p, k, v)}, {q, k, v}, {dout});
      dq = std::move(out[0]);
      add_keys(dk, p, std::move(out[1]));
      add_keys(dv, p, std::move(out[2]));
    }
    // The tile's queries back through RoPE and the q norm.
    at::AutoGradMode enable(true);
    std::vector<at::Tensor> inputs{q_leaf};
    if (norms) inputs.push_back(norm_leaf("self_attn.q_norm.weight"));
    std::vector<at::Tensor> out = torch::autograd::grad({q}, inputs, {dq});
    r.q.narrow(1, t0, tq).copy_(out[0]);
    if (norms) r.q_norm = r.q_norm.defined() ? r.q_norm.add_(out[1]) : (one ? out[1] : out[1].to(at::kFloat));
  }
  // The keys and values back through RoPE and the k norm, at once.
  const at::ScalarType dtype = g.q_proj.scalar_type();
  at::AutoGradMode enable(true);
  std::vector<at::Tensor> inputs{g.k_leaf, g.v_leaf};
  if (norms) inputs.push_back(norm_leaf("self_attn.k_norm.weight"));
  std::vector<at::Tensor> out = torch::autograd::grad({g.keys.k, g.keys.v}, inputs, {dk.to(dtype), dv.to(dtype)});
  r.k = std::move(out[0]), r.v = std::move(out[1]);
  if (norms) r.k_norm = std::move(out[2]);
  g = {};
  return r;
}

}  // namespace strider
