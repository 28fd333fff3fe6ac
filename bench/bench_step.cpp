// bench_step: the built-in model on the CPU device, the offloaded step (K = 2
// cache units, checkpoints on the host) against the same model fully resident
// (K = all blocks, checkpoints on the device) in the same run, alternating
// configurations every two steps so machine noise hits both alike. Prints each lane's busy
// fraction and the overlap efficiency (busiest lane / step time); the last
// line is one JSON object. A benchmark, not a test: it never fails on speed.
//
// A diagnostic of the sliding window's own cost, not a comparison with a
// peer: both sides are strider, with the same schedule, copies and
// activation choice, so its ratio cannot show what strider costs against
// plain PyTorch. bench/bench_vs_torch.py measures that.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <random>

#include "engine/model/builtin.h"
#include "engine/run/engine.h"

using namespace strider;

namespace {

struct Run {
  std::vector<double> step_s;
  StepStats last;
};

std::unique_ptr<Engine> make_engine(const ModelSpec& spec, EngineConfig cfg, int64_t window, bool host_ckpt) {
  cfg.window = window;
  cfg.checkpoints_on_host = host_ckpt;
  auto e = std::make_unique<Engine>(spec, cfg, make_device({.spec = "cpu", .budget_bytes = 1ull << 30,
                                                            .record_spans = true}));
  e->init_params(1);
  return e;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_step: strider offloaded (K=2) vs strider with every block resident, CPU device (a "
               "diagnostic of the window's cost; bench/bench_vs_torch.py compares with plain PyTorch)"};
  int steps = 8, warmup = 2;
  int64_t seq = 128, micro_batch = 4, accumulation = 2;
  app.add_option("--steps", steps, "timed steps per configuration");
  app.add_option("--warmup", warmup, "untimed steps first");
  app.add_option("--seq", seq);
  app.add_option("--micro-batch", micro_batch);
  app.add_option("--accumulation", accumulation);
  CLI11_PARSE(app, argc, argv);

  ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  EngineConfig cfg;
  cfg.seq = seq;
  cfg.micro_batch = micro_batch;
  cfg.accumulation = accumulation;
  cfg.clip_norm = 1.0;
  auto offload = make_engine(spec, cfg, 2, true);
  auto resident = make_engine(spec, cfg, spec.num_blocks(), false);

  std::mt19937 rng(3);
  std::vector<int64_t> ids(size_t(cfg.batch() * seq)), labels(ids.size());
  Run off, res;
  // Rounds of two consecutive steps per engine, alternating engines: the noise
  // of the machine hits both alike, and each engine's second step has its own
  // previous updates inside its window (an update overlaps the next forward).
  for (int s = 0; s < warmup + steps; s += 2) {
    for (auto [e, r] : {std::pair{offload.get(), &off}, std::pair{resident.get(), &res}}) {
      for (int k = 0; k < 2; ++k) {
        for (auto& x : ids) x = int64_t(rng() % uint32_t(spec.dims.vocab));
        labels = ids;
        StepReport rep = e->step(ids.data(), labels.data());
        if (s >= warmup) {
          r->step_s.push_back(rep.step_s);
          if (k == 1) r->last = rep.stats;
        }
      }
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double t_off = median(off.step_s), t_res = median(res.step_s);
  fmt::print("bench_step: {}; seq {}, batch {} ({} x {}); {} timed steps each\n", spec.summary(), seq,
             cfg.batch(), micro_batch, accumulation, steps);
  fmt::print("  resident (K={}): {:.3f} s/step   offloaded (K=2, host checkpoints): {:.3f} s/step   ratio {:.3f}\n",
             spec.num_blocks(), t_res, t_off, t_off / t_res);
  nlohmann::json lanes;
  for (int l = 0; l < kNumLanes; ++l) {
    const double f = off.last.lanes[size_t(l)].busy_fraction;
    lanes[std::string(lane_name(Lane(l)))] = f;
    fmt::print("  {:>10}: busy {:.3f} of the offloaded step\n", lane_name(Lane(l)), f);
  }
  fmt::print("  overlap efficiency {:.3f} (critical lane: {})\n", off.last.overlap_efficiency,
             lane_name(off.last.critical));
  nlohmann::json out = {{"bench", "step"}, {"offload_over_resident", t_off / t_res},
                        {"overlap_efficiency", off.last.overlap_efficiency}, {"offloaded_step_s", t_off},
                        {"resident_step_s", t_res}, {"lanes", lanes},
                        {"critical_lane", std::string(lane_name(off.last.critical))}};
  fmt::print("{}\n", out.dump());
  return 0;
}
