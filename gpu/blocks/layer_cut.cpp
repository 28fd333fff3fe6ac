#include "gpu/blocks/layer_cut.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <string>

#include "gpu/blocks/block_parts.h"
#include "gpu/blocks/moe_cut.h"
#include "host/error.h"

namespace strider {

using namespace block_parts;

namespace {

// What every cut refuses: a norm after the MLP, LoRA adapters.
void check_half(const BlockDims& d, const TensorMap& w) {
  const NormNames names = norm_names(d);
  STRIDER_CHECK(!names.mlp_post,
                "a layer whose MLP output has a norm of its own ({}) cannot be cut into MLP slices: the "
                "norm needs the slices' whole sum",
                names.mlp_post);
  for (const auto& [name, t] : w)
    STRIDER_CHECK(name.find(".lora_") == std::string::npos,
                  "a layer with LoRA adapters ({}) cannot be cut into MLP slices", name);
}

// The attention half's backward: attention recomputed from x, then tile by
// tile d(loss)/d(h2) from `dh2_of(t0, t1, x1 tile)` (compute dtype) through
// the post-attention norm, plus the residual; d(loss)/dx.
template <class DH2>
at::Tensor half_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const TokenLayout& layout,
                         const at::Tensor& x, const at::Tensor& grad_out, int64_t token_tile, DH2 dh2_of) {
  const int64_t n = x.size(0) * x.size(1);
  const int64_t tile = tile_tokens(token_tile, n);
  AttentionRecompute r = attention_recompute(d, w, grads, layout, x, token_tile, nullptr);
  at::Tensor x1 = r.x1.reshape({n, d.hidden});
  r.x1 = at::Tensor();
  const at::Tensor gout = grad_out.reshape({n, d.hidden});
  at::Tensor gx1 = at::empty({n, d.hidden}, x1.options());
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    const at::Tensor x1_t = x1.slice(0, t0, t1);
    mlp_input_backward(d, w, grads, x1_t, dh2_of(t0, t1, x1_t), gout.slice(0, t0, t1), gx1.slice(0, t0, t1));
  }
  x1 = at::Tensor();
  return attention_backward(d, w, grads, x, r, std::move(gx1), token_tile);
}

// One tile's routing from what the cut keeps, as moe_route gave it.
MoeRoute route_of(const BlockDims& d, const MoeCut& cut, int64_t t0, int64_t t1, at::ScalarType dtype) {
  const at::Tensor s = cut.scores.slice(0, t0, t1);
  return {cut.top.slice(0, t0, t1), d.moe.scores_fp32 ? s : s.to(dtype)};
}

void check_moe_buffers(const BlockDims& d, const at::Tensor& h2, const MoeCut& cut, const at::Tensor& sum,
                       const char* what) {
  const int64_t n = h2.numel() / d.hidden, k = d.moe.top_k;
  STRIDER_CHECK(cut.top.scalar_type() == at::kLong && cut.top.numel() == n * k && cut.scores.scalar_type() == at::kFloat &&
                    cut.scores.numel() == n * k && (!sum.defined() || (sum.scalar_type() == h2.scalar_type() &&
                                                                       sum.numel() == h2.numel() && sum.is_contiguous())),
                "{}: the routing must be int64 and fp32 [{}, {}], the sum contiguous in the input's dtype and shape",
                what, n, k);
}

}  // namespace

void check_cuttable(const BlockDims& d, const TensorMap& w) {
  STRIDER_CHECK(!d.moe.sparse(), "a layer with experts is cut into groups of experts, not MLP slices");
  check_half(d, w);
}

void check_moe_cuttable(const BlockDims& d, const TensorMap& w) {
  STRIDER_CHECK(d.moe.sparse(), "a dense layer is cut into MLP slices, not groups of experts");
  check_half(d, w);
}

AttentionHalf attention_half_forward(const BlockDims& d, const TensorMap& w, const TokenLayout& layout,
                                     const at::Tensor& x, int64_t token_tile) {
  check_half(d, w);
  at::NoGradGuard no_grad;
  const int64_t n = x.size(0) * x.size(1);
  const int64_t tile = tile_tokens(token_tile, n);
  const char* pre = norm_names(d).mlp_pre;
  AttentionHalf out;
  out.x1 = attention_forward(d, w, layout, x, token_tile, nullptr);
  // The MLP's input tile by tile, as the uncut layer norms it.
  const at::Tensor x1 = out.x1.contiguous().view({n, d.hidden});
  if (tile >= n) {
    out.h2 = maybe_norm(d, w, pre, x1).contiguous().view(x.sizes());
    return out;
  }
  at::Tensor h2 = at::empty_like(x1);
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    h2.slice(0, t0, t1).copy_(maybe_norm(d, w, pre, x1.slice(0, t0, t1)));
  }
  out.h2 = h2.view(x.sizes());
  return out;
}

void mlp_slice_forward(const BlockDims& d, const TensorMap& w, const at::Tensor& h2, const at::Tensor& sum,
                       int64_t token_tile) {
  check_cuttable(d, w);
  STRIDER_CHECK(sum.scalar_type() == at::kFloat && sum.numel() == h2.numel() && sum.is_contiguous(),
                "an MLP slice's sum must be a contiguous fp32 buffer of the input's {} elements", h2.numel());
  at::NoGradGuard no_grad;
  const int64_t n = h2.numel() / d.hidden;
  const int64_t tile = tile_tokens(token_tile, n);
  const at::Tensor h = h2.reshape({n, d.hidden});
  const at::Tensor s = sum.view({n, d.hidden});
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    std::vector<at::Tensor> y = linears(d, h.slice(0, t0, t1), w, {"mlp.gate_proj", "mlp.up_proj"});
    // In place, as the uncut layer: act(gate) * up, then down_proj's slice.
    activate_(d, y[0]);
    y[0].mul_(y[1]);
    y[1] = at::Tensor();
    s.slice(0, t0, t1).add_(linear(d, y[0], w, "mlp.down_proj"));
  }
}

at::Tensor mlp_slices_output(const BlockDims& d, const at::Tensor& x1, const at::Tensor& sum) {
  // A copy even in fp32: branch scales its argument in place.
  at::Tensor y = sum.to(x1.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  return x1 + branch(d, {}, nullptr, std::move(y)).view(x1.sizes());
}

void mlp_slice_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const at::Tensor& h2,
                        const at::Tensor& grad_out, const at::Tensor& dh2_sum, int64_t token_tile) {
  check_cuttable(d, w);
  STRIDER_CHECK(dh2_sum.scalar_type() == at::kFloat && dh2_sum.numel() == h2.numel() && dh2_sum.is_contiguous(),
                "an MLP slice's input-gradient sum must be a contiguous fp32 buffer of the input's {} elements",
                h2.numel());
  at::NoGradGuard no_grad;
  const int64_t n = h2.numel() / d.hidden;
  const int64_t tile = tile_tokens(token_tile, n);
  const at::Tensor h = h2.reshape({n, d.hidden}), gout = grad_out.reshape({n, d.hidden});
  const at::Tensor ds = dh2_sum.view({n, d.hidden});
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    const at::Tensor h_t = h.slice(0, t0, t1), g_t = gout.slice(0, t0, t1);
    // The uncut layer's MLP backward (gpu/blocks/blocks.cpp, layer_backward's
    // step 2) on the slice's weights, from the kept input.
    std::vector<at::Tensor> y = linears(d, h_t, w, {"mlp.gate_proj", "mlp.up_proj"});
    at::Tensor gate = std::move(y[0]), up = std::move(y[1]);
    at::Tensor acted = activate(d, gate);
    at::Tensor act = acted * up;
    const at::Tensor gdown = d.residual_multiplier == 1.0 ? g_t : g_t * d.residual_multiplier;
    add_linear_grads(grads, "mlp.down_proj", gdown, act);
    act = at::Tensor();
    at::Tensor dact = linears_input_grad(d, w, grads, {"mlp.down_proj"}, {gdown}, act);
    const at::Tensor du = dact * acted;
    acted = at::Tensor();
    const at::Tensor dg = activate_backward(d, dact.mul_(up), gate);
    dact = gate = up = at::Tensor();
    add_linear_grads(grads, "mlp.gate_proj", dg, h_t);
    add_linear_grads(grads, "mlp.up_proj", du, h_t);
    ds.slice(0, t0, t1).add_(linears_input_grad(d, w, grads, {"mlp.gate_proj", "mlp.up_proj"}, {dg, du}, h_t));
  }
}

at::Tensor attention_half_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const TokenLayout& layout,
                                   const at::Tensor& x, const at::Tensor& grad_out, const at::Tensor& dh2_sum,
                                   int64_t token_tile) {
  check_cuttable(d, w);
  const at::Tensor ds = dh2_sum.view({-1, d.hidden});
  return half_backward(d, w, grads, layout, x, grad_out, token_tile, [&](int64_t t0, int64_t t1, const at::Tensor& x1_t) {
    // The sum rounded to the compute dtype, as one slice's gradient is.
    return ds.slice(0, t0, t1).to(x1_t.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  });
}

void moe_cut_route(const BlockDims& d, const TensorMap& w, const at::Tensor& h2, const MoeCut& cut,
                   int64_t token_tile) {
  check_moe_cuttable(d, w);
  check_moe_buffers(d, h2, cut, {}, "moe_cut_route");
  at::NoGradGuard no_grad;
  const int64_t n = h2.numel() / d.hidden;
  const int64_t tile = tile_tokens(token_tile, n);
  const at::Tensor h = h2.reshape({n, d.hidden});
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    const MoeStep st = cut.step ? cut.step->tile(t0, t1) : MoeStep{};
    const MoeRoute r = moe_route(d, w, h.slice(0, t0, t1), cut.step ? &st : nullptr);
    cut.top.slice(0, t0, t1).copy_(r.top);
    cut.scores.slice(0, t0, t1).copy_(r.scores);
  }
}

void moe_cut_shared(const BlockDims& d, const TensorMap& w, const at::Tensor& h2, const MoeCut& cut,
                    int64_t token_tile) {
  check_moe_cuttable(d, w);
  if (d.moe.shared_intermediate == 0) return;
  STRIDER_CHECK(cut.shared.defined() && cut.shared.numel() == h2.numel() && cut.shared.scalar_type() == h2.scalar_type(),
                "moe_cut_shared: the shared expert's output needs a buffer of the input's {} elements and dtype",
                h2.numel());
  at::NoGradGuard no_grad;
  const int64_t n = h2.numel() / d.hidden;
  const int64_t tile = tile_tokens(token_tile, n);
  const at::Tensor h = h2.reshape({n, d.hidden}), s = cut.shared.view({n, d.hidden});
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    s.slice(0, t0, t1).copy_(moe_shared_forward(d, w, h.slice(0, t0, t1)));
  }
}

void moe_group_forward(const BlockDims& d, const TensorMap& w, int64_t e0, int64_t e1, const at::Tensor& h2,
                       const MoeCut& cut, const at::Tensor& sum, int64_t token_tile) {
  check_moe_cuttable(d, w);
  check_moe_buffers(d, h2, cut, sum, "moe_group_forward");
  at::NoGradGuard no_grad;
  const int64_t n = h2.numel() / d.hidden;
  const int64_t tile = tile_tokens(token_tile, n);
  const at::Tensor h = h2.reshape({n, d.hidden}), s = sum.view({n, d.hidden});
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    at::Tensor out = s.slice(0, t0, t1);
    moe_experts_forward(d, w, e0, e1, h.slice(0, t0, t1), route_of(d, cut, t0, t1, h2.scalar_type()), out);
  }
}

at::Tensor moe_groups_output(const BlockDims& d, const at::Tensor& x1, const at::Tensor& sum,
                             const at::Tensor& shared) {
  // A copy: branch scales its argument in place.
  at::Tensor y = sum.clone();
  if (shared.defined()) y.add_(shared.view(y.sizes()));
  return x1 + branch(d, {}, nullptr, std::move(y)).view(x1.sizes());
}

void moe_group_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, int64_t e0, int64_t e1,
                        const at::Tensor& h2, const at::Tensor& grad_out, const MoeCut& cut,
                        const at::Tensor& dh2_sum, int64_t token_tile) {
  check_moe_cuttable(d, w);
  check_moe_buffers(d, h2, cut, dh2_sum, "moe_group_backward");
  at::NoGradGuard no_grad;
  const int64_t n = h2.numel() / d.hidden, k = d.moe.top_k;
  const int64_t tile = tile_tokens(token_tile, n);
  const at::Tensor h = h2.reshape({n, d.hidden}), gout = grad_out.reshape({n, d.hidden});
  const at::Tensor ds = dh2_sum.view({n, d.hidden});
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    const at::Tensor g_t = gout.slice(0, t0, t1);
    const at::Tensor gy = d.residual_multiplier == 1.0 ? g_t : g_t * d.residual_multiplier;
    at::Tensor dh = ds.slice(0, t0, t1), dscores = cut.dscores.slice(0, t0 * k, t1 * k);
    moe_experts_backward(d, w, grads, e0, e1, h.slice(0, t0, t1), gy, route_of(d, cut, t0, t1, h2.scalar_type()), dh,
                         dscores);
  }
}

at::Tensor moe_half_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const TokenLayout& layout,
                             const at::Tensor& x, const at::Tensor& grad_out, const at::Tensor& dh2_sum,
                             const MoeCut& cut, int64_t token_tile) {
  check_moe_cuttable(d, w);
  const int64_t k = d.moe.top_k;
  const char* pre = norm_names(d).mlp_pre;
  const at::Tensor ds = dh2_sum.view({-1, d.hidden}), gout = grad_out.reshape({-1, d.hidden});
  return half_backward(d, w, grads, layout, x, grad_out, token_tile, [&](int64_t t0, int64_t t1, const at::Tensor& x1_t) {
    at::NoGradGuard no_grad;
    at::Tensor dh2 = ds.slice(0, t0, t1).clone();
    const at::Tensor h2 = maybe_norm(d, w, pre, x1_t);
    if (d.moe.shared_intermediate > 0) {
      const at::Tensor g_t = gout.slice(0, t0, t1);
      moe_shared_backward(d, w, grads, h2, d.residual_multiplier == 1.0 ? g_t : g_t * d.residual_multiplier, dh2);
    }
    const MoeStep st = cut.step ? cut.step->tile(t0, t1) : MoeStep{};
    moe_router_backward(d, w, grads, h2, cut.dscores.slice(0, t0 * k, t1 * k), dh2, cut.step ? &st : nullptr);
    return dh2;
  });
}

}  // namespace strider
