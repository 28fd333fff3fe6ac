#include "gpu/blocks/blocks.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <string_view>
#include <vector>

#include "gpu/blocks/attention.h"
#include "gpu/blocks/block_parts.h"
#include "gpu/blocks/moe.h"
#include "gpu/blocks/weight_grad.h"
#include "host/error.h"

namespace strider {
namespace block_parts {

// Tokens per tile (the MLP's, the attention half's projections') for n tokens: all of them when untiled.
int64_t tile_tokens(int64_t token_tile, int64_t n) {
  STRIDER_CHECK(token_tile >= 0, "token tile {} must be >= 0 (0: untiled)", token_tile);
  return token_tile == 0 || token_tile > n ? n : token_tile;
}

// The model's RMSNorm (BlockDims::norm) of x by the weight `name`.
at::Tensor norm(const BlockDims& d, const TensorMap& w, const char* name, const at::Tensor& x) {
  return rms_norm(x, weight(w, name), d.rms_eps, d.norm);
}

// The norms around a layer's two residual branches, by checkpoint name.
NormNames norm_names(const BlockDims& d) {
  switch (d.norm_placement) {
    case NormPlacement::kPre: return {"input_layernorm.weight", nullptr, "post_attention_layernorm.weight", nullptr};
    case NormPlacement::kPost:
      return {nullptr, "post_attention_layernorm.weight", nullptr, "post_feedforward_layernorm.weight"};
    case NormPlacement::kSandwich:
      return {"input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
              "post_feedforward_layernorm.weight"};
  }
  return {};
}
// x through the norm `name`, or as it is where the layer has none there.
at::Tensor maybe_norm(const BlockDims& d, const TensorMap& w, const char* name, const at::Tensor& x) {
  return name ? norm(d, w, name, x) : x;
}

namespace {

// The attention half's projections of x: q, k, v ([b, s, features], before
// the q/k norms and RoPE), from the input norm, `tile` tokens at a time (of
// the b * s, in order; tile_tokens), so that the norm's and the GEMMs'
// temporaries are one tile's. What LayerSaved keeps.
struct Projections {
  at::Tensor q, k, v;
};
Projections attention_projections(const TensorMap& w, const BlockDims& d, const at::Tensor& x, int64_t tile) {
  const char* names[] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"};
  auto of = [&](const at::Tensor& rows) {
    return linears(d, maybe_norm(d, w, norm_names(d).attn_pre, rows), w, {names[0], names[1], names[2]});
  };
  const int64_t b = x.size(0), s = x.size(1), n = b * s;
  if (tile >= n) {
    std::vector<at::Tensor> y = of(x);
    return {std::move(y[0]), std::move(y[1]), std::move(y[2])};
  }
  const at::Tensor flat = x.reshape({n, d.hidden});
  std::vector<at::Tensor> out;
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    std::vector<at::Tensor> y = of(flat.slice(0, t0, t1));
    for (size_t i = 0; i < y.size(); ++i) {
      if (out.size() <= i) out.push_back(at::empty({n, y[i].size(1)}, y[i].options()));
      out[i].slice(0, t0, t1).copy_(y[i]);
    }
  }
  return {out[0].view({b, s, -1}), out[1].view({b, s, -1}), out[2].view({b, s, -1})};
}

}  // namespace

// A residual branch's output y as it is added to the stream: through its
// post-norm `post` (OLMo 2, Gemma; nullptr: none), then scaled by Granite's
// residual_multiplier (in place: the branch is a fresh tensor).
at::Tensor branch(const BlockDims& d, const TensorMap& w, const char* post, at::Tensor y) {
  if (post) y = norm(d, w, post, y);
  return d.residual_multiplier == 1.0 ? y : y.mul_(d.residual_multiplier);
}

namespace {

// x1 = x + the attention branch of the core's output a ([b * s, heads *
// head_dim]): o_proj (and a post-norm) `tile` tokens at a time into one
// buffer; one tile: the sum itself.
at::Tensor attention_residual(const BlockDims& d, const TensorMap& w, const at::Tensor& x, const at::Tensor& a,
                              int64_t tile) {
  const int64_t n = a.size(0);
  const char* post = norm_names(d).attn_post;
  if (tile >= n) return x + branch(d, w, post, linear(d, a, w, "self_attn.o_proj")).view(x.sizes());
  at::Tensor x1 = at::empty({n, d.hidden}, x.options());
  const at::Tensor xf = x.reshape({n, d.hidden});
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    at::Tensor rows = x1.slice(0, t0, t1);
    at::add_out(rows, xf.slice(0, t0, t1), branch(d, w, post, linear(d, a.slice(0, t0, t1), w, "self_attn.o_proj")));
  }
  return x1.view(x.sizes());
}

// The MLP's projections of x1 (its rows: a tile of tokens): gate and up,
// from the post-attention norm. What LayerSaved keeps.
struct MlpProjections {
  at::Tensor gate, up;
};
MlpProjections mlp_projections(const BlockDims& d, const TensorMap& w, const at::Tensor& x1) {
  at::Tensor h = maybe_norm(d, w, norm_names(d).mlp_pre, x1);
  std::vector<at::Tensor> y = linears(d, h, w, {"mlp.gate_proj", "mlp.up_proj"});
  return {std::move(y[0]), std::move(y[1])};
}

}  // namespace

at::Tensor leaf(const at::Tensor& t) { return t.detach().requires_grad_(true); }

namespace {

// The gradient of a residual branch's output y (before its post-norm)
// from the stream's gradient g: Granite's scale, then the post-norm `post`'s
// backward through autograd, its weight's gradient added into `grads` (if it
// trains). `y` computes the branch's output again (it is not kept): called
// only where the branch has a post-norm.
template <class Y>
at::Tensor branch_grad(const BlockDims& d, const TensorMap& w, TensorMap& grads, const char* post,
                       const at::Tensor& g, Y&& y) {
  const at::Tensor gs = d.residual_multiplier == 1.0 ? g : g * d.residual_multiplier;
  if (!post) return gs;
  at::Tensor y_leaf;
  {
    at::NoGradGuard no_grad;
    y_leaf = leaf(y());
  }
  at::AutoGradMode enable(true);
  const auto it = grads.find(post);
  const at::Tensor nw = it != grads.end() ? leaf(weight(w, post)) : weight(w, post);
  std::vector<at::Tensor> leaves{y_leaf};
  if (it != grads.end()) leaves.push_back(nw);
  std::vector<at::Tensor> dg =
      torch::autograd::grad({rms_norm(y_leaf, nw, d.rms_eps, d.norm)}, leaves, {gs.view(y_leaf.sizes())});
  if (dg.size() > 1) it->second.add_(dg[1]);
  return dg[0];
}

}  // namespace

at::Tensor attention_forward(const BlockDims& d, const TensorMap& w, const TokenLayout& layout, const at::Tensor& x,
                             int64_t token_tile, const LayerSaved* save) {
  const int64_t b = x.size(0), s = x.size(1), n = b * s;
  const int64_t tile = tile_tokens(token_tile, n);
  Projections p = attention_projections(w, d, x, tile);
  if (save) {
    save->q.copy_(p.q.view({n, -1}));
    save->k.copy_(p.k.view({n, -1}));
    save->v.copy_(p.v.view({n, -1}));
  }
  const at::Tensor a = attention_core(d, w, layout, std::move(p.q), std::move(p.k), std::move(p.v),
                                      attention_query_tile(d, b, s, token_tile), save)
                           .view({n, -1});
  return attention_residual(d, w, x, a, tile);
}

AttentionRecompute attention_recompute(const BlockDims& d, const TensorMap& w, const TensorMap& grads,
                                       const TokenLayout& layout, const at::Tensor& x, int64_t token_tile,
                                       const LayerSaved* saved) {
  const int64_t b = x.size(0), s = x.size(1), n = b * s, qf = d.heads * d.head_dim;
  const int64_t tile = tile_tokens(token_tile, n);
  auto trains = [&](const char* name) { return grads.find(name) != grads.end(); };
  auto weight_leaf = [&](const char* name) { return trains(name) ? leaf(weight(w, name)) : weight(w, name); };
  at::Tensor q_proj, k_proj, v_proj;
  if (saved) {
    q_proj = saved->q.view({b, s, -1});
    k_proj = saved->k.view({b, s, -1});
    v_proj = saved->v.view({b, s, -1});
  } else {
    at::NoGradGuard no_grad;
    Projections p = attention_projections(w, d, x, tile);
    q_proj = p.q, k_proj = p.k, v_proj = p.v;
  }
  AttentionRecompute r;
  TensorMap core_w;
  r.qk_norm_grads = d.qk_norm && trains("self_attn.q_norm.weight");
  if (d.qk_norm) {
    core_w.emplace("self_attn.q_norm.weight", weight_leaf("self_attn.q_norm.weight"));
    core_w.emplace("self_attn.k_norm.weight", weight_leaf("self_attn.k_norm.weight"));
  }
  r.core = attention_graph(d, core_w, r.qk_norm_grads, layout, q_proj, k_proj, v_proj,
                           attention_query_tile(d, b, s, token_tile), saved);
  q_proj = k_proj = v_proj = at::Tensor();
  r.a_flat = r.core.out.reshape({n, qf});
  if (saved) {
    r.x1 = saved->x1.view({b, s, d.hidden});
  } else {
    at::NoGradGuard no_grad;
    r.x1 = attention_residual(d, w, x, r.a_flat, tile);
  }
  return r;
}

void mlp_input_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const at::Tensor& x1,
                        at::Tensor dh2, const at::Tensor& gout, const at::Tensor& gx1) {
  const char* pre = norm_names(d).mlp_pre;
  if (!pre) {  // OLMo 2: the MLP reads x1 itself
    gx1.copy_(dh2.add_(gout));
    return;
  }
  const auto it = grads.find(pre);
  at::AutoGradMode enable(true);
  const at::Tensor nw = it != grads.end() ? leaf(weight(w, pre)) : weight(w, pre);
  at::Tensor x1_leaf = leaf(x1);
  std::vector<at::Tensor> leaves{x1_leaf};
  if (it != grads.end()) leaves.push_back(nw);
  std::vector<at::Tensor> g = torch::autograd::grad({rms_norm(x1_leaf, nw, d.rms_eps, d.norm)}, leaves, {dh2});
  if (g.size() > 1) it->second.add_(g[1]);
  gx1.copy_(g[0].add_(gout));
}

at::Tensor attention_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const at::Tensor& x,
                              AttentionRecompute& r, at::Tensor gx1, int64_t token_tile) {
  const int64_t n = x.size(0) * x.size(1), qf = d.heads * d.head_dim;
  const int64_t tile = tile_tokens(token_tile, n);
  const NormNames names = norm_names(d);
  auto trains = [&](const char* name) { return grads.find(name) != grads.end(); };
  auto add_grad = [&](const char* name, const at::Tensor& g) {
    if (auto it = grads.find(name); it != grads.end()) it->second.add_(g);
  };
  at::Tensor da = tile < n ? at::empty({n, qf}, r.a_flat.options()) : at::Tensor();
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    const at::Tensor a_t = r.a_flat.slice(0, t0, t1);
    const at::Tensor go = branch_grad(d, w, grads, names.attn_post, gx1.slice(0, t0, t1),
                                      [&] { return linear(d, a_t, w, "self_attn.o_proj"); });
    add_linear_grads(grads, "self_attn.o_proj", go, a_t);
    at::Tensor da_t = linears_input_grad(d, w, grads, {"self_attn.o_proj"}, {go}, a_t);
    if (da.defined()) da.slice(0, t0, t1).copy_(da_t);
    else da = std::move(da_t);  // one tile
  }
  r.a_flat = at::Tensor();
  AttentionGrads g = attention_grads(r.core, da);
  da = at::Tensor();
  if (r.qk_norm_grads) {
    add_grad("self_attn.q_norm.weight", g.q_norm);
    add_grad("self_attn.k_norm.weight", g.k_norm);
  }
  const at::Tensor xf = x.reshape({n, d.hidden});
  at::Tensor dqf = g.q.reshape({n, -1}), dkf = g.k.reshape({n, -1}), dvf = g.v.reshape({n, -1});
  g = {};
  const at::Tensor norm1_w =
      names.attn_pre ? (trains(names.attn_pre) ? leaf(weight(w, names.attn_pre)) : weight(w, names.attn_pre))
                     : at::Tensor();
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    const at::Tensor x_t = xf.slice(0, t0, t1);
    at::Tensor dh1;
    {
      at::NoGradGuard no_grad;
      const at::Tensor h1 = maybe_norm(d, w, names.attn_pre, x_t);
      const at::Tensor dq = dqf.slice(0, t0, t1), dk = dkf.slice(0, t0, t1), dv = dvf.slice(0, t0, t1);
      add_linear_grads(grads, "self_attn.q_proj", dq, h1);
      add_linear_grads(grads, "self_attn.k_proj", dk, h1);
      add_linear_grads(grads, "self_attn.v_proj", dv, h1);
      dh1 = linears_input_grad(d, w, grads, {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"},
                               {dq, dk, dv}, h1);
    }
    if (tile >= n) dqf = dkf = dvf = at::Tensor();  // one tile: gone before the norm's backward
    if (!names.attn_pre) {  // OLMo 2: attention reads x itself
      gx1.slice(0, t0, t1).add_(dh1);
      continue;
    }
    at::AutoGradMode enable(true);
    at::Tensor x_leaf = leaf(x_t);
    std::vector<at::Tensor> leaves{x_leaf};
    if (trains(names.attn_pre)) leaves.push_back(norm1_w);
    std::vector<at::Tensor> dx = torch::autograd::grad({rms_norm(x_leaf, norm1_w, d.rms_eps, d.norm)}, leaves, {dh1});
    if (dx.size() > 1) add_grad(names.attn_pre, dx[1]);
    gx1.slice(0, t0, t1).add_(dx[0]);
  }
  return gx1.view(x.sizes());
}

}  // namespace block_parts

using block_parts::activate;
using block_parts::activate_;
using block_parts::activate_backward;
using block_parts::branch;
using block_parts::linear;
using block_parts::maybe_norm;
using block_parts::norm_names;
using block_parts::NormNames;
using block_parts::tile_tokens;
using block_parts::weight;
at::Tensor layer_forward(const BlockDims& d, const TensorMap& w, const TokenLayout& layout,
                         const at::Tensor& x, int64_t token_tile, const LayerSaved* save, const MoeStep* moe) {
  at::NoGradGuard no_grad;
  const int64_t n = x.size(0) * x.size(1);
  const NormNames names = norm_names(d);
  const int64_t tile = tile_tokens(token_tile, n);
  const at::Tensor x1 = block_parts::attention_forward(d, w, layout, x, token_tile, save);
  if (save) save->x1.copy_(x1.view({n, d.hidden}));
  // x1 + mlp, tile by tile, in place: x1 is ours (a fresh sum), and the sum
  // rounds the same in place as out of place.
  at::Tensor flat = x1.contiguous().view({n, d.hidden});
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    at::Tensor t = flat.slice(0, t0, t1);
    if (d.moe.sparse()) {
      const MoeStep st = moe ? moe->tile(t0, t1) : MoeStep{};
      t.add_(branch(d, w, names.mlp_post, moe_forward(d, w, maybe_norm(d, w, names.mlp_pre, t), moe ? &st : nullptr)));
      continue;
    }
    block_parts::MlpProjections m = block_parts::mlp_projections(d, w, t);
    if (save) {
      save->gate.slice(0, t0, t1).copy_(m.gate);
      save->up.slice(0, t0, t1).copy_(m.up);
    }
    // In place: two [tokens, intermediate] tensors alive, not three; the
    // same bits as act(gate) * up.
    activate_(d, m.gate);
    m.gate.mul_(m.up);
    m.up = at::Tensor();
    t.add_(branch(d, w, names.mlp_post, linear(d, m.gate, w, "mlp.down_proj")));
  }
  return flat.view(x1.sizes());
}

at::Tensor layer_backward(const BlockDims& d, const TensorMap& w, const TokenLayout& layout,
                          const at::Tensor& x, const at::Tensor& grad_out, TensorMap& grads,
                          int64_t token_tile, const LayerSaved* saved, const MoeStep* moe) {
  using namespace block_parts;
  const int64_t n = x.size(0) * x.size(1);
  const NormNames names = norm_names(d);
  // 1. The attention core from the projections (kept, or recomputed from x
  // by the forward's own ops), its output kept or recomputed
  // (gpu/blocks/attention.h); x1: kept, or x + o_proj of the core's output (SDPA
  // computes the same bits with and without grad, so this is the forward's
  // x1).
  const int64_t tile = tile_tokens(token_tile, n);
  AttentionRecompute r = attention_recompute(d, w, grads, layout, x, token_tile, saved);

  // 2. The MLP tile by tile (the forward's tiles): gate and up (kept, or
  // recomputed); a post-norm's backward (down_proj's output recomputed);
  // act(gate) * up's gradients written out (silu_backward or gelu_backward,
  // as autograd would), the projections' by GEMMs, the MLP's pre-norm's by
  // autograd, recomputed once the tile's [tile, intermediate] tensors are
  // gone; d(loss)/d(x1) adds the residual.
  at::Tensor x1_flat = r.x1.reshape({n, d.hidden});
  r.x1 = at::Tensor();
  const at::Tensor gout_flat = grad_out.reshape({n, d.hidden});
  at::Tensor gx1 = at::empty({n, d.hidden}, x1_flat.options());
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    const at::Tensor x1_t = x1_flat.slice(0, t0, t1), gout_t = gout_flat.slice(0, t0, t1);
    at::Tensor dh2;
    if (d.moe.sparse()) {
      at::NoGradGuard no_grad;
      const at::Tensor h2 = maybe_norm(d, w, names.mlp_pre, x1_t);
      const at::Tensor gy =
          branch_grad(d, w, grads, names.mlp_post, gout_t, [&] { return moe_forward(d, w, h2); });
      const MoeStep st = moe ? moe->tile(t0, t1) : MoeStep{};
      dh2 = moe_backward(d, w, grads, h2, gy, moe ? &st : nullptr);
    } else {
      at::NoGradGuard no_grad;
      MlpProjections m;
      if (saved) m = {saved->gate.slice(0, t0, t1), saved->up.slice(0, t0, t1)};
      else m = mlp_projections(d, w, x1_t);
      at::Tensor acted = activate(d, m.gate);
      at::Tensor act = acted * m.up;
      const at::Tensor gdown = branch_grad(d, w, grads, names.mlp_post, gout_t,
                                           [&] { return linear(d, act, w, "mlp.down_proj"); });
      add_linear_grads(grads, "mlp.down_proj", gdown, act);
      if (w.find("mlp.down_proj.lora_A.weight") == w.end()) act = at::Tensor();  // gone before dact, as ever
      at::Tensor dact = linears_input_grad(d, w, grads, {"mlp.down_proj"}, {gdown}, act);
      act = at::Tensor();
      const at::Tensor du = dact * acted;
      acted = at::Tensor();
      const at::Tensor dg = activate_backward(d, dact.mul_(m.up), m.gate);
      dact = at::Tensor();
      m = {};
      const at::Tensor h2 = maybe_norm(d, w, names.mlp_pre, x1_t);
      add_linear_grads(grads, "mlp.gate_proj", dg, h2);
      add_linear_grads(grads, "mlp.up_proj", du, h2);
      dh2 = linears_input_grad(d, w, grads, {"mlp.gate_proj", "mlp.up_proj"}, {dg, du}, h2);
    }
    mlp_input_backward(d, w, grads, x1_t, std::move(dh2), gout_t, gx1.slice(0, t0, t1));
  }
  x1_flat = at::Tensor();

  // 3. Attention, tile by tile: a post-norm's backward (o_proj's output
  // recomputed), o_proj's gradients by GEMMs; then the core's
  // (gpu/blocks/attention.h); then, tile by tile again, the q/k/v projections' by
  // GEMMs and the input norm's by autograd (recomputed), d(loss)/dx adding
  // the residual (into gx1, ours, in place).
  return attention_backward(d, w, grads, x, r, std::move(gx1), token_tile);
}

}  // namespace strider
