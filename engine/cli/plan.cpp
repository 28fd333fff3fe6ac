// strider plan: what fits, where, and why, before anything runs; with
// --predict, the predicted step time on a machine described by a cost model,
// from the unchanged engine schedule running on a SimDevice.
#include <filesystem>
#include <fmt/format.h>
#include <limits>
#include <nlohmann/json.hpp>

#include "engine/cli/cli.h"
#include "engine/cli/training_run.h"
#include "engine/engine.h"
#include "engine/model_presets.h"
#include "engine/plan.h"

namespace strider::cli {
namespace {

struct Options {
  std::string model = "builtin", gpu = "24GiB", ram = "0", nvme, dtype = "bf16", predict = "rtx4090";
  std::string activations = "auto";
  std::string optimizer_state = "fp32";
  int64_t seq = 1024, micro_batch = 1, accumulation = 1, window = 0, steps = 3;
  double clip = 1.0;
  bool json = false;
};

ModelSpec load_spec(const std::string& model) {
  if (std::filesystem::exists(model)) return ModelSpec::from_file(model);
  return ModelSpec::from_json(model_preset(model), model);
}

struct Prediction {
  StepReport step;
  double lower_bound_s = 0;  // the busiest lane's own work: no schedule beats it
};

Prediction predict(const ModelSpec& spec, const Plan& plan, const PlanLimits& l, const Options& o) {
  EngineConfig cfg = plan.engine_config(l);
  const std::string dev = o.predict.rfind("sim:", 0) == 0 ? o.predict : "sim:" + o.predict;
  Engine e(spec, cfg, make_device({.spec = dev, .budget_bytes = l.device_bytes, .record_spans = true}));
  std::vector<int64_t> ids(size_t(cfg.batch() * cfg.seq), 0), labels(ids.size(), 0);
  Prediction p;
  // The first steps fill the pipeline (no update to wait for yet); report the last.
  for (int64_t i = 0; i < std::max<int64_t>(o.steps, 2); ++i) p.step = e.step(ids.data(), labels.data());
  for (const LaneStats& ls : p.step.stats.lanes) p.lower_bound_s = std::max(p.lower_bound_s, ls.busy_s);
  return p;
}

int run(const Options& o) {
  ModelSpec spec = load_spec(o.model);
  PlanLimits l;
  l.device_bytes = parse_bytes(o.gpu);
  l.host_bytes = parse_bytes(o.ram);
  l.nvme_dir = o.nvme;
  l.seq = o.seq;
  l.micro_batch = o.micro_batch;
  l.accumulation = o.accumulation;
  l.window = o.window;
  l.clip_norm = o.clip;
  l.dtype = o.dtype == "fp32" ? at::kFloat : at::kBFloat16;
  l.activations = parse_activation_mode(o.activations);
  l.optimizer_state = parse_state_format(o.optimizer_state);
  // host_peak_bytes counts this binary's own footprint (no run allocated yet)
  // and, for a checkpoint on disk, the load's staging; the GPU's memory is its own.
  l.process_bytes = process_rss_bytes();
  l.loads_checkpoint = std::filesystem::exists(o.model);
  const bool predicting = !o.predict.empty() && o.predict != "none";
  // --activations auto prices recompute against the link on the machine
  // predicted for (the rtx4090's rates without one).
  if (predicting)
    l.set_machine_rates(CostModel::parse(o.predict.rfind("sim:", 0) == 0 ? o.predict.substr(4) : o.predict));
  Plan p = Plan::make(spec, l);
  nlohmann::json out = p.to_json();
  out["model"] = spec.summary();
  if (predicting && p.feasible) {
    Prediction pr = predict(spec, p, l, o);
    const StepReport& r = pr.step;
    out["step_s"] = r.step_s;
    out["lower_bound_s"] = pr.lower_bound_s;
    out["tokens_per_s"] = r.tokens_per_s;
    out["overlap_efficiency"] = r.stats.overlap_efficiency;
    out["critical_lane"] = std::string(lane_name(r.stats.critical));
    for (int i = 0; i < kNumLanes; ++i)
      out["lane_busy_s"][std::string(lane_name(Lane(i)))] = r.stats.lanes[size_t(i)].busy_s;
    out["machine"] = o.predict;
  } else if (predicting) {
    out["step_s"] = out["lower_bound_s"] = out["tokens_per_s"] = nullptr;
  }
  if (o.json) {
    fmt::print("{}\n", out.dump());
  } else {
    fmt::print("{}\n{}", spec.summary(), p.explain());
    if (out.contains("step_s") && !out["step_s"].is_null()) {
      fmt::print("  predicted on {}: {:.3f} s/step, {:.0f} tokens/s (batch {} x seq {}); lower bound {:.3f} s "
                 "(the busiest lane alone); overlap efficiency {:.2f}, critical lane {}\n",
                 o.predict, out["step_s"].get<double>(), out["tokens_per_s"].get<double>(),
                 l.micro_batch * l.accumulation, l.seq, out["lower_bound_s"].get<double>(),
                 out["overlap_efficiency"].get<double>(), out["critical_lane"].get<std::string>());
      for (const auto& [lane, busy] : out["lane_busy_s"].items())
        fmt::print("    {:>10}: {:.3f} s ({:.0f}% of the step)\n", lane, busy.get<double>(),
                   100.0 * busy.get<double>() / out["step_s"].get<double>());
    }
  }
  return p.feasible ? 0 : 1;
}

}  // namespace

std::function<int()> add_plan(CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* c = app.add_subcommand("plan", "print the plan for a model and a machine, without running");
  c->add_option("--model", o->model,
                "config.json, a checkpoint directory, or a preset (builtin, llama-3.1-8b, llama-3.1-70b, "
                "qwen2.5-14b, qwen2.5-32b, qwen2.5-72b, mistral-large-123b)")
      ->capture_default_str();
  c->add_option("--gpu", o->gpu, "device memory (e.g. 24GiB)")->capture_default_str();
  c->add_option("--ram", o->ram, "host RAM the whole process may hold at its peak (0: none)")->capture_default_str();
  c->add_option("--nvme", o->nvme, "NVMe directory for optimizer state");
  add_shape_options(*c, o->seq, o->micro_batch, o->accumulation, o->window);
  c->add_option("--dtype", o->dtype, "bf16 or fp32")->capture_default_str()->check(CLI::IsMember({"bf16", "fp32"}));
  add_activations_option(*c, o->activations);
  add_optimizer_state_option(*c, o->optimizer_state);
  c->add_option("--predict", o->predict,
                "predict the step on a machine: a cost-model preset (rtx4090, h200) with optional "
                "key=value overrides, e.g. 'rtx4090,h2d_gbps=20'; 'none' to skip")
      ->capture_default_str();
  add_clip_option(*c, o->clip,
                  "global-norm clip (0: off); with clipping, NVMe-tier gradients are spilled to NVMe until the norm "
                  "is known");
  c->add_flag("--json", o->json, "one JSON object");
  return [o] { return run(*o); };
}

}  // namespace strider::cli
