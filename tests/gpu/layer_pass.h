// What the tests of a decoder layer's compute (gpu/blocks, gpu/blocks/layer_cut)
// share: small dimensions, inputs, one pass's output and gradients, and how
// two passes are compared.
#pragma once

#include "tests/catch_torch.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "gpu/blocks/blocks.h"
#include "tests/gpu/random_layer.h"

namespace strider::layer_test {

// Small dimensions; `gqa`: 4 query heads over 2 K/V heads, else 4 over 4.
// Qwen3-like options (q/k norm, biases) where asked for.
inline BlockDims dims(bool gqa, bool qwen3 = false) {
  BlockDims d;
  d.hidden = 48;
  d.heads = 4;
  d.kv_heads = gqa ? 2 : 4;
  d.head_dim = qwen3 ? 16 : 12;
  d.intermediate = 80;
  d.rms_eps = 1e-5;
  d.qk_norm = qwen3;
  d.qkv_bias = d.o_bias = d.mlp_bias = qwen3;
  return d;
}

// Output, d(loss)/dx and the parameter gradients (fp32) of one pass.
struct Pass {
  at::Tensor out, dx;
  TensorMap grads;
};

inline Pass strider_pass(const BlockDims& d, Layer l, const RopeTables& rope, const at::Tensor& x,
                  const at::Tensor& gout, int64_t tile) {
  Pass p;
  p.out = layer_forward(d, l.w, rope, x, tile);
  p.dx = layer_backward(d, l.w, rope, x, gout, l.grads, tile);
  p.grads = l.grads;
  return p;
}

struct Inputs {
  RopeTables rope;
  at::Tensor x, gout;
};
inline Inputs inputs(const BlockDims& d, at::ScalarType dtype, int64_t b, int64_t s) {
  RopeDims r;
  r.theta = 500.0;  // short wavelengths, so that positions 0..s differ visibly
  at::manual_seed(7);
  return {rope_tables(r, d.head_dim, s, dtype, at::kCPU), at::randn({b, s, d.hidden}).to(dtype),
          at::randn({b, s, d.hidden}).to(dtype)};
}

inline double rel_err(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor ad = a.to(at::kDouble), bd = b.to(at::kDouble);
  return (ad - bd).abs().max().item<double>() / std::max(bd.abs().max().item<double>(), 1e-30);
}

// Every tensor of `got` within `tol` of `want`, relative to want's largest magnitude.
inline void check_close(const Pass& got, const Pass& want, double tol) {
  CHECK(rel_err(got.out, want.out) <= tol);
  CHECK(rel_err(got.dx, want.dx) <= tol);
  REQUIRE(got.grads.size() == want.grads.size());
  for (const auto& [name, g] : want.grads) {
    INFO(name);
    CHECK(rel_err(got.grads.at(name), g) <= tol);
  }
}

inline bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && at::equal(a, b);
}

}  // namespace strider::layer_test
