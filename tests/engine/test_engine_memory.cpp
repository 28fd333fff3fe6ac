// What a step moves and needs, on CpuDevice: the H2D and D2H bytes of the
// step's report against the visit schedule worked out by hand from the tiny
// model's tensor shapes (docs/design.md, "One training step"), and ATen's working
// memory (the most any compute op held), measured per step.
#include "tests/catch_torch.h"

#include <algorithm>

#include "engine/run/engine.h"
#include "tests/engine/tiny_model.h"

using namespace strider;

namespace {

// A block's flat buffer: each tensor starts at a multiple of 128 elements
// (256 bytes of bf16), so each takes its size rounded up to 128.
uint64_t padded(uint64_t elems) { return (elems + 127) / 128 * 128; }

// The tiny model (tests/engine/tiny_model.h): hidden 32, 4 heads of 8 (q 32),
// 2 KV heads (k, v 16), intermediate 48, vocab 96, 3 layers.
constexpr uint64_t kHidden = 32, kQ = 32, kKv = 16, kInter = 48, kVocab = 96, kLayers = 3;
uint64_t embedding_elems() { return padded(kVocab * kHidden); }
uint64_t layer_elems() {
  return padded(kHidden) + padded(kQ * kHidden) + 2 * padded(kKv * kHidden) + padded(kHidden * kQ) +
         padded(kHidden) + 2 * padded(kInter * kHidden) + padded(kHidden * kInter);
}
uint64_t head_elems(bool tied) { return padded(kHidden) + (tied ? 0 : padded(kVocab * kHidden)); }

struct Shape {
  bool tied = false;
  bool host_ckpt = false;
  int64_t window = 2;
};

struct Expected {
  uint64_t h2d = 0, d2h = 0;
};

// One step, bf16 compute copies (2 bytes), bf16 gradients (2 bytes, summed in
// fp32 on the device; the tiny model's vocabulary is one shard):
//   visits: forward of the embedding and each layer, the head, backward of
//   each layer and the embedding. Each visit brings its block's compute copy;
//   the head also brings the tied embedding's, and the embedding's backward
//   brings the head's fp32 share of a tied embedding's gradient. Each
//   backward visit (the head's included) sends its bf16 gradients out, and
//   the head the tied embedding's share too, in fp32.
//   the batch: ids and labels, int64, batch x seq each, in.
//   the loss figures: a sum and a token count per micro-batch, float64, out.
//   host checkpoints: each layer's input (the first layer's is the
//   embedding's output), per micro-batch, out in forward and back for the
//   layer's backward, which recomputes from it. The embedding recomputes from
//   the ids, and the head runs on the last layer's output at once.
Expected expected(const Shape& s, int64_t micro_batch, int64_t accumulation, int64_t seq) {
  const uint64_t emb = embedding_elems(), layer = layer_elems(), head = head_elems(s.tied);
  const uint64_t M = uint64_t(accumulation), tokens = uint64_t(micro_batch * accumulation * seq);
  Expected e;
  e.h2d = 2 * (emb + kLayers * layer) * 2 + head * 2 + 2 * tokens * 8;
  e.d2h = (emb + kLayers * layer + head) * 2 + 2 * M * 8;
  if (s.tied) {
    e.h2d += emb * 2 + emb * 4;
    e.d2h += emb * 4;
  }
  if (s.host_ckpt) {
    const uint64_t checkpoint = uint64_t(micro_batch * seq) * kHidden * 2;
    e.h2d += kLayers * M * checkpoint;
    e.d2h += kLayers * M * checkpoint;
  }
  return e;
}

}  // namespace

TEST_CASE("a step reports the bytes its visits moved each way and ATen's working memory", "[engine][memory]") {
  for (const Shape& shape : {Shape{false, false, 2}, Shape{true, true, 3}, Shape{false, true, 2}}) {
    INFO("tied " << shape.tied << ", host checkpoints " << shape.host_ckpt << ", K " << shape.window);
    const ModelSpec spec = ModelSpec::from_json(test::tiny_config(shape.tied), "tiny");
    // The hand count of the shapes is the layout's.
    REQUIRE(spec.num_blocks() == int64_t(kLayers) + 2);
    REQUIRE(spec.layout(1).total_elems() == layer_elems());
    EngineConfig cfg;
    cfg.seq = 16;
    cfg.micro_batch = 2;
    cfg.accumulation = 2;
    cfg.window = shape.window;
    cfg.checkpoints_on_host = shape.host_ckpt;
    cfg.optimizer_threads = 1;
    Engine e(spec, cfg, make_device({.spec = "cpu", .budget_bytes = size_t(64) << 20, .record_spans = true}));
    e.init_params(3);
    const Expected want = expected(shape, cfg.micro_batch, cfg.accumulation, cfg.seq);
    for (uint32_t s = 0; s < 2; ++s) {
      const test::Batch b = test::batch(cfg.batch(), cfg.seq, spec.dims.vocab, 40 + s);
      if (s == 1) e.evaluate(b.ids.data(), b.labels.data());  // between steps: counted in neither
      const StepReport r = e.step(b.ids.data(), b.labels.data());
      CHECK(r.h2d_bytes == want.h2d);
      CHECK(r.d2h_bytes == want.d2h);
      // Working memory: ATen allocates inside every block's ops; the report
      // holds this step's largest, which its spans carry one by one.
      CHECK(r.work_peak_bytes > 0);
      uint64_t most = 0;
      for (const Span& sp : e.timeline().spans())
        if (sp.lane == Lane::kCompute && sp.step == r.step) most = std::max(most, sp.work_peak_bytes);
      CHECK(r.work_peak_bytes == most);
    }
  }
}

TEST_CASE("a step whose op needs more ATen working memory than the device's limit fails, naming the op",
          "[engine][memory]") {
  const ModelSpec spec = ModelSpec::from_json(test::tiny_config(false), "tiny");
  EngineConfig cfg;
  cfg.seq = 16;
  cfg.micro_batch = 2;
  cfg.optimizer_threads = 1;
  const test::Batch b = test::batch(cfg.batch(), cfg.seq, spec.dims.vocab, 7);
  // The embedding's forward (one shard) alone makes a [32, 32] bf16 gather: 2 KiB.
  Engine e(spec, cfg, make_device({.spec = "cpu", .budget_bytes = size_t(64) << 20, .work_limit_bytes = 1024}));
  e.init_params(3);
  CHECK_THROWS_WITH(e.step(b.ids.data(), b.labels.data()),
                    Catch::Contains("'embedding shard' (block 0)") && Catch::Contains("limit of 1024 bytes") &&
                        Catch::Contains("work_limit_bytes"));
}
