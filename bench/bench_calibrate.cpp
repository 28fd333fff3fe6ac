// bench_calibrate: does the simulator predict a real device's step time?
//
// 1. The op mix. The engine's own schedule, run once on a SimDevice, lists the
//    operations of one step of each configuration: each compute op (name,
//    block, FLOPs), each copy (direction, bytes), each block's AdamW (params).
// 2. Isolated costs, measured on the real device (--device cpu or cuda), one
//    operation kind at a time with nothing else running, never inside a step:
//      compute  each distinct op, run on the device's compute stream with the
//               model's own block code (BlockRunner), timed by the device's
//               spans; fitted as latency + FLOPs / rate over the op mix;
//      copies   each distinct copy size, H2D and D2H, from pinned host memory,
//               timed by the device's spans; fitted as latency + bytes / GB/s;
//      AdamW    CpuAdam (the engine's thread count) over each block's size.
//    These make a CostModel (peak_tflops = the achieved rate, mfu = 1).
// 3. The prediction. The same configuration runs for a few steps on the real
//    device and, with that cost model, on a SimDevice; the bench prints the
//    measured and predicted step time, their ratio, and per lane the measured
//    and predicted busy time.
// The built-in model, offloaded as bench_step runs it (K = 2, checkpoints on
// the host, clipping on), for each --accumulation (the first is the headline).
// The last line is one JSON object. A benchmark: it never fails on a ratio.
#include <ATen/CPUGeneratorImpl.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fmt/format.h>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <tuple>

#include "engine/model/builtin.h"
#include "engine/run/block_runner.h"
#include "engine/run/engine.h"
#include "gpu/blocks/unit_tensors.h"
#include "gpu/device/sim_device.h"
#include "host/cpu_adam.h"
#include "host/error.h"
#include "host/pinned_arena.h"

using namespace strider;

namespace {

constexpr size_t kBudgetBytes = size_t{1} << 30;

double median(std::vector<double> v) {
  STRIDER_CHECK(!v.empty(), "median of nothing");
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// How many samples of a time become one figure, for isolated ops and steps
// alike. "median" (the default): over 8 interleaved rounds, predicted/measured
// was 0.88-1.10 for all three configurations in four runs on this 2-core VM,
// where "min" (the least disturbed sample: an extreme value, itself noisy)
// gave 0.80-1.06 from two runs.
bool g_use_min = false;
double estimate(const std::vector<double>& v) {
  STRIDER_CHECK(!v.empty(), "no samples");
  return g_use_min ? *std::min_element(v.begin(), v.end()) : median(v);
}

EngineConfig offloaded_config(int64_t seq, int64_t micro_batch, int64_t accumulation, int optimizer_threads) {
  EngineConfig c;
  c.seq = seq;
  c.micro_batch = micro_batch;
  c.accumulation = accumulation;
  c.window = 2;
  c.checkpoints_on_host = true;
  c.clip_norm = 1.0;
  c.optimizer_threads = optimizer_threads;
  return c;
}

// ---- 1. the op mix ----------------------------------------------------------------

struct OpKey {
  Lane lane;
  std::string name;
  int32_t block;  // compute ops: which block (the shapes differ); copies: -1
  uint64_t bytes; // copies: the size; compute ops: 0
  auto operator<=>(const OpKey&) const = default;
};
struct OpUse {
  double flops = 0;        // compute: per op
  uint64_t adam_params = 0;  // optimizer "adamw": per op
  int64_t count = 0;       // per step
};
using OpMix = std::map<OpKey, OpUse>;

// The ops of step 2 of the unchanged engine schedule (step 1 has no previous
// update to wait for; the mix is the same).
OpMix op_mix(const ModelSpec& spec, const EngineConfig& cfg) {
  Engine e(spec, cfg, std::make_unique<SimDevice>(CostModel::preset("rtx4090"),
                                                   DeviceOptions{.budget_bytes = kBudgetBytes, .record_spans = true}));
  std::vector<int64_t> ids(size_t(cfg.batch() * cfg.seq), 0), labels(ids.size(), 0);
  for (int i = 0; i < 2; ++i) e.step(ids.data(), labels.data());
  OpMix mix;
  for (const Span& s : e.timeline().spans()) {
    if (s.step != 2) continue;
    if (s.lane == Lane::kCompute) {
      OpUse& u = mix[{s.lane, s.name, s.block, 0}];
      u.flops = s.flops;
      ++u.count;
    } else if (s.lane == Lane::kH2D || s.lane == Lane::kD2H) {
      ++mix[{s.lane, s.name, -1, s.bytes}].count;
    } else if (s.lane == Lane::kOptimizer && s.name == "adamw") {
      OpUse& u = mix[{s.lane, s.name, s.block, 0}];
      u.adam_params = s.bytes / 28;  // the engine tags an adamw span with 28 bytes per parameter
      ++u.count;
    }
  }
  return mix;
}

// ---- 2. isolated costs ------------------------------------------------------------

// Samples in µs per op kind, gathered over the rounds. Compute ops of one
// shape (every decoder layer's forward, say) are measured once per round, on
// the first block of that shape, and stand for the others (shape_of).
struct Measured {
  std::map<OpKey, std::vector<double>> op_us;
  std::map<OpKey, OpKey> shape_of;
  std::map<uint64_t, std::vector<double>> adam_us;  // per parameter count
  double op(const OpKey& k) const {
    auto s = shape_of.find(k);
    return estimate(op_us.at(s == shape_of.end() ? k : s->second));
  }
};

// Times `fn`, launched `count` times alone on the compute stream (each waits
// for the previous: nothing queued behind it), from the device's spans.
std::vector<double> time_launch(Device& dev, const char* name, int count, const LaunchFn& fn) {
  std::vector<OpSpan> spans;
  dev.synchronize();
  dev.drain_spans(spans);
  spans.clear();
  for (int r = 0; r < count; ++r) {
    dev.launch(StreamId::kCompute, {name}, fn);
    dev.synchronize();
  }
  dev.drain_spans(spans);
  STRIDER_CHECK(spans.size() == size_t(count), "device recorded {} spans for {} launches of {}", spans.size(),
                count, name);
  std::vector<double> us;
  for (const OpSpan& sp : spans) us.push_back(sp.end_us - sp.begin_us);
  return us;
}

// The block's parameters as the engine keeps them: N(0, 0.02) weights, ones for
// norms, zero biases, in the compute dtype on the device.
at::Tensor block_params(const ModelSpec& spec, int64_t b, at::Device d) {
  const ParamLayout layout = spec.layout(b);
  at::Tensor w = at::zeros({int64_t(layout.total_elems())}, at::kFloat);
  at::Generator gen = at::detail::createCPUGenerator(uint64_t(1000 + b));
  for (const TensorSlot& t : layout.slots()) {
    at::Tensor s = w.slice(0, int64_t(t.offset_elems), int64_t(t.offset_elems + t.numel));
    if (t.name.ends_with("norm.weight")) s.fill_(1.0);
    else if (!t.name.ends_with(".bias")) s.normal_(0.0, 0.02, gen);
  }
  return w.to(at::TensorOptions().dtype(at::kBFloat16).device(d));
}

void measure_compute(Device& dev, const ModelSpec& spec, const EngineConfig& cfg, const OpMix& mix, int reps,
                     Measured& out) {
  const at::Device d = aten_device(dev);
  const int64_t mb = cfg.micro_batch, S = cfg.seq, H = spec.dims.hidden, V = spec.dims.vocab;
  const int64_t head = spec.num_blocks() - 1;
  BlockRunner runner(spec, cfg.compute, S, d);
  auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(d);
  at::Generator gen = at::detail::createCPUGenerator(7);
  at::Tensor ids = at::randint(0, V, {mb, S}, gen, at::kLong).to(d);
  at::Tensor labels = at::randint(0, V, {mb, S}, gen, at::kLong).to(d);
  at::Tensor act = at::randn({mb, S, H}, gen, at::kFloat).to(bf16);
  at::Tensor gout = (at::randn({mb, S, H}, gen, at::kFloat) * 1e-3).to(bf16);
  at::Tensor out_act = at::empty({mb, S, H}, bf16), gin_dst = at::empty({mb, S, H}, bf16);
  const double loss_scale = 1.0 / double(mb * S);
  std::map<std::tuple<std::string, double, size_t>, OpKey> shapes;  // this round's
  std::vector<std::pair<OpKey, LaunchFn>> runs;                     // in the mix's order
  for (const auto& [key, use] : mix) {
    if (key.lane != Lane::kCompute) continue;
    const int64_t b = key.block;
    auto [it, fresh] = shapes.try_emplace({key.name, use.flops, spec.layout(b).total_elems()}, key);
    if (!fresh) {
      out.shape_of[key] = it->second;
      continue;
    }
    at::Tensor params = block_params(spec, b, d);
    at::Tensor grads = at::zeros({int64_t(spec.layout(b).total_elems())}, at::TensorOptions().dtype(at::kFloat).device(d));
    at::Tensor in = b == 0 ? ids : act;
    LaunchFn fn;
    if (key.name == "forward") {
      fn = [&runner, b, params, in, out_act](const LaunchContext&) { out_act.copy_(runner.forward(b, params, in)); };
    } else if (key.name == "recompute+backward") {
      fn = [&runner, b, params, in, gout, grads, gin_dst](const LaunchContext&) {
        at::Tensor gin = runner.backward(b, params, in, gout, grads);
        if (gin.defined()) gin_dst.copy_(gin);
      };
    } else if (key.name == "head loss+backward" && b == head) {
      fn = [&runner, params, grads, act, labels, loss_scale](const LaunchContext&) {
        runner.head_backward(params, grads, at::Tensor(), at::Tensor(), act, labels, loss_scale);
      };
    } else if ((key.name == "embedding shard" || key.name == "embedding shard backward") && b == 0) {
      // The whole vocabulary as one shard (the built-in model's).
      at::Tensor rows = params.slice(0, 0, V * H).view({V, H}), grad_rows = grads.slice(0, 0, V * H).view({V, H});
      if (key.name == "embedding shard")
        fn = [rows, ids, out_act](const LaunchContext&) { embedding_shard_forward(rows, 0, ids, out_act, 1.0); };
      else
        fn = [ids, gout, grad_rows](const LaunchContext&) { embedding_shard_backward(ids, 0, gout, grad_rows, 1.0); };
    } else if ((key.name == "head log-sum-exp" || key.name == "head backward" || key.name == "head norm backward") &&
               b == head && !spec.tie_embeddings) {
      // The streamed head over one shard of the whole vocabulary (gpu/blocks/chunked_loss.h), as the engine launches it.
      const size_t lm = spec.layout(head).find("lm_head.weight")->offset_elems;
      at::Tensor norm = params.slice(0, 0, H), rows = params.slice(0, int64_t(lm), int64_t(lm) + V * H).view({V, H});
      at::Tensor grad_norm = grads.slice(0, 0, H), grad_rows = grads.slice(0, int64_t(lm), int64_t(lm) + V * H).view({V, H});
      at::Tensor x = act.view({-1, H}), lab = labels.view({-1});
      auto f32 = at::TensorOptions().dtype(at::kFloat).device(d);
      HeadState st{at::empty({mb * S}, f32), at::empty({mb * S}, f32), at::empty({mb * S}, f32)};
      head_state_reset(st);
      at::Tensor lse = at::zeros({mb * S}, f32), grad_h = at::zeros({mb * S, H}, f32);
      at::Tensor sums = at::zeros({2}, f32.dtype(at::kDouble));
      const BlockDims dims = spec.dims;
      const int64_t chunk = std::min(cfg.compute.vocab_chunk, V), tile = cfg.compute.token_tile;
      if (key.name == "head log-sum-exp")
        fn = [dims, norm, x, rows, lab, chunk, tile, st, lse, sums](const LaunchContext&) mutable {
          head_state_reset(st);
          head_lse_shard(dims, norm, x, rows, 0, lab, chunk, tile, st);
          lse.copy_(head_lse(st));
          at::Tensor loss = sums[0], valid = sums[1];
          head_loss_sums(st, lse, lab, loss, valid);
        };
      else if (key.name == "head backward")
        fn = [dims, norm, x, rows, lab, chunk, tile, lse, loss_scale, grad_h, grad_rows](const LaunchContext&) {
          head_grad_shard(dims, norm, x, rows, 0, lab, chunk, tile, lse, loss_scale, grad_h, grad_rows);
        };
      else
        fn = [dims, norm, x, grad_h, grad_norm, tile, gin_dst](const LaunchContext&) {
          head_norm_backward(dims, norm, x, grad_h, grad_norm, tile, gin_dst.view({-1, dims.hidden}));
        };
    } else if (key.name == "grads to bf16") {
      at::Tensor dst = at::empty({int64_t(spec.layout(b).total_elems())}, bf16);
      fn = [grads, dst](const LaunchContext&) { dst.copy_(grads); };
    } else if (key.name == "zero grads") {
      fn = [grads](const LaunchContext&) { grads.zero_(); };
    } else {
      fmt::print("  (compute op \"{}\" of block {} is not one bench_calibrate can run alone: the fit leaves it "
                 "out; teach measure_compute() about it)\n",
                 key.name, b);
      continue;
    }
    runs.push_back({key, std::move(fn)});
  }
  // Sweeps over the op kinds in turn, one op at a time, rather than one op
  // repeated back to back: in a step an op finds the caches holding other ops'
  // data, not its own from a moment ago. The first sweep warms up and is dropped.
  for (int r = 0; r <= reps; ++r)
    for (const auto& [key, fn] : runs) {
      auto us = time_launch(dev, key.name.c_str(), 1, fn);
      if (r > 0) out.op_us[key].insert(out.op_us[key].end(), us.begin(), us.end());
    }
}

void measure_copies(Device& dev, const OpMix& mix, int reps, Measured& out) {
  uint64_t largest = 0;
  for (const auto& [key, use] : mix)
    if (key.lane == Lane::kH2D || key.lane == Lane::kD2H) largest = std::max(largest, key.bytes);
  // Pinned (and, on CUDA, registered) host memory, as the engine's arena.
  PinnedArena arena(largest + 4096, ArenaOptions{.name = "bench_calibrate host buffer"});
  if (auto reg = dev.host_registrar()) arena.attach(reg);
  std::span<std::byte> host = arena.carve(largest, 4096, "copy source/destination");
  std::memset(host.data(), 1, host.size());
  DeviceBuffer buf = dev.allocate(largest, "copy target");
  std::vector<OpSpan> spans;
  dev.synchronize();
  dev.drain_spans(spans);
  for (const auto& [key, use] : mix) {
    if (key.lane != Lane::kH2D && key.lane != Lane::kD2H) continue;
    spans.clear();
    for (int r = 0; r <= reps; ++r) {
      if (key.lane == Lane::kH2D) dev.copy_h2d(StreamId::kH2D, buf.data(), host.data(), key.bytes, {"calibrate h2d"});
      else dev.copy_d2h(StreamId::kD2H, host.data(), buf.data(), key.bytes, {"calibrate d2h"});
      dev.synchronize();
    }
    dev.drain_spans(spans);
    for (size_t i = 1; i < spans.size(); ++i) out.op_us[key].push_back(spans[i].end_us - spans[i].begin_us);
  }
}

void measure_adam(const OpMix& mix, int optimizer_threads, int reps, Measured& out) {
  CpuAdam adam(CpuAdam::Options{.threads = optimizer_threads});
  const AdamStep st = AdamStep::make(AdamHyper{}, 3, 1.0);
  std::set<size_t> done;  // this round's
  for (const auto& [key, use] : mix) {
    const size_t n = use.adam_params;
    if (key.lane != Lane::kOptimizer || done.count(n)) continue;
    done.insert(n);
    std::vector<float> w(n, 0.01f), m(n, 0.0f), v(n, 0.0f), g(n, 1e-3f);
    std::vector<uint16_t> compute(n);
    for (int r = 0; r <= reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      adam.step(st, AdamArgs{w.data(), m.data(), v.data(), g.data(), DType::kF32, compute.data(), n});
      const double dt = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) out.adam_us[n].push_back(dt);
    }
  }
}

// ---- the cost model ---------------------------------------------------------------

struct Fit {
  double latency_us = 0;
  double rate = 0;  // units (FLOP or bytes) per µs
};

// t = latency + x / rate over (x, t) weighted by per-step counts: the
// intercept from weighted least squares (held >= 0), then the rate that makes
// the weighted total exact, so a step's summed time is reproduced.
Fit fit(const std::vector<std::array<double, 3>>& xtw) {
  double sw = 0, sx = 0, st = 0;
  for (auto [x, t, w] : xtw) { sw += w; sx += w * x; st += w * t; }
  const double mx = sx / sw, mt = st / sw;
  double sxx = 0, sxt = 0;
  for (auto [x, t, w] : xtw) { sxx += w * (x - mx) * (x - mx); sxt += w * (x - mx) * (t - mt); }
  Fit f;
  const double slope = sxx > 0 ? sxt / sxx : 0;
  f.latency_us = slope > 0 ? std::max(0.0, mt - slope * mx) : 0.0;
  f.latency_us = std::min(f.latency_us, 0.9 * mt);  // leave the rate something to explain
  f.rate = sx / (st - sw * f.latency_us);
  return f;
}

CostModel calibrated_model(const OpMix& mix, const Measured& m, const std::string& device, nlohmann::json& fits) {
  std::vector<std::array<double, 3>> compute, h2d, d2h;
  double adam_params = 0, adam_us = 0;
  for (const auto& [key, use] : mix) {
    const double w = double(use.count);
    if (key.lane == Lane::kOptimizer) {
      adam_params += w * double(use.adam_params);
      adam_us += w * estimate(m.adam_us.at(use.adam_params));
      continue;
    }
    if (!m.op_us.count(m.shape_of.count(key) ? m.shape_of.at(key) : key)) continue;  // not measurable alone
    const double us = m.op(key);
    if (key.lane == Lane::kCompute) compute.push_back({use.flops, us, w});
    else (key.lane == Lane::kH2D ? h2d : d2h).push_back({double(key.bytes), us, w});
  }
  STRIDER_CHECK(!compute.empty() && !h2d.empty() && !d2h.empty() && adam_us > 0,
                "the op mix lacks compute, copies or updates: nothing to calibrate");
  const Fit c = fit(compute), hf = fit(h2d), df = fit(d2h);
  CostModel cm;
  cm.name = "calibrated-" + device;
  cm.peak_tflops = c.rate * 1e-6;  // FLOP per µs -> TFLOP/s
  cm.mfu = 1.0;                    // the rate is already what this device sustains on these ops
  cm.compute_latency_us = c.latency_us;
  // One copy latency for both directions (the CostModel has one): their
  // count-weighted mean, each direction's rate refitted around it.
  double wh = 0, wd = 0;
  for (auto& e : h2d) wh += e[2];
  for (auto& e : d2h) wd += e[2];
  cm.copy_latency_us = (hf.latency_us * wh + df.latency_us * wd) / (wh + wd);
  auto rate_with = [&](const std::vector<std::array<double, 3>>& xs) {
    double sx = 0, st = 0;
    for (auto [x, t, w] : xs) { sx += w * x; st += w * (t - cm.copy_latency_us); }
    return sx / std::max(st, 1e-9);
  };
  cm.h2d_gbps = rate_with(h2d) * 1e-3;  // bytes per µs -> GB/s
  cm.d2h_gbps = rate_with(d2h) * 1e-3;
  cm.shared_bus = false;
  cm.set_adam_params_per_s(adam_params / adam_us * 1e6);
  cm.device_memory_bytes = kBudgetBytes;
  fits = {{"compute_tflops", cm.peak_tflops}, {"compute_latency_us", cm.compute_latency_us},
          {"h2d_gbps", cm.h2d_gbps}, {"d2h_gbps", cm.d2h_gbps}, {"copy_latency_us", cm.copy_latency_us},
          {"h2d_latency_fit_us", hf.latency_us}, {"d2h_latency_fit_us", df.latency_us},
          {"cpu_adam_params_per_s", cm.adam_params_per_s(StateFormat::kFp32)}};
  return cm;
}

// ---- 3. measured vs predicted -------------------------------------------------------

struct StepFigures {
  std::vector<double> times;                   // the timed steps
  std::array<double, kNumLanes> busy_s{};      // summed over the timed steps
  double step_s() const { return estimate(times); }
  double busy(int lane) const { return busy_s[size_t(lane)] / double(times.size()); }
};

// One configuration's engine, stepped a few steps at a time.
class StepRunner {
 public:
  StepRunner(const ModelSpec& spec, const EngineConfig& cfg, std::unique_ptr<Device> dev)
      : vocab_(spec.dims.vocab), engine_(spec, cfg, std::move(dev)), ids_(size_t(cfg.batch() * cfg.seq)),
        labels_(ids_.size()) {
    if (!engine_.simulated()) engine_.init_params(1);
  }
  void steps(int n, bool timed) {
    for (int s = 0; s < n; ++s) {
      for (auto& x : ids_) x = int64_t(rng_() % uint32_t(vocab_));
      labels_ = ids_;
      StepReport r = engine_.step(ids_.data(), labels_.data());
      if (!timed) continue;
      fig_.times.push_back(r.step_s);
      for (int l = 0; l < kNumLanes; ++l) fig_.busy_s[size_t(l)] += r.stats.lanes[size_t(l)].busy_s;
    }
  }
  const StepFigures& figures() const { return fig_; }

 private:
  int64_t vocab_;
  Engine engine_;
  std::mt19937 rng_{3};
  std::vector<int64_t> ids_, labels_;
  StepFigures fig_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_calibrate: the simulator, fed with this device's isolated costs, against the device's "
               "measured step time"};
  std::string device = "cpu";
  int64_t seq = 128, micro_batch = 4;
  std::vector<int64_t> accumulations = {2, 1, 4};
  int rounds = 8, steps = 2, warmup = 2, reps = 3, optimizer_threads = 0;
  app.add_option("--device", device, "cpu, cuda or cuda:N: the device measured and predicted")->capture_default_str();
  app.add_option("--seq", seq)->capture_default_str();
  app.add_option("--micro-batch", micro_batch)->capture_default_str();
  app.add_option("--accumulation", accumulations, "configurations (the first is the headline)")
      ->capture_default_str();
  app.add_option("--rounds", rounds,
                 "rounds of (isolated costs, then steps of each configuration): a machine shared with other "
                 "work slows both alike")
      ->capture_default_str();
  app.add_option("--steps", steps, "timed steps per configuration per round")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps per configuration first")->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions of each isolated op per round")->capture_default_str();
  app.add_option("--optimizer-threads", optimizer_threads, "CPU AdamW threads (0: all)")->capture_default_str();
  std::string estimator = "median";
  app.add_option("--estimator", estimator,
                 "median or min: one figure from the samples of an op or a step (min: the least disturbed by "
                 "other work on the machine, but an extreme value)")
      ->check(CLI::IsMember({"min", "median"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  g_use_min = estimator == "min";

  try {
    STRIDER_CHECK(device == "cpu" || device == "cuda" || device.rfind("cuda:", 0) == 0,
                  "--device {}: expected cpu, cuda or cuda:N", device);
    STRIDER_CHECK(rounds >= 1 && steps >= 1 && warmup >= 0 && reps >= 1 && !accumulations.empty(),
                  "--rounds {}, --steps {} and --reps {} must be >= 1, --warmup {} >= 0", rounds, steps, reps, warmup);
    const ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
    auto make_real = [&] {
      return make_device({.spec = device, .budget_bytes = kBudgetBytes, .record_spans = true});
    };
    auto iso = make_real();  // fails here, clearly, when the device is not there
    const std::string device_name = iso->name();
    fmt::print("bench_calibrate: {} on {}; seq {}, micro-batch {}, K = 2, checkpoints on host, clip 1.0; "
               "{} rounds of isolated costs and {} steps per configuration\n",
               spec.summary(), device_name, seq, micro_batch, rounds, steps);

    // 1. The op mix of every configuration.
    std::vector<EngineConfig> cfgs;
    std::vector<OpMix> mixes;
    for (int64_t acc : accumulations) {
      cfgs.push_back(offloaded_config(seq, micro_batch, acc, optimizer_threads));
      mixes.push_back(op_mix(spec, cfgs.back()));
    }
    // 2 and 3, interleaved: each op kind alone on its own device instance, then
    // a few real steps of each configuration, round after round.
    std::vector<std::unique_ptr<StepRunner>> real;
    for (const EngineConfig& c : cfgs) {
      real.push_back(std::make_unique<StepRunner>(spec, c, make_real()));
      real.back()->steps(warmup, /*timed=*/false);
    }
    Measured measured;
    for (int r = 0; r < rounds; ++r) {
      for (const OpMix& mix : mixes) {
        measure_compute(*iso, spec, cfgs[0], mix, reps, measured);
        measure_copies(*iso, mix, reps, measured);
        measure_adam(mix, optimizer_threads, reps, measured);
      }
      for (auto& run : real) run->steps(steps, /*timed=*/true);
    }
    iso.reset();

    nlohmann::json fits;
    const CostModel cm = calibrated_model(mixes[0], measured, device.substr(0, 4), fits);
    fmt::print("isolated costs on {} ({} of the samples; x per step of accumulation {}):\n", device_name, estimator,
               accumulations[0]);
    for (const auto& [key, use] : mixes[0]) {
      if (key.lane == Lane::kOptimizer || !measured.op_us.count(measured.shape_of.count(key) ? measured.shape_of.at(key) : key))
        continue;
      const double us = measured.op(key);
      if (key.lane == Lane::kCompute)
        fmt::print("  {:>8} {:<20} block {:>2}: {:9.1f} us ({:.3g} GFLOP, {:.3g} GFLOP/s) x{}\n",
                   lane_name(key.lane), key.name, key.block, us, use.flops * 1e-9,
                   use.flops > 0 ? use.flops / us * 1e-3 : 0.0, use.count);
      else
        fmt::print("  {:>8} {:<20} {:>8} B: {:9.1f} us ({:.2f} GB/s) x{}\n", lane_name(key.lane), key.name,
                   key.bytes, us, double(key.bytes) / us * 1e-3, use.count);
    }
    for (const auto& [n, us] : measured.adam_us)
      fmt::print("  optimizer adamw {:>8} params: {:9.1f} us ({:.3g} params/s)\n", n, estimate(us),
                 double(n) / estimate(us) * 1e6);
    fmt::print("{}\n", cm.describe());

    nlohmann::json configs = nlohmann::json::array();
    for (size_t i = 0; i < cfgs.size(); ++i) {
      const StepFigures& m = real[i]->figures();
      StepRunner sim_run(spec, cfgs[i],
                         std::make_unique<SimDevice>(cm, DeviceOptions{.budget_bytes = kBudgetBytes, .record_spans = true}));
      sim_run.steps(2, false);  // the pipeline fills
      sim_run.steps(2, true);
      const StepFigures& p = sim_run.figures();
      const double ratio = p.step_s() / m.step_s();
      const auto [lo, hi] = std::minmax_element(m.times.begin(), m.times.end());
      fmt::print("accumulation {} (batch {}): measured {:.4f} s/step ({} of {}: min {:.4f}, median {:.4f}, max {:.4f}), "
                 "predicted {:.4f} s/step, predicted/measured {:.3f}{}\n",
                 accumulations[i], cfgs[i].batch(), m.step_s(), estimator, m.times.size(), *lo, median(m.times), *hi,
                 p.step_s(), ratio,
                 std::abs(ratio - 1) <= 0.15 ? " (within 15%)" : " (NOT within 15%)");
      nlohmann::json lanes;
      for (int l = 0; l < kNumLanes; ++l) {
        const double mb = m.busy(l), pb = p.busy(l);
        if (mb == 0 && pb == 0) continue;
        fmt::print("  {:>10}: busy measured {:.4f} s, predicted {:.4f} s{}\n", lane_name(Lane(l)), mb, pb,
                   mb > 0 ? fmt::format(", predicted/measured {:.3f}", pb / mb) : "");
        lanes[std::string(lane_name(Lane(l)))] = {{"measured_s", mb}, {"predicted_s", pb}};
      }
      configs.push_back({{"accumulation", accumulations[i]}, {"measured_step_s", m.step_s()},
                         {"predicted_step_s", p.step_s()}, {"ratio", ratio}, {"lanes", lanes}});
    }
    nlohmann::json out = {{"bench", "calibrate"},
                          {"device", device},
                          {"device_name", device_name},
                          {"estimator", estimator},
                          {"measured_step_s", configs[0]["measured_step_s"]},
                          {"predicted_step_s", configs[0]["predicted_step_s"]},
                          {"ratio", configs[0]["ratio"]},
                          {"cost_model", fits},
                          {"configs", configs}};
    fmt::print("{}\n", out.dump());
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_calibrate: {}\n", e.what());
    return 2;
  }
}
