// The streamed LM head: vocabulary shards and token tiles give the loss and
// gradients of the whole head (bit for bit with shards on chunk boundaries,
// to fp32 rounding with token tiles, whose weight gradients sum tile by tile).
#include "tests/catch_torch.h"

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include "engine/run/engine.h"
#include "gpu/blocks/chunked_loss.h"
#include "tests/engine/tiny_model.h"

using namespace strider;

namespace {

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

struct Head {
  at::Tensor loss, grad_x, grad_norm, grad_w;
};

// Shards of `rows` rows (0: one), `tile` tokens at a time (0: all).
Head streamed(const BlockDims& d, const at::Tensor& norm, const at::Tensor& w, const at::Tensor& x,
              const at::Tensor& labels, int64_t chunk, int64_t rows, int64_t tile) {
  const int64_t T = x.size(0), V = w.size(0);
  if (rows == 0) rows = V;
  HeadState st{at::empty({T}), at::empty({T}), at::empty({T})};
  head_state_reset(st);
  for (int64_t v0 = 0; v0 < V; v0 += rows)
    head_lse_shard(d, norm, x, w.slice(0, v0, std::min(V, v0 + rows)), v0, labels, chunk, tile, st);
  at::Tensor lse = head_lse(st), loss = at::empty({}, at::kDouble), valid = at::empty({}, at::kDouble);
  head_loss_sums(st, lse, labels, loss, valid);
  Head h{loss, {}, at::zeros_like(norm, at::kFloat), at::zeros_like(w, at::kFloat)};
  at::Tensor grad_h = at::zeros({T, d.hidden});
  for (int64_t v0 = 0; v0 < V; v0 += rows)
    head_grad_shard(d, norm, x, w.slice(0, v0, std::min(V, v0 + rows)), v0, labels, chunk, tile, lse,
                    1.0 / valid.item<double>(), grad_h, h.grad_w.slice(0, v0, std::min(V, v0 + rows)));
  h.grad_x = head_norm_backward(d, norm, x, grad_h, h.grad_norm, tile);
  return h;
}

}  // namespace

TEST_CASE("the streamed head: shards are exact, token tiles equal to fp32 rounding", "[engine][head]") {
  // One ATen thread: the claim is about shard boundaries, not the BLAS. On a
  // Xeon with AVX-512 BF16/FP16 (torch 2.15), the same [53, 32] x [32, 40]
  // fp32 GEMM on 2 threads gave other last bits in about 3 of 100 processes
  // (tests/engine/test_head_tiles run 100 times; none with 1 thread).
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  struct Restore {
    int n;
    ~Restore() { at::set_num_threads(n); }
  } restore{threads};
  const ModelSpec spec = ModelSpec::from_json(test::tiny_config(false), "tiny");
  const BlockDims& d = spec.dims;
  at::manual_seed(3);
  const int64_t T = 53;
  at::Tensor x = at::randn({T, d.hidden}), norm = 1 + 0.1 * at::randn({d.hidden}), w = 0.2 * at::randn({d.vocab, d.hidden});
  at::Tensor labels = at::randint(d.vocab, {T}, at::kLong);
  labels.index_put_({at::arange(0, T, 5)}, -100);
  // The whole head, as the resident reference computes it.
  HeadGrads g{at::zeros({d.hidden}), at::zeros({d.vocab, d.hidden})};
  HeadResult whole = head_loss_backward(d, {norm, w}, x.view({1, T, d.hidden}), labels.view({1, T}), 40,
                                        1.0 / double((labels != -100).sum().item<int64_t>()), g);
  const Head sharded = streamed(d, norm, w, x, labels, 40, 40, 0);
  CHECK(sharded.loss.item<double>() == whole.loss_sum);
  CHECK(at::equal(sharded.grad_w, g.lm_head));
  CHECK(at::equal(sharded.grad_norm, g.norm));
  CHECK(at::equal(sharded.grad_x, whole.grad_input.view({T, d.hidden})));
  for (int64_t tile : {1, 7, 16, 52}) {
    INFO("token tile " << tile);
    const Head tiled = streamed(d, norm, w, x, labels, 40, 80, tile);
    CHECK(std::abs(tiled.loss.item<double>() - whole.loss_sum) <= 1e-6 * std::abs(whole.loss_sum));
    CHECK(max_rel(tiled.grad_w, g.lm_head) <= 1e-6);
    CHECK(max_rel(tiled.grad_norm, g.norm) <= 1e-6);
    CHECK(max_rel(tiled.grad_x, whole.grad_input.view({T, d.hidden})) <= 1e-6);
  }
}

TEST_CASE("token tiles in the engine: the same training to fp32 rounding", "[engine][head]") {
  for (bool tied : {false, true}) {
    INFO("tied=" << tied);
    const ModelSpec spec = ModelSpec::from_json(test::tiny_config(tied), "tiny");
    auto run = [&](int64_t tile) {
      EngineConfig cfg;
      cfg.seq = 9;
      cfg.micro_batch = 2;
      cfg.accumulation = 2;
      cfg.compute = {at::kFloat, 40, tile};
      cfg.vocab_shard_rows = 40;
      cfg.adam = {.lr = 1e-3, .weight_decay = 0.1};
      cfg.clip_norm = 1.0;
      Engine e(spec, cfg, make_device({.spec = "cpu", .chaos = {.enabled = true, .seed = 4}}));
      e.init_params(5);
      std::vector<double> losses;
      for (int s = 0; s < 3; ++s) {
        test::Batch b = test::batch(cfg.batch(), cfg.seq, spec.dims.vocab, 20 + s);
        losses.push_back(e.step(b.ids.data(), b.labels.data()).loss);
      }
      return std::pair{losses, e.param(spec.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight")};
    };
    const auto [l0, p0] = run(0);
    const auto [l5, p5] = run(5);
    for (size_t i = 0; i < l0.size(); ++i) CHECK(std::abs(l5[i] - l0[i]) <= 1e-6 * std::abs(l0[i]));
    // AdamW's first steps move each weight by about lr: the tiles may change
    // its last bits only.
    double worst = 0;
    for (size_t i = 0; i < p0.size(); ++i) worst = std::max(worst, double(std::abs(p5[i] - p0[i])));
    CHECK(worst <= 1e-6);
  }
}
