// The decoder layer of gpu/blocks: the untiled layer's forward is the plain
// formula (transformers' LlamaDecoderLayer written out: repeated K/V,
// rotate_half by concatenation, one autograd pass over the whole layer) bit
// for bit and its backward within rounding; the tiled layer equals the
// untiled one up to fp32 summation order; a backward from the forward's kept
// projections (LayerSaved) is the recomputing backward bit for bit.
// tests/python/test_blocks_vs_hf.py checks the plain formula against
// transformers itself.
#include "tests/catch_torch.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <string>
#include <vector>

#include "gpu/blocks/blocks.h"
#include "gpu/blocks/softcap_attention.h"
#include "host/error.h"
#include "tests/gpu/layer_pass.h"
#include "tests/gpu/random_layer.h"

using namespace strider;
using namespace strider::layer_test;

namespace {

// The plain formula, as gpu/blocks computed it before SDPA's grouped K/V,
// RoPE without concatenation and tiles.
at::Tensor plain_linear(const at::Tensor& x, const TensorMap& w, const std::string& p) {
  auto b = w.find(p + ".bias");
  return at::linear(x, w.at(p + ".weight"), b == w.end() ? at::Tensor() : b->second);
}
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}
at::Tensor plain_layer(const BlockDims& d, const TensorMap& w, const RopeTables& rope, const at::Tensor& x) {
  const int64_t b = x.size(0), s = x.size(1);
  at::Tensor h = rms_norm(x, w.at("input_layernorm.weight"), d.rms_eps);
  at::Tensor q = plain_linear(h, w, "self_attn.q_proj").view({b, s, d.heads, d.head_dim});
  at::Tensor k = plain_linear(h, w, "self_attn.k_proj").view({b, s, d.kv_heads, d.head_dim});
  at::Tensor v = plain_linear(h, w, "self_attn.v_proj").view({b, s, d.kv_heads, d.head_dim});
  if (d.qk_norm) {
    q = rms_norm(q, w.at("self_attn.q_norm.weight"), d.rms_eps);
    k = rms_norm(k, w.at("self_attn.k_norm.weight"), d.rms_eps);
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  v = v.transpose(1, 2);
  q = q * rope.cos + rotate_half(q) * rope.sin;
  k = k * rope.cos + rotate_half(k) * rope.sin;
  if (d.kv_heads != d.heads) {
    k = k.repeat_interleave(d.heads / d.kv_heads, 1);
    v = v.repeat_interleave(d.heads / d.kv_heads, 1);
  }
  at::Tensor a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
  a = a.transpose(1, 2).reshape({b, s, d.heads * d.head_dim});
  at::Tensor x1 = x + plain_linear(a, w, "self_attn.o_proj");
  at::Tensor h2 = rms_norm(x1, w.at("post_attention_layernorm.weight"), d.rms_eps);
  return x1 + plain_linear(at::silu(plain_linear(h2, w, "mlp.gate_proj")) * plain_linear(h2, w, "mlp.up_proj"),
                           w, "mlp.down_proj");
}

Pass plain_pass(const BlockDims& d, Layer l, const RopeTables& rope, const at::Tensor& x, const at::Tensor& gout) {
  Pass p;
  {
    at::NoGradGuard no_grad;
    p.out = plain_layer(d, l.w, rope, x);
  }
  at::AutoGradMode enable(true);
  TensorMap leaves;
  std::vector<at::Tensor> inputs{x.detach().requires_grad_(true)};
  for (const auto& [name, t] : l.w) {
    inputs.push_back(t.detach().requires_grad_(true));
    leaves.emplace(name, inputs.back());
  }
  std::vector<at::Tensor> g = torch::autograd::grad({plain_layer(d, leaves, rope, inputs[0])}, inputs, {gout});
  p.dx = g[0];
  size_t i = 1;
  for (const auto& [name, t] : l.w) p.grads.emplace(name, l.grads.at(name).add_(g[i++]));
  return p;
}

}  // namespace

TEST_CASE("untiled layer is the plain formula bit for bit forward and within rounding backward", "[blocks]") {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (bool qwen3 : {false, true}) {
      for (bool gqa : {false, true}) {
        INFO("dtype " << c10::toString(dtype) << " qwen3 " << qwen3 << " gqa " << gqa);
        const BlockDims d = dims(gqa, qwen3);
        const Layer l = random_layer(d, dtype, 1);
        const Inputs in = inputs(d, dtype, 2, 13);
        const Pass want = plain_pass(d, l, in.rope, in.x, in.gout);
        for (int64_t tile : {int64_t{0}, int64_t{26}, int64_t{1000}}) {  // 26 = all 2 x 13 tokens
          INFO("token_tile " << tile);
          const Pass got = strider_pass(d, random_layer(d, dtype, 1), in.rope, in.x, in.gout, tile);
          CHECK(same_bits(got.out, want.out));
          // The backward's matmul gradients are explicit GEMMs and autograd
          // differentiates only the element-wise parts and the attention
          // core, so its roundings are not one autograd pass's; with grouped
          // K/V, SDPA also sums each K/V head's gradient over its group
          // inside the kernel (in fp32), where the repeat summed per-head
          // results afterwards. Same maths, other roundings.
          check_close(got, want, dtype == at::kFloat ? 2e-6 : 2e-2);
        }
      }
    }
  }
}

TEST_CASE("without a fused kernel for grouped K/V the layer repeats them as the plain formula does", "[blocks]") {
  // With flash attention off the CPU has only math for grouped K/V (which
  // _fused_sdp_choice answers with 0): the layer then repeats K/V itself, so
  // that CUDA in fp32 can run memory-efficient attention, and is the plain
  // formula bit for bit in its forward.
  struct FlashOff {
    bool was = at::globalContext().userEnabledFlashSDP();
    FlashOff() { at::globalContext().setSDPUseFlash(false); }
    ~FlashOff() { at::globalContext().setSDPUseFlash(was); }
  } flash_off;
  const at::Tensor q = at::randn({1, 4, 8, 12}), kv = at::randn({1, 2, 8, 12});
  REQUIRE(at::_fused_sdp_choice(q, kv, kv, {}, 0.0, true, std::nullopt, /*enable_gqa=*/true) == 0);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    INFO("dtype " << c10::toString(dtype));
    const BlockDims d = dims(/*gqa=*/true);
    const Inputs in = inputs(d, dtype, 2, 13);
    const Pass want = plain_pass(d, random_layer(d, dtype, 6), in.rope, in.x, in.gout);
    const Pass got = strider_pass(d, random_layer(d, dtype, 6), in.rope, in.x, in.gout, 0);
    CHECK(same_bits(got.out, want.out));
    check_close(got, want, dtype == at::kFloat ? 2e-6 : 2e-2);
    // In query tiles (10 tokens of 2 rows: 5 positions a tile), each tile one
    // SDPA call with its mask, rebuilt with autograd in the backward.
    check_close(strider_pass(d, random_layer(d, dtype, 6), in.rope, in.x, in.gout, 10), want,
                dtype == at::kFloat ? 2e-6 : 2e-2);
  }
}

TEST_CASE("tiled layer equals the untiled one up to summation order", "[blocks]") {
  for (bool qwen3 : {false, true}) {
    const BlockDims d = dims(/*gqa=*/true, qwen3);
    const Inputs in = inputs(d, at::kFloat, 3, 11);  // 33 tokens
    const Pass untiled = strider_pass(d, random_layer(d, at::kFloat, 2), in.rope, in.x, in.gout, 0);
    // Tiles of one token, tiles that straddle sequences, a last short tile, one short of all.
    for (int64_t tile : {1, 5, 11, 16, 32}) {
      INFO("qwen3 " << qwen3 << " token_tile " << tile);
      check_close(strider_pass(d, random_layer(d, at::kFloat, 2), in.rope, in.x, in.gout, tile), untiled,
                  1e-6);
    }
  }
}

TEST_CASE("tiled layer in bf16 is within bf16 tolerance of the fp32 formula", "[blocks]") {
  // Reference: the plain formula in fp32 on the same (bf16-representable)
  // weights and inputs. The tiles' bf16 weight gradients are each rounded
  // before the fp32 accumulator adds them; the tolerance is
  // test_blocks_vs_hf.py's for bf16.
  const BlockDims d = dims(/*gqa=*/true);
  const Inputs in16 = inputs(d, at::kBFloat16, 2, 24);
  const Inputs in32 = inputs(d, at::kFloat, 2, 24);
  Layer l32 = random_layer(d, at::kFloat, 3);
  for (auto& [name, t] : l32.w) t = t.to(at::kBFloat16).to(at::kFloat);
  const Pass ref = plain_pass(d, l32, in32.rope, in16.x.to(at::kFloat), in16.gout.to(at::kFloat));
  for (int64_t tile : {0, 1, 7, 47}) {
    INFO("token_tile " << tile);
    check_close(strider_pass(d, random_layer(d, at::kBFloat16, 3), in16.rope, in16.x, in16.gout, tile), ref,
                5e-2);
  }
}

TEST_CASE("layer backward adds into the accumulators, not over them", "[blocks]") {
  const BlockDims d = dims(/*gqa=*/true);
  const Inputs in = inputs(d, at::kFloat, 1, 9);
  Layer once = random_layer(d, at::kFloat, 4);
  layer_backward(d, once.w, in.rope, in.x, in.gout, once.grads, 4);
  Layer twice = random_layer(d, at::kFloat, 4);
  for (auto& [name, g] : twice.grads) g.fill_(0.5);
  layer_backward(d, twice.w, in.rope, in.x, in.gout, twice.grads, 4);
  for (const auto& [name, g] : once.grads) {
    INFO(name);
    CHECK(g.abs().max().item<float>() > 0);
    CHECK(at::allclose(twice.grads.at(name), g + 0.5, 1e-6, 1e-6));
  }
}

TEST_CASE("a negative token tile is refused with its value", "[blocks]") {
  const BlockDims d = dims(false);
  Layer l = random_layer(d, at::kFloat, 5);
  const Inputs in = inputs(d, at::kFloat, 1, 4);
  CHECK_THROWS_WITH(layer_forward(d, l.w, in.rope, in.x, -1), Catch::Contains("token tile -1"));
  CHECK_THROWS_WITH(layer_backward(d, l.w, in.rope, in.x, in.gout, l.grads, -3),
                    Catch::Contains("token tile -3"));
}

TEST_CASE("a backward from the kept projections is the recomputing backward bit for bit", "[blocks]") {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (bool qwen3 : {false, true}) {
      for (bool gqa : {false, true}) {
        for (int64_t tile : {int64_t{0}, int64_t{5}}) {
          INFO("dtype " << c10::toString(dtype) << " qwen3 " << qwen3 << " gqa " << gqa << " tile " << tile);
          const BlockDims d = dims(gqa, qwen3);
          const Inputs in = inputs(d, dtype, 2, 13);
          const Pass want = strider_pass(d, random_layer(d, dtype, 3), in.rope, in.x, in.gout, tile);
          Layer l = random_layer(d, dtype, 3);
          // Poisoned first: every element of the buffer must be written by the forward.
          const int64_t e = int64_t(c10::elementSize(dtype));
          at::Tensor flat = at::full({layer_saved_elems(d, 26, e) + 7}, NAN, at::TensorOptions(dtype));
          const LayerSaved saved = layer_saved_views(d, 26, flat);
          Pass got;
          got.out = layer_forward(d, l.w, in.rope, in.x, tile, &saved);
          for (const at::Tensor& t : {saved.lse, saved.q, saved.k, saved.v, saved.attn, saved.x1, saved.gate, saved.up})
            CHECK(t.isfinite().all().item<bool>());
          CHECK(saved.lse.numel() == 26 * d.heads);
          CHECK(saved.attn.numel() == 26 * d.heads * d.head_dim);
          got.dx = layer_backward(d, l.w, in.rope, in.x, in.gout, l.grads, tile, &saved);
          got.grads = l.grads;
          CHECK(same_bits(got.out, want.out));
          CHECK(same_bits(got.dx, want.dx));
          for (const auto& [name, g] : want.grads) {
            INFO(name);
            CHECK(same_bits(got.grads.at(name), g));
          }
        }
      }
    }
  }
}

TEST_CASE("saved-activation views refuse a buffer too small for their tokens", "[blocks]") {
  const BlockDims d = dims(true);
  const at::Tensor flat = at::zeros({layer_saved_elems(d, 10, 2) - 1}, at::kBFloat16);
  CHECK_THROWS_WITH(layer_saved_views(d, 10, flat), Catch::Contains("smaller than 10 tokens need"));
  // q, k, v, the core's output, x1, gate and up: 4 x 12 + 2 x 2 x 12 + 4 x 12 + 48 + 2 x 80 = 352 elements
  // a token; the log-sum-exp: 10 x 4 fp32 values, 160 bytes (a multiple of 16), 80 bf16 or 40 fp32 elements.
  CHECK(layer_saved_elems(d, 10, 2) == 3600);
  CHECK(layer_saved_elems(d, 10, 4) == 3560);
}

TEST_CASE("soft-capped attention in query tiles is the whole-sequence formula, forward and backward",
          "[blocks]") {
  // The plain formula: every score at once, as transformers' eager attention
  // (GQA by repeated K/V), differentiated by autograd; against it the tiled
  // function with tiles that do not divide the sequence, with and without a
  // window (whose first tiles read fewer keys).
  at::manual_seed(5);
  const int64_t b = 2, heads = 4, kv = 2, s = 23, hd = 8;
  const double scale = 0.3, cap = 2.5;
  const at::Tensor q0 = at::randn({b, heads, s, hd}), k0 = at::randn({b, kv, s, hd}), v0 = at::randn({b, kv, s, hd});
  const at::Tensor gout = at::randn({b, heads, s, hd});
  // Once, under a loaded CI machine, every comparison of the first window
  // failed (the untiled tile's too, normally bit-identical to the formula)
  // and none of the second's: the first reference of the process was off.
  // The formula runs once before the references, and each failure prints
  // how far apart the two were.
  (void)at::matmul(at::softmax(at::tanh(at::matmul(q0, q0.transpose(2, 3)) * scale / cap) * cap, -1, at::kFloat), q0);
  auto apart = [](const at::Tensor& a, const at::Tensor& b) {
    return ((a - b).abs().max() / b.abs().max()).item<double>();
  };
  for (int64_t window : {int64_t{0}, int64_t{6}}) {
    at::AutoGradMode enable(true);
    auto leaves = [&] {
      return std::vector<at::Tensor>{q0.clone().requires_grad_(true), k0.clone().requires_grad_(true),
                                     v0.clone().requires_grad_(true)};
    };
    std::vector<at::Tensor> ref = leaves();
    const at::Tensor i = at::arange(s).unsqueeze(1), j = at::arange(s).unsqueeze(0);
    at::Tensor hidden = j > i;
    if (window > 0) hidden.logical_or_(j <= i - window);
    const at::Tensor mask = at::zeros({s, s}).masked_fill_(hidden, -INFINITY);
    const at::Tensor kr = ref[1].repeat_interleave(heads / kv, 1), vr = ref[2].repeat_interleave(heads / kv, 1);
    at::Tensor scores = at::matmul(ref[0], kr.transpose(2, 3)) * scale;
    scores = at::tanh(scores / cap) * cap + mask;
    const at::Tensor want = at::matmul(at::softmax(scores, -1, at::kFloat), vr);
    const std::vector<at::Tensor> want_g = torch::autograd::grad({want}, ref, {gout});
    for (int64_t tile : {int64_t{5}, int64_t{23}, int64_t{0}}) {
      INFO("window " << window << " tile " << tile);
      std::vector<at::Tensor> in = leaves();
      const at::Tensor got = softcap_attention(in[0], in[1], in[2], scale, cap, window, tile);
      INFO("forward apart by " << apart(got, want) << " of the largest output");
      CHECK(at::allclose(got, want, 1e-6, 1e-6));
      const std::vector<at::Tensor> got_g = torch::autograd::grad({got}, in, {gout});
      for (size_t x = 0; x < 3; ++x) {
        INFO("gradient " << x << " apart by " << apart(got_g[x], want_g[x]));
        CHECK(at::allclose(got_g[x], want_g[x], 1e-5, 1e-6));
      }
    }
  }
}
