// The numerics guard on CpuDevice: a step whose loss or gradient is not
// finite changes nothing (no block updated, no step counted), whatever the
// tiers, the gradient ring, clipping or chaos; without clipping a non-finite
// gradient found after other blocks were updated stops the engine.
#include "tests/catch_torch.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>

#include <fmt/format.h>

#include "engine/run/engine.h"
#include "host/error.h"
#include "tests/engine/engine_state.h"
#include "tests/engine/tiny_model.h"

using namespace strider;

namespace {

struct Setup {
  std::string name;
  double clip = 1.0;
  std::vector<int64_t> nvme;
  int64_t grad_ring = 3;
  bool chaos = false;
};

using test::same_bits;
using test::TempDir;

std::unique_ptr<Engine> make(const ModelSpec& spec, const Setup& s, const std::string& dir) {
  EngineConfig cfg;
  cfg.seq = 9;
  cfg.micro_batch = 2;
  cfg.accumulation = 2;
  cfg.compute = {at::kFloat, 40};
  cfg.window = 2;
  cfg.adam = {.lr = 1e-2, .weight_decay = 0.1};
  cfg.clip_norm = s.clip;
  cfg.nvme_blocks = s.nvme;
  cfg.nvme_dir = dir;
  cfg.grad_ring = s.grad_ring;
  cfg.optimizer_threads = 2;
  DeviceOptions dopt{.spec = "cpu", .budget_bytes = size_t(64) << 20,
                     .chaos = {.enabled = s.chaos, .seed = 5, .max_delay_us = 300}};
  auto e = std::make_unique<Engine>(spec, cfg, make_device(dopt));
  e->init_params(7);
  return e;
}

test::State state(Engine& e) { return test::read_all(e); }

StepReport step(Engine& e, uint32_t seed) {
  const EngineConfig& c = e.config();
  test::Batch b = test::batch(c.batch(), c.seq, e.spec().dims.vocab, seed);
  return e.step(b.ids.data(), b.labels.data());
}

const std::vector<Setup>& setups() {
  static const std::vector<Setup> s = {
      {"clipping", 1.0},
      {"no clipping", 0.0},
      {"clipping, state on NVMe, gradient ring of 1 (spilled)", 1.0, {0, 1, 2, 3, 4}, 1},
      {"no clipping, NVMe, ring of 2, chaos", 0.0, {1, 3}, 2, true},
      {"clipping, chaos", 1.0, {}, 3, true},
  };
  return s;
}

// Two engines of one setup, one good step in each: `a` meets the fault,
// `b` is the run that never saw it.
struct Twins {
  TempDir da, db;
  std::unique_ptr<Engine> a, b;
  Twins(const ModelSpec& spec, const Setup& s)
      : a(make(spec, s, da.path.string())), b(make(spec, s, db.path.string())) {
    step(*a, 1);
    step(*b, 1);
  }
};

}  // namespace

TEST_CASE("a non-finite loss skips the step: nothing changes, and the run goes on as if it never came",
          "[engine][guard]") {
  const ModelSpec spec = ModelSpec::from_json(test::tiny_config(false, 3), "tiny");
  for (const Setup& s : setups()) {
    INFO(s.name);
    // a: a step on a model with a NaN weight (skipped), the weight restored,
    // a step. b: the good step only.
    Twins t(spec, s);
    Engine* a = t.a.get();
    Engine* b = t.b.get();
    const std::string name = "model.layers.1.mlp.up_proj.weight";
    const std::vector<float> good = a->param(name);
    std::vector<float> bad = good;
    bad[5] = std::numeric_limits<float>::quiet_NaN();
    a->set_param(name, bad);
    const auto before = state(*a);
    CHECK(a->first_non_finite_param() == name);
    StepReport r = step(*a, 99);
    CHECK(r.skipped);
    CHECK(r.step == 2);
    CHECK(r.skip_reason.starts_with("loss is"));
    CHECK(a->steps_done() == 1);
    CHECK(same_bits(state(*a), before));  // no master, m or v moved
    a->set_param(name, good);
    CHECK(a->first_non_finite_param().empty());
    StepReport ra = step(*a, 2), rb = step(*b, 2);
    CHECK_FALSE(ra.skipped);
    CHECK(ra.step == 2);
    CHECK(ra.loss == rb.loss);
    CHECK(same_bits(state(*a), state(*b)));
  }
}

TEST_CASE("a non-finite gradient skips the step before any update, naming the block and tensor", "[engine][guard]") {
  const ModelSpec spec = ModelSpec::from_json(test::tiny_config(false, 3), "tiny");
  for (const Setup& s : setups()) {
    INFO(s.name);
    Twins t(spec, s);
    Engine* a = t.a.get();
    Engine* b = t.b.get();
    // With clipping any block's gradient is checked before any update;
    // without, the head's (the first to land and be updated).
    const int64_t bad = s.clip > 0 ? 1 : spec.num_blocks() - 1;
    a->inject_nonfinite_gradient(bad);
    const auto before = state(*a);
    StepReport r = step(*a, 50);
    CHECK(r.skipped);
    CHECK(r.nonfinite_block == bad);
    CHECK(r.nonfinite_tensor == spec.layout(bad).slots().front().name);
    CHECK(std::isnan(r.grad_norm));
    CHECK(a->steps_done() == 1);
    CHECK(same_bits(state(*a), before));
    // The fault was one pass's: the next step trains as the reference's second.
    StepReport ra = step(*a, 2), rb = step(*b, 2);
    CHECK_FALSE(ra.skipped);
    CHECK(same_bits(state(*a), state(*b)));
  }
}

TEST_CASE("without clipping, a non-finite gradient after other blocks were updated stops the engine",
          "[engine][guard]") {
  const ModelSpec spec = ModelSpec::from_json(test::tiny_config(false, 3), "tiny");
  TempDir d;
  auto e = make(spec, {"no clipping", 0.0}, d.path.string());
  step(*e, 1);
  e->inject_nonfinite_gradient(1);  // the head and block 2 are updated before block 1's gradient lands
  try {
    step(*e, 2);
    FAIL("the step should have thrown");
  } catch (const Error& err) {
    const std::string what = err.what();
    CHECK(what.find("block 1's gradient is not finite") != std::string::npos);
    CHECK(what.find(spec.layout(1).slots().front().name) != std::string::npos);
    CHECK(what.find("partly applied") != std::string::npos);
  }
  // Nothing of the partial step can be read out (or saved).
  std::vector<float> w(spec.layout(0).total_elems());
  CHECK_THROWS_AS(e->read_state(0, ExtentKind::kMaster, w), Error);
}

TEST_CASE("a batch without a target token changes nothing and is not a fault", "[engine][guard]") {
  // Sparse chat data (only the assistant's turns are targets) has such batches:
  // the step is skipped before any work, the step count and the schedule stay,
  // and the next step is the one an engine that never saw the batch takes.
  const ModelSpec spec = ModelSpec::from_json(test::tiny_config(false), "tiny");
  for (const Setup& s : {Setup{"clip, NVMe tiers, chaos", 1.0, {1, 3}, 1, true}, Setup{"no clip", 0.0}}) {
    INFO(s.name);
    TempDir dir_a, dir_b;
    auto a = make(spec, s, dir_a.path.string()), b = make(spec, s, dir_b.path.string());
    step(*a, 1);
    step(*b, 1);
    const EngineConfig& c = a->config();
    test::Batch empty = test::batch(c.batch(), c.seq, spec.dims.vocab, 2);
    std::fill(empty.labels.begin(), empty.labels.end(), int64_t{-100});
    const test::State before = state(*a);
    const StepReport r = a->step(empty.ids.data(), empty.labels.data());
    CHECK(r.skipped);
    CHECK(r.no_targets);
    CHECK(r.step == 2);
    CHECK_THAT(r.skip_reason, Catch::Contains("no target token"));
    CHECK(a->steps_done() == 1);
    CHECK(same_bits(state(*a), before));
    const StepReport ra = step(*a, 3), rb = step(*b, 3);
    CHECK(ra.step == 2);
    CHECK(ra.loss == rb.loss);
    CHECK(same_bits(state(*a), state(*b)));
  }
}

TEST_CASE("a step whose device work fails part way leaves the last whole state, or says it is not whole",
          "[engine][guard]") {
  // settle_after_failure's verdict against the state itself: "whole" is the
  // previous step's bits; "not whole" only without clipping (updates overlap
  // the backward) and only when some piece did move. In the forward nothing
  // has landed: whole in every setup.
  const ModelSpec spec = ModelSpec::from_json(test::tiny_config(false, 3), "tiny");
  for (const Setup& s : setups())
    for (StepOpKind kind : {StepOpKind::kForward, StepOpKind::kBackward}) {
      INFO(s.name << ", a fault at block 1's " << op_name(kind));
      Twins t(spec, s);
      Engine* a = t.a.get();
      a->inject_device_fault(kind, 1);
      CHECK_THROWS_WITH(step(*a, 2), Catch::Contains(fmt::format("injected device fault: {} of block 1", op_name(kind))));
      const std::string broken = a->settle_after_failure();
      CHECK(a->steps_done() == 1);
      if (broken.empty()) {
        CHECK(same_bits(state(*a), state(*t.b)));
      } else {
        CHECK((s.clip == 0 && kind == StepOpKind::kBackward));
        CHECK_THAT(broken, Catch::Contains("step 2 had updated part of the model before it failed"));
        CHECK_FALSE(same_bits(state(*a), state(*t.b)));
      }
      CHECK_THROWS_WITH(step(*a, 2), Catch::Contains("the engine failed earlier"));
      CHECK_THROWS_WITH(a->evaluate(nullptr, nullptr), Catch::Contains("the engine failed earlier"));
    }
  TempDir d;
  auto e = make(spec, setups().front(), d.path.string());
  CHECK_THROWS_WITH(e->inject_device_fault(StepOpKind::kAdamW, 1), Catch::Contains("'adamw' is a host operation"));
  CHECK_THROWS_WITH(e->inject_device_fault(StepOpKind::kHeadGrad, 1), Catch::Contains("has no 'head backward' of block 1"));
}
