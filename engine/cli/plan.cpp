// strider plan: what fits, where, and why, before anything runs.
#include <filesystem>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/builtin.h"
#include "engine/cli/cli.h"
#include "engine/plan.h"

namespace strider::cli {
namespace {

struct Options {
  std::string model = "builtin", gpu = "24GiB", ram = "0", nvme, dtype = "bf16";
  int64_t seq = 1024, micro_batch = 1, accumulation = 1, window = 0;
  bool json = false;
};

int run(const Options& o) {
  ModelSpec spec = o.model == "builtin" ? ModelSpec::from_json(builtin_model_config(), "built-in model")
                                        : ModelSpec::from_file(o.model);
  PlanLimits l;
  l.device_bytes = parse_bytes(o.gpu);
  l.host_bytes = parse_bytes(o.ram);
  l.nvme_dir = o.nvme;
  l.seq = o.seq;
  l.micro_batch = o.micro_batch;
  l.accumulation = o.accumulation;
  l.window = o.window;
  l.dtype = o.dtype == "fp32" ? at::kFloat : at::kBFloat16;
  Plan p = Plan::make(spec, l);
  if (o.json) {
    fmt::print("{}\n", p.to_json().dump());
  } else {
    fmt::print("{}\n{}", spec.summary(), p.explain());
    if (!p.feasible) fmt::print("\n");
  }
  return p.feasible ? 0 : 1;
}

}  // namespace

std::function<int()> add_plan(CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* c = app.add_subcommand("plan", "print the plan for a model and a machine, without running");
  c->add_option("--model", o->model, "config.json, a checkpoint directory, or 'builtin'")->capture_default_str();
  c->add_option("--gpu", o->gpu, "device memory (e.g. 24GiB)")->capture_default_str();
  c->add_option("--ram", o->ram, "pinned host RAM limit (0: none)")->capture_default_str();
  c->add_option("--nvme", o->nvme, "NVMe directory for optimizer state");
  c->add_option("--seq", o->seq, "sequence length")->capture_default_str();
  c->add_option("--micro-batch", o->micro_batch, "sequences per micro-batch")->capture_default_str();
  c->add_option("--accumulation", o->accumulation, "micro-batches per step")->capture_default_str();
  c->add_option("--window", o->window, "cache units K (0: choose)")->capture_default_str();
  c->add_option("--dtype", o->dtype, "bf16 or fp32")->capture_default_str();
  c->add_flag("--json", o->json, "one JSON object");
  return [o] { return run(*o); };
}

}  // namespace strider::cli
