// fp16 compute with dynamic loss scaling on CpuDevice (EngineConfig::
// loss_scaling): offload changes nothing in fp16 either, an overflow skips
// the step without touching the state and backs the scale off (not a
// divergence above the floor), good steps grow it, and the fp16 run learns
// what the fp32 one does to fp16's precision. ATen's fp16 GEMM on the CPU is
// tens of times slower than bf16's: the tiny model only.
#include "tests/catch_torch.h"

#include <cmath>

#include "engine/program/timeline.h"
#include "engine/run/engine.h"
#include "gpu/device/sim_device.h"
#include "host/error.h"
#include "tests/engine/engine_cases.h"
#include "tests/engine/engine_state.h"

using namespace strider;
using namespace strider::test;

namespace {

std::unique_ptr<Engine> fp16_engine(const ModelSpec& spec, double clip, int64_t growth_interval = 2000,
                                    double init = 65536.0) {
  EngineConfig cfg = small_bf16();
  cfg.compute.dtype = at::kHalf;
  cfg.window = 2;
  cfg.adam = {.lr = 1e-2, .weight_decay = 0.1};
  cfg.clip_norm = clip;
  cfg.loss_scaling.growth_interval = growth_interval;
  cfg.loss_scaling.init = init;
  cfg.optimizer_threads = 2;
  auto e = std::make_unique<Engine>(spec, cfg, make_device(DeviceOptions{.spec = "cpu", .budget_bytes = size_t(64) << 20}));
  e->init_params(7);
  return e;
}

StepReport step(Engine& e, uint32_t seed) {
  const EngineConfig& c = e.config();
  Batch b = batch(c.batch(), c.seq, e.spec().dims.vocab, seed);
  return e.step(b.ids.data(), b.labels.data());
}

}  // namespace

TEST_CASE("fp16: offload changes nothing, bit for bit", "[engine][fp16]") {
  // The cases of test_engine.cpp that move something different: K, host
  // checkpoints, NVMe state and its gradient ring, chaos, vocabulary shards,
  // kept activations and logits, fp16 compute copies on NVMe. Clipping on and
  // off: with loss scaling the norm gates every update either way.
  const ModelSpec spec = tiny(true);
  const std::vector<Case> all = cases(spec.num_blocks());
  for (double clip : {0.0, 0.5}) {
    const Result ref = run(spec, {"reference: all resident", spec.num_blocks()}, at::kHalf, clip);
    CHECK(ref.losses.back() < ref.losses.front());  // it trains
    for (size_t i : {0, 3, 5, 7, 10, 13, 17, 20, 23}) {
      const Case& c = all.at(i);
      INFO("clip=" << clip << " case: " << c.name);
      CHECK(same_bits(run(spec, c, at::kHalf, clip), ref));
    }
  }
}

namespace {

// The relative L2 gap of two runs' masters (every third state vector).
double master_gap(const Result& a, const Result& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.state.size(); i += 3)
    for (size_t k = 0; k < ref.state[i].size(); ++k) {
      const double d = double(a.state[i][k]) - ref.state[i][k];
      num += d * d;
      den += double(ref.state[i][k]) * ref.state[i][k];
    }
  return std::sqrt(num / den);
}

}  // namespace

TEST_CASE("fp16 trains as fp32 does, closer than bf16 does", "[engine][fp16]") {
  // fp16 keeps 10 bits of mantissa to bf16's 7: with its loss scaled, the
  // same run lands nearer the fp32 one than bf16's does.
  const ModelSpec spec = tiny(false);
  const Case resident{"all resident", spec.num_blocks()};
  const Result fp32 = run(spec, resident, at::kFloat, 0.5, 4), fp16 = run(spec, resident, at::kHalf, 0.5, 4),
               bf16 = run(spec, resident, at::kBFloat16, 0.5, 4);
  double fp16_loss_gap = 0, bf16_loss_gap = 0;
  for (size_t s = 0; s < fp32.losses.size(); ++s) {
    INFO("step " << s + 1 << ": fp32 loss " << fp32.losses[s] << ", fp16 " << fp16.losses[s] << ", bf16 "
                 << bf16.losses[s]);
    CHECK(std::abs(fp16.losses[s] - fp32.losses[s]) < 2e-3 * std::abs(fp32.losses[s]));
    fp16_loss_gap += std::abs(fp16.losses[s] - fp32.losses[s]);
    bf16_loss_gap += std::abs(bf16.losses[s] - fp32.losses[s]);
  }
  const double fp16_gap = master_gap(fp16, fp32), bf16_gap = master_gap(bf16, fp32);
  INFO("relative L2 gap of the masters to fp32's after 4 steps: fp16 " << fp16_gap << ", bf16 " << bf16_gap
                                                                         << "; summed loss gaps: fp16 " << fp16_loss_gap
                                                                         << ", bf16 " << bf16_loss_gap);
  CHECK(fp16_gap < bf16_gap);
  CHECK(fp16_loss_gap < bf16_loss_gap);
}

TEST_CASE("fp16: an overflow skips the step, changes no state and halves the scale", "[engine][fp16]") {
  const ModelSpec spec = tiny(false);
  for (double clip : {0.0, 1.0}) {
    INFO("clip=" << clip);
    auto a = fp16_engine(spec, clip), b = fp16_engine(spec, clip);
    CHECK(a->loss_scale().scale == 65536.0);
    CHECK(step(*a, 1).loss_scale == 65536.0);
    step(*b, 1);
    const State before = read_all(*a);
    // An fp16 gradient past 65504 lands as Inf; the injection is the same fault.
    a->inject_nonfinite_gradient(2);
    const StepReport r = step(*a, 2);
    CHECK(r.skipped);
    CHECK(r.overflow);  // finite loss, scale above the floor: not a divergence
    CHECK(std::isfinite(r.loss));
    CHECK(r.loss_scale == 65536.0);
    CHECK(r.nonfinite_block == 2);
    CHECK(a->steps_done() == 1);
    CHECK(a->loss_scale().scale == 32768.0);
    CHECK(a->loss_scale().good_steps == 0);
    CHECK(same_bits(read_all(*a), before));
    // The next step carries the halved scale; its update is the one the
    // twin makes (the scale is a power of two: dividing it out is exact).
    b->set_loss_scale({32768.0, 0});
    const StepReport ra = step(*a, 3), rb = step(*b, 3);
    CHECK(ra.loss_scale == 32768.0);
    CHECK_FALSE(ra.skipped);
    CHECK(ra.loss == rb.loss);
    CHECK(same_bits(read_all(*a), read_all(*b)));
  }
}

TEST_CASE("fp16: good steps grow the scale, and an overflow at the floor is a divergence", "[engine][fp16]") {
  const ModelSpec spec = tiny(false);
  auto e = fp16_engine(spec, 0.0, /*growth_interval=*/2, /*init=*/4.0);
  step(*e, 1);
  CHECK(e->loss_scale().scale == 4.0);
  CHECK(e->loss_scale().good_steps == 1);
  step(*e, 2);
  CHECK(e->loss_scale().scale == 8.0);
  CHECK(e->loss_scale().good_steps == 0);
  e->set_loss_scale({1.0, 1});  // the floor
  e->inject_nonfinite_gradient(1);
  const StepReport r = step(*e, 3);
  CHECK(r.skipped);
  CHECK_FALSE(r.overflow);
  CHECK(e->loss_scale().scale == 1.0);
  CHECK(e->loss_scale().good_steps == 0);
  CHECK_THROWS_WITH(e->set_loss_scale({0.5, 0}), Catch::Contains("at least the floor 1"));
}

TEST_CASE("fp16 refuses what it cannot run, naming it", "[engine][fp16]") {
  const ModelSpec spec = tiny(false);
  EngineConfig cfg = small_bf16();
  cfg.compute.dtype = at::kHalf;
  cfg.optimizer_state = StateFormat::kQ8;
  auto dev = [] { return make_device(DeviceOptions{.spec = "cpu", .budget_bytes = size_t(64) << 20}); };
  CHECK_THROWS_WITH(Engine(spec, cfg, dev()), Catch::Contains("needs the bf16 compute dtype, not fp16"));
  cfg.compute.dtype = at::kBFloat16;
  cfg.optimizer_state = StateFormat::kFp32;
  Engine bf16(spec, cfg, dev());
  CHECK(bf16.loss_scale().scale == 1.0);
  CHECK_THROWS_WITH(bf16.set_loss_scale({2.0, 0}), Catch::Contains("the bf16 compute dtype does not scale its loss"));
}

TEST_CASE("fp16: a resumed run keeps its loss scale and its run of good steps", "[engine][fp16][ckpt]") {
  // Growth every 3 good steps; an overflow at step 2 (1-based). Saved after
  // step 3 at scale 2^15 with one good step, the resumed run grows the scale
  // at step 5, as the uninterrupted one does, to the same bits.
  const nlohmann::json model = tiny_config(false);
  const ModelSpec spec = ModelSpec::from_json(model, "tiny");
  auto steps = [&](Engine& e, int from, int to) {
    std::vector<double> scales;
    for (int s = from; s < to; ++s) {
      if (s == 1) e.inject_nonfinite_gradient(2);
      scales.push_back(step(e, 100 + s).loss_scale);
    }
    return scales;
  };
  auto ref = fp16_engine(spec, 1.0, 3);
  const std::vector<double> ref_scales = steps(*ref, 0, 6);
  CHECK(ref_scales == std::vector<double>{65536, 65536, 32768, 32768, 32768, 65536});
  const State ref_state = read_all(*ref);

  TempDir tmp;
  const std::filesystem::path dir = tmp.path / "ckpt";
  {
    auto first = fp16_engine(spec, 1.0, 3);
    steps(*first, 0, 3);
    CHECK(first->loss_scale().scale == 32768.0);
    CHECK(first->loss_scale().good_steps == 1);
    save_training_checkpoint(dir, *first, model.dump());
  }
  auto resumed = fp16_engine(spec, 1.0, 3);
  CHECK(resumed->loss_scale().scale == 65536.0);
  load_training_checkpoint(dir, *resumed);
  CHECK(resumed->steps_done() == 2);
  CHECK(resumed->loss_scale().scale == 32768.0);
  CHECK(resumed->loss_scale().good_steps == 1);
  CHECK(steps(*resumed, 3, 6) == std::vector<double>{32768, 32768, 65536});
  CHECK(same_bits(read_all(*resumed), ref_state));
  CHECK(resumed->loss_scale().good_steps == ref->loss_scale().good_steps);
}

TEST_CASE("fp16 accumulation: CUDA's and the simulator's, refused on the CPU device and without fp16", "[engine][fp16]") {
  // The rtx4090's GeForce rate doubles with fp16 accumulation (Ada whitepaper); a data-centre part's does not.
  CHECK(CostModel::preset("rtx4090").with_fp16_accumulate().peak_tflops == 330.3);
  CHECK(CostModel::preset("h200").with_fp16_accumulate().peak_tflops == CostModel::preset("h200").peak_tflops);
  CHECK(CostModel::parse("h200,fp16_accumulate_tflops=1500").with_fp16_accumulate().peak_tflops == 1500);

  const ModelSpec spec = tiny(false);
  EngineConfig cfg = small_bf16();
  cfg.compute.fp16_accumulate = true;
  auto cpu = [] { return make_device(DeviceOptions{.spec = "cpu", .budget_bytes = size_t(64) << 20}); };
  CHECK_THROWS_WITH(Engine(spec, cfg, cpu()), Catch::Contains("needs dtype fp16, not bf16"));
  cfg.compute.dtype = at::kHalf;
  CHECK_THROWS_WITH(Engine(spec, cfg, cpu()), Catch::Contains("cpu: matmul_accumulate fp16 is CUDA only"));

  // On the simulator the same schedule's compute takes half the time at the rtx4090's rates.
  auto compute_s = [&](bool fp16_accumulate) {
    EngineConfig c = cfg;
    c.compute.fp16_accumulate = fp16_accumulate;
    Engine e(spec, c, make_device(DeviceOptions{.spec = "sim:rtx4090,compute_latency_us=0"}));
    std::vector<int64_t> ids(size_t(c.batch() * c.seq), 0);
    StepReport r = e.step(ids.data(), ids.data());
    r = e.step(ids.data(), ids.data());
    return r.stats.lanes[size_t(Lane::kCompute)].busy_s;
  };
  const double fp32_acc = compute_s(false), fp16_acc = compute_s(true);
  INFO("compute lane: fp32 accumulation " << fp32_acc << " s, fp16 " << fp16_acc << " s");
  CHECK(fp16_acc == Approx(fp32_acc * 165.2 / 330.3).epsilon(1e-9));
}
