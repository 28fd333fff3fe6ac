#include "gpu/layer_cut.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <string>

#include "gpu/block_parts.h"
#include "host/error.h"

namespace strider {

using namespace block_parts;

void check_cuttable(const BlockDims& d, const TensorMap& w) {
  STRIDER_CHECK(!d.moe.sparse(), "a layer with experts is cut into expert pieces, not MLP slices");
  const NormNames names = norm_names(d);
  STRIDER_CHECK(!names.mlp_post,
                "a layer whose MLP output has a norm of its own ({}) cannot be cut into MLP slices: the "
                "norm needs the slices' whole sum",
                names.mlp_post);
  for (const auto& [name, t] : w)
    STRIDER_CHECK(name.find(".lora_") == std::string::npos,
                  "a layer with LoRA adapters ({}) cannot be cut into MLP slices", name);
}

AttentionHalf attention_half_forward(const BlockDims& d, const TensorMap& w, const TokenLayout& layout,
                                     const at::Tensor& x, int64_t token_tile) {
  check_cuttable(d, w);
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
    // The uncut layer's MLP backward (gpu/blocks.cpp, layer_backward's
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
  const int64_t n = x.size(0) * x.size(1);
  const int64_t tile = tile_tokens(token_tile, n);
  AttentionRecompute r = attention_recompute(d, w, grads, layout, x, token_tile, nullptr);
  at::Tensor x1 = r.x1.reshape({n, d.hidden});
  r.x1 = at::Tensor();
  const at::Tensor gout = grad_out.reshape({n, d.hidden}), ds = dh2_sum.view({n, d.hidden});
  at::Tensor gx1 = at::empty({n, d.hidden}, x1.options());
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    const int64_t t1 = std::min(n, t0 + tile);
    // The sum rounded to the compute dtype, as one slice's gradient is.
    at::Tensor dh2 = ds.slice(0, t0, t1).to(x1.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
    mlp_input_backward(d, w, grads, x1.slice(0, t0, t1), std::move(dh2), gout.slice(0, t0, t1),
                       gx1.slice(0, t0, t1));
  }
  x1 = at::Tensor();
  return attention_backward(d, w, grads, x, r, std::move(gx1), token_tile);
}

}  // namespace strider
