// A kept layer's backward without the attention core run again
// (gpu/blocks/attention.h): the kernel's own backward, called with the output and
// log-sum-exp the forward kept, gives the recomputing backward's bits, with
// the masks SDPA reads (a sliding window, packed documents) as without; and
// it really reads what was kept (a kept log-sum-exp changed changes the
// gradients), so no silent fallback passes for it. On CUDA ([cuda], skipped
// without a GPU) the same in bf16, where the flash kernel runs. Query tiles
// (long context) equal one tile to fp32 rounding, through the kernel's
// backward and through the autograd rebuild CUDA's other kernels take.
#include "tests/catch_torch.h"

#include <ATen/ATen.h>

#include <string>

#include "gpu/blocks/attention.h"
#include "gpu/blocks/blocks.h"
#include "gpu/device/cuda_device.h"
#include "tests/gpu/random_layer.h"

using namespace strider;

namespace {

BlockDims dims(bool gqa, bool qwen3, int64_t window = 0) {
  BlockDims d;
  d.hidden = 64;
  d.heads = 4;
  d.kv_heads = gqa ? 2 : 4;
  d.head_dim = 16;
  d.intermediate = 96;
  d.rms_eps = 1e-5;
  d.qk_norm = qwen3;
  d.qkv_bias = d.o_bias = d.mlp_bias = qwen3;
  d.sliding_window = window;
  return d;
}

struct Backward {
  at::Tensor dx;
  TensorMap grads;
};

bool same(const Backward& a, const Backward& b) {
  bool ok = at::equal(a.dx, b.dx);
  for (const auto& [name, g] : a.grads) {
    const bool eq = at::equal(g, b.grads.at(name));
    if (!eq) UNSCOPED_INFO("differs: " << name);
    ok = ok && eq;
  }
  return ok;
}

// The layer's backward recomputing, and from what its forward kept; `poke`
// changes the kept log-sum-exp before the kept backward.
struct Runs {
  Backward recomputed, kept;
};
Runs run(const BlockDims& d, at::ScalarType dtype, at::Device device, const TokenLayout& layout, int64_t b,
         int64_t s, int64_t tile, bool poke = false) {
  Layer recomputed = random_layer(d, dtype, 11, device), kept = random_layer(d, dtype, 11, device);
  const TensorMap& w = kept.w;
  at::manual_seed(5);
  const at::Tensor x = at::randn({b, s, d.hidden}).to(device, dtype), gout = at::randn({b, s, d.hidden}).to(device, dtype);
  Runs r;
  r.recomputed.dx = layer_backward(d, recomputed.w, layout, x, gout, recomputed.grads, tile);
  r.recomputed.grads = recomputed.grads;
  const int64_t e = int64_t(c10::elementSize(dtype));
  const at::Tensor flat = at::zeros({layer_saved_elems(d, b * s, e)}, at::TensorOptions(dtype).device(device));
  const LayerSaved saved = layer_saved_views(d, b * s, flat);
  const at::Tensor y = layer_forward(d, w, layout, x, tile, &saved);
  CHECK(at::equal(y, layer_forward(d, w, layout, x, tile)));
  if (poke) saved.lse.add_(0.5);
  r.kept.dx = layer_backward(d, w, layout, x, gout, kept.grads, tile, &saved);
  r.kept.grads = kept.grads;
  return r;
}

RopeTables tables(const BlockDims& d, int64_t s, at::ScalarType dtype, at::Device device) {
  RopeDims rope;
  rope.theta = 500.0;
  return rope_tables(rope, d.head_dim, s, dtype, device);
}

}  // namespace

TEST_CASE("a kept layer's attention backward from the kept output and log-sum-exp is the recomputing one",
          "[gpu][attention]") {
  const int64_t b = 2, s = 13;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (bool gqa : {false, true}) {
      for (bool qwen3 : {false, true}) {
        for (int64_t tile : {int64_t{0}, int64_t{7}}) {
          INFO("dtype " << c10::toString(dtype) << " gqa " << gqa << " qwen3 " << qwen3 << " tile " << tile);
          const BlockDims d = dims(gqa, qwen3);
          const Runs r = run(d, dtype, at::kCPU, tables(d, s, dtype, at::kCPU), b, s, tile);
          CHECK(same(r.kept, r.recomputed));
        }
      }
    }
  }
}

TEST_CASE("a kept layer's attention backward holds with a sliding window and with packed documents",
          "[gpu][attention]") {
  const int64_t b = 2, s = 13;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t tile : {int64_t{0}, int64_t{7}}) {  // 7 tokens: query tiles of 3 positions
      {
        INFO("window 5, " << c10::toString(dtype) << ", tile " << tile);
        const BlockDims d = dims(true, false, 5);
        const Runs r = run(d, dtype, at::kCPU, tables(d, s, dtype, at::kCPU), b, s, tile);
        CHECK(same(r.kept, r.recomputed));
      }
      {
        INFO("packed documents, " << c10::toString(dtype) << ", tile " << tile);
        const BlockDims d = dims(true, true);
        // Row 0: documents of 5 and 8 tokens; row 1: 13.
        std::vector<int64_t> pos;
        for (int64_t i = 0; i < s; ++i) pos.push_back(i < 5 ? i : i - 5);
        for (int64_t i = 0; i < s; ++i) pos.push_back(i);
        const at::Tensor positions = at::tensor(pos, at::kLong).view({b, s});
        const TokenLayout layout = token_layout(tables(d, s, dtype, at::kCPU), positions);
        const Runs r = run(d, dtype, at::kCPU, layout, b, s, tile);
        CHECK(same(r.kept, r.recomputed));
      }
    }
  }
}

TEST_CASE("a kept layer's backward reads the kept log-sum-exp instead of running the core again",
          "[gpu][attention]") {
  const BlockDims d = dims(true, true);
  const Runs r = run(d, at::kFloat, at::kCPU, tables(d, 9, at::kFloat, at::kCPU), 1, 9, 0, /*poke=*/true);
  CHECK_FALSE(at::equal(r.kept.grads.at("self_attn.q_proj.weight"), r.recomputed.grads.at("self_attn.q_proj.weight")));
  // o_proj's gradient reads the kept output, not the log-sum-exp.
  CHECK(at::equal(r.kept.grads.at("self_attn.o_proj.weight"), r.recomputed.grads.at("self_attn.o_proj.weight")));
}

TEST_CASE("cuda: a kept layer's attention backward is the recomputing one in bf16", "[cuda][gpu][attention]") {
  const CudaProbe probe = probe_cuda();
  if (probe.device_count == 0) {
    WARN("skipped: no GPU (" << probe.reason << ")");
    return;
  }
  const at::Device cuda(at::kCUDA, 0);
  for (bool gqa : {false, true}) {
    for (bool qwen3 : {false, true}) {
      for (int64_t tile : {int64_t{0}, int64_t{48}}) {  // 48 tokens: query tiles of 24 positions
        INFO("gqa " << gqa << " qwen3 " << qwen3 << " tile " << tile);
        const BlockDims d = dims(gqa, qwen3);
        const Runs r = run(d, at::kBFloat16, cuda, tables(d, 64, at::kBFloat16, cuda), 2, 64, tile);
        CHECK(same(r.kept, r.recomputed));
      }
    }
  }
  // Where the flash kernel runs, the kept log-sum-exp is what the backward reads.
  const BlockDims d = dims(true, true);
  const Runs poked = run(d, at::kBFloat16, cuda, tables(d, 64, at::kBFloat16, cuda), 2, 64, 0, /*poke=*/true);
  CHECK_FALSE(at::equal(poked.kept.grads.at("self_attn.q_proj.weight"),
                        poked.recomputed.grads.at("self_attn.q_proj.weight")));
}

namespace {

double rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-30);
}

// The core's output and gradients for random projections, in query tiles of `tile`.
struct Core {
  at::Tensor out;
  AttentionGrads g;
};
Core core(const BlockDims& d, const TensorMap& w, const TokenLayout& layout, int64_t b, int64_t s, int64_t tile,
          AttentionPath path, at::Device device = at::kCPU) {
  at::manual_seed(3);
  const int64_t q = d.heads * d.head_dim, kv = d.kv_heads * d.head_dim;
  auto randn = [&](int64_t f) { return at::randn({b, s, f}).to(device); };
  const at::Tensor qp = randn(q), kp = randn(kv), vp = randn(kv), da = randn(q);
  Core c;
  c.out = attention_core(d, w, layout, qp, kp, vp, tile, nullptr, path);
  TensorMap leaves;
  for (const auto& [name, t] : w) leaves.emplace(name, t.detach().requires_grad_(true));
  AttentionGraph g = attention_graph(d, leaves, d.qk_norm, layout, qp, kp, vp, tile, nullptr, path);
  CHECK(at::equal(g.out, c.out));
  c.g = attention_grads(g, da);
  return c;
}

}  // namespace

TEST_CASE("attention in query tiles equals one tile to fp32 rounding, by either backward", "[gpu][attention]") {
  const int64_t b = 2, s = 13;
  struct Case {
    const char* name;
    BlockDims d;
    bool packed;
  };
  const Case cases[] = {{"plain", dims(false, false), false}, {"gqa", dims(true, false), false},
                        {"qwen3", dims(true, true), false},   {"window 5", dims(true, false, 5), false},
                        {"packed", dims(true, true), true}};
  for (const Case& c : cases) {
    const TensorMap w = random_layer(c.d, at::kFloat, 11).w;
    // Row 0: documents of 5 and 8 tokens; row 1: 13.
    std::vector<int64_t> pos;
    for (int64_t i = 0; i < 2 * s; ++i) pos.push_back(i < 5 ? i : i < s ? i - 5 : i - s);
    const RopeTables t = tables(c.d, s, at::kFloat, at::kCPU);
    const TokenLayout layout = c.packed ? token_layout(t, at::tensor(pos, at::kLong).view({b, s})) : TokenLayout(t);
    const Core one = core(c.d, w, layout, b, s, s, AttentionPath::kAuto);
    for (AttentionPath path : {AttentionPath::kAuto, AttentionPath::kRebuilt}) {
      for (int64_t tile : {int64_t{1}, int64_t{4}, int64_t{5}, s}) {
        INFO(c.name << ", tile " << tile << (path == AttentionPath::kAuto ? ", the kernel's backward" : ", rebuilt"));
        const Core tiled = core(c.d, w, layout, b, s, tile, path);
        CHECK(rel(tiled.out, one.out) < 1e-6);
        CHECK(rel(tiled.g.q, one.g.q) < 1e-6);
        CHECK(rel(tiled.g.k, one.g.k) < 1e-6);
        CHECK(rel(tiled.g.v, one.g.v) < 1e-6);
        if (c.d.qk_norm) {
          CHECK(rel(tiled.g.q_norm, one.g.q_norm) < 1e-6);
          CHECK(rel(tiled.g.k_norm, one.g.k_norm) < 1e-6);
        }
      }
    }
  }
}

TEST_CASE("cuda: attention in query tiles equals one tile in fp32", "[cuda][gpu][attention]") {
  const CudaProbe probe = probe_cuda();
  if (probe.device_count == 0) {
    WARN("skipped: no GPU (" << probe.reason << ")");
    return;
  }
  // fp32 on CUDA: no flash kernel, so each tile is rebuilt with autograd.
  const at::Device cuda(at::kCUDA, 0);
  const BlockDims d = dims(true, true, 40);
  const TensorMap w = random_layer(d, at::kFloat, 11, cuda).w;
  const TokenLayout layout(tables(d, 64, at::kFloat, cuda));
  const Core one = core(d, w, layout, 2, 64, 64, AttentionPath::kAuto, cuda);
  const Core tiled = core(d, w, layout, 2, 64, 24, AttentionPath::kAuto, cuda);
  CHECK(rel(tiled.out, one.out) < 1e-5);
  CHECK(rel(tiled.g.q, one.g.q) < 1e-5);
  CHECK(rel(tiled.g.k, one.g.k) < 1e-5);
  CHECK(rel(tiled.g.v, one.g.v) < 1e-5);
}
