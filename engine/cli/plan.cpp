// strider plan: what fits, where, and why, before anything runs; with
// --predict, the predicted step time on a machine described by a cost model,
// from the unchanged engine schedule running on a SimDevice.
#include <algorithm>
#include <filesystem>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <limits>
#include <optional>
#include <nlohmann/json.hpp>

#include "engine/cli/cli.h"
#include "engine/cli/training_run.h"
#include "engine/model/hf_folder.h"
#include "engine/model/model_presets.h"
#include "engine/plan/plan.h"
#include "engine/program/step_program.h"
#include "engine/run/engine.h"
#include "host/error.h"

namespace strider::cli {
namespace {

struct Options {
  std::string model = "builtin", gpu = "24GiB", ram = "0", predict = "rtx4090";
  int64_t gpus = 1;
  std::string link = "pcie4";
  int64_t steps = 3;
  bool json = false;
  bool schedule = false;
  std::string trace;  // the predicted steps' Chrome trace
  bool packed_documents = false;
  bool keep_reference = false;  // the starting weights' copy, priced in host RAM
  // From the configuration's declaration (engine/config/config_fields.json).
  std::string nvme, dtype, matmul_accumulate, activations, optimizer_state, layer_pieces, devices, lora, base_format = "compute";
  int64_t seq = 0, micro_batch = 0, accumulation = 0, window = 0, vocab_shard_rows = 0, expert_pieces = 0, mlp_pieces = 0;
  double clip = 0;
  // An objective past SFT (docs/objectives.md): its buffers are in the plan's memory.
  std::string objective, loss_type;
  double beta = 0, label_smoothing = 0, simpo_gamma = 0, epsilon = 0, epsilon_high = 0;
  int64_t max_completion_length = 0;
  ConfigOptions config;
  CLI::Option* gpu_option = nullptr;  // --gpu: given, or the preset's memory
};

// A file or directory, a preset, or a Hub id in the local Hugging Face cache.
ModelSpec load_spec(const std::string& model) {
  if (std::filesystem::exists(model)) return ModelSpec::from_file(model);
  const std::vector<std::string> presets = model_preset_names();
  if (model.find('/') == std::string::npos || std::find(presets.begin(), presets.end(), model) != presets.end())
    return ModelSpec::from_json(model_preset(model), model);
  return ModelSpec::from_file(resolve_model_path(model));
}

struct Prediction {
  StepReport step;
  double lower_bound_s = 0;  // the busiest lane's own work: no schedule beats it
  // A forward pass alone over a batch (DPO's reference scoring, a GRPO
  // reference pass): where the objective or keep_reference runs one, else 0.
  double forward_s = 0;
};

// Whether the run scores batches by forward passes beside its steps: DPO's
// reference before the first step, or a kept reference copy streamed.
bool scores_forward(const EngineConfig& c) { return c.objective.objective == "dpo" || c.keep_reference; }

// --gpus N --link L: N data-parallel ranks, one GPU each, joined by L.
//   pcie3, pcie4, pcie5: one machine, each GPU on its own x16 link of that
//     generation; the ranks share the host: its memory (one compute copy; each
//     GPU's copies get at most its share of the memory bandwidth, both ways),
//     and their collectives go through it (collective_gbps as the cost model
//     says: an assumption until measured).
//   eth10, eth25, eth100, eth200: one GPU per machine (PCIe as --predict
//     says), the machines on Ethernet of that many Gbit/s, ~90% of it moving
//     data.
struct Link {
  const char* name;
  double pcie_gbps;      // per GPU and direction (0: the preset's)
  double ethernet_gbit;  // 0: one machine
};
constexpr Link kLinks[] = {{"pcie3", 12, 0},  {"pcie4", 25, 0},  {"pcie5", 50, 0},   {"eth10", 0, 10},
                           {"eth25", 0, 25},  {"eth100", 0, 100}, {"eth200", 0, 200}};

const Link& find_link(const std::string& name) {
  for (const Link& l : kLinks)
    if (name == l.name) return l;
  throw Error(fmt::format("--link {}: expected pcie3, pcie4, pcie5 (GPUs in one machine) or eth10, eth25, eth100, "
                          "eth200 (one GPU per machine, Ethernet between them)", name));
}

// The cost model one rank runs on: the preset with the link's rates.
std::string rank_machine(const Options& o) {
  std::string dev = o.predict.rfind("sim:", 0) == 0 ? o.predict.substr(4) : o.predict;
  if (o.gpus <= 1) return dev;
  const Link& link = find_link(o.link);
  if (link.ethernet_gbit > 0)
    return fmt::format("{},collective_gbps={}", dev, link.ethernet_gbit / 8 * 0.9);
  return fmt::format("{},h2d_gbps={},d2h_gbps={}", dev, link.pcie_gbps, link.pcie_gbps);
}

// `trace`: write the predicted steps' Chrome trace to --trace.
Prediction predict(const ModelSpec& spec, const Plan& plan, const PlanLimits& l, const Options& o, bool trace) {
  EngineConfig cfg = plan.engine_config(l);
  const std::string dev = "sim:" + rank_machine(o);
  // A pool: N SimDevices, each on its own link, sharing the host's memory bus.
  std::vector<std::unique_ptr<Device>> devices =
      make_devices({.spec = dev, .budget_bytes = l.device_bytes, .record_spans = true}, std::to_string(l.devices));
  // Ranks on one machine share its memory bus too. They run the same
  // schedule side by side, so each rank has 1/N of it, over time: its
  // devices' copies and its optimizer's bytes (its slice of the state) take
  // that share's free time, as a pool's take the whole bus's.
  if (o.gpus > 1 && find_link(o.link).ethernet_gbit == 0) {
    const double gbps = static_cast<SimDevice&>(*devices.front()).model().host_memory_gbps() / double(o.gpus);
    auto bus = std::make_shared<SimHostMemory>(gbps);
    for (auto& d : devices) static_cast<SimDevice&>(*d).share_host_memory(bus);
  }
  Engine e(spec, cfg, std::move(devices));
  std::vector<int64_t> ids(size_t(cfg.batch() * cfg.seq), 0), labels(ids.size(), 0);
  // An objective's per-row and per-token inputs, zeros: the prices do not depend on them.
  const ObjectiveSettings obj = cfg.objective.resolve();
  std::vector<float> rows(size_t(cfg.batch()), 0.0f), tokens(ids.size(), 0.0f);
  const ObjectiveInputs inputs{.rows = cfg.batch(),
                               .row = obj.takes_rows() ? rows.data() : nullptr,
                               .ref_logps = obj.takes_reference_tokens() ? tokens.data() : nullptr};
  Prediction p;
  // Before any step, so that no update is pending: the pass alone.
  if (scores_forward(cfg)) p.forward_s = e.priced_forward_pass(cfg.keep_reference);
  // The first steps fill the pipeline (no update to wait for yet); report the last.
  for (int64_t i = 0; i < std::max<int64_t>(o.steps, 2); ++i)
    p.step = e.step(ids.data(), labels.data(), nullptr, nullptr, obj.sft() ? nullptr : &inputs);
  if (trace && !o.trace.empty()) e.timeline().write_chrome_trace(o.trace);
  for (const LaneStats& ls : p.step.stats.lanes) p.lower_bound_s = std::max(p.lower_bound_s, ls.busy_s);
  return p;
}

// The predicted forward pass's line: what runs it, and what it costs per
// the unit a user counts (DPO: pairs, a step's rows being N chosen then N
// rejected; a GRPO reference pass: per step).
std::string forward_pass_text(const PlanLimits& l, const nlohmann::json& out) {
  const double fwd = out["forward_pass_s"].get<double>(), step = out["step_s"].get<double>();
  const int64_t rows = l.micro_batch * l.accumulation;
  if (l.objective.objective == "dpo")
    return fmt::format("  reference pass (dpo): {:.3f} s per batch of {} sequences ({} pairs, {:.0f}% of a step), "
                       "~{:.0f} s per 1000 pairs: `strider finetune --objective dpo` scores every pair of its data "
                       "(and --eval-data) so before the first step",
                       fwd, rows, rows / 2, 100.0 * fwd / step, fwd * 2000.0 / double(rows));
  return fmt::format("  reference pass (keep_reference): {:.3f} s per batch of {} sequences streaming the starting "
                     "weights (Engine.logprobs(..., reference=True)); with one a step, ~{:.3f} s and {:.0f} "
                     "tokens/s (a logprobs pass of the current weights, for off-policy old_logps, costs the same)",
                     fwd, rows, step + fwd, double(rows * l.seq) / (step + fwd));
}

// The plan's answer in one line, first: fits or not; predicted speed; GPU,
// RAM and NVMe use against their limits (and, for NVMe, the free space of
// --nvme where that directory is on this machine).
std::string answer_line(const Plan& p, const PlanLimits& l, const nlohmann::json& out, const Options& o) {
  if (!p.feasible) return "does not fit: " + p.reason;
  std::string speed = "no prediction (--predict none)";
  if (out.contains("step_s") && !out["step_s"].is_null()) {
    speed = fmt::format("{:.0f} tokens/s, {:.3f} s/step predicted on {}{}", out["tokens_per_s"].get<double>(),
                        out["step_s"].get<double>(), o.predict,
                        (l.devices > 1 ? fmt::format(" x {} devices in one process", l.devices) : std::string()) +
                            (o.gpus > 1 ? fmt::format(" x {} GPUs", o.gpus) : std::string()));
    if (out["critical_lane"] == "optimizer") speed += ", bound by the host optimizer";
    if (out.contains("accumulation_advice")) {
      const nlohmann::json& a = out["accumulation_advice"];
      if (a["accumulation"].get<int64_t>() != l.accumulation)
        speed += fmt::format(" (--accumulation {}: {:.0f} tokens/s, {:.0f}% of the best of 1 to {})",
                             a["accumulation"].get<int64_t>(), a["tokens_per_s"].get<double>(),
                             100.0 * a["tokens_per_s"].get<double>() / a["best_tokens_per_s"].get<double>(),
                             kMaxAdvisedAccumulation);
    }
  }
  std::string nvme = "NVMe: none";
  if (p.nvme_bytes > 0) {
    nvme = fmt::format("NVMe {}", format_bytes(p.nvme_bytes));
    if (!out["nvme_free_bytes"].is_null())
      nvme += fmt::format(" of {} free under {}", format_bytes(out["nvme_free_bytes"].get<uint64_t>()), o.nvme);
    else if (!o.nvme.empty())
      nvme += fmt::format(" under {}, which is not a folder here: its free space is not checked", o.nvme);
  }
  return fmt::format("fits: {}; GPU {} of {}{}; RAM {}{}; {}", speed, format_bytes(p.device_peak_bytes),
                     format_bytes(l.device_bytes), l.devices > 1 ? fmt::format(" on each of {} devices", l.devices) : "",
                     format_bytes(p.host_peak_bytes),
                     l.host_bytes == 0 ? std::string(" (no --ram limit)")
                                       : fmt::format(" of {} (--ram less {}% for the OS)", format_bytes(l.host_bytes),
                                                     kOsRamPercent),
                     nvme);
}

int run(Options& o) {
  const PlacementMemo memo;  // the plan, its advice and its predictions place one model many times
  const ModelSpec spec = load_spec(o.model).with_lora(o.lora, "--lora");  // what the engine trains (as Plan::make)
  // The built-in model trains from scratch: the demo's shapes (a plan is for a GPU).
  const std::string demo = o.model == "builtin" ? o.config.apply_demo(true) : std::string();
  PlanLimits l;
  base_format_option(o.base_format, o.lora);  // a base format without --lora: refused naming the flags
  l.take_settings(o.config.engine_settings());
  l.devices = int(pool_specs("cpu", o.devices).size());
  l.activations = parse_activation_mode(o.activations);
  // --gpu left unset with a preset to predict on: that GPU's memory.
  l.device_bytes = o.gpu_option->count() == 0 && !o.predict.empty() && o.predict != "none"
                       ? CostModel::parse(rank_machine(o)).device_memory_bytes
                       : parse_bytes(o.gpu);
  const uint64_t ram = parse_bytes(o.ram);
  l.host_bytes = ram - os_ram_headroom_bytes(ram);
  l.nvme_dir = o.nvme;
  // host_peak_bytes counts this binary's own footprint (no run allocated yet)
  // and, for a checkpoint on disk, the load's staging; the GPU's memory is its own.
  l.process_bytes = process_rss_bytes();
  l.loads_checkpoint = std::filesystem::exists(o.model);
  const bool predicting = !o.predict.empty() && o.predict != "none";
  // Data parallel: every rank plans its slice of the state; on one machine
  // --ram is the machine's, less the compute copy its ranks share.
  const bool one_machine = o.gpus > 1 && find_link(o.link).ethernet_gbit == 0;
  uint64_t shared = 0;
  if (o.gpus > 1) {
    l.state_shards = int(o.gpus);
    l.shared_compute = one_machine;
    if (one_machine) {
      shared = shared_compute_bytes(spec, l.dtype);
      STRIDER_CHECK(l.host_bytes == 0 || shared < l.host_bytes,
                    "--ram {}: the model's compute copy alone, shared by the machine's {} ranks, is {}", o.ram, o.gpus,
                    format_bytes(shared));
      if (l.host_bytes > 0) l.host_bytes = (l.host_bytes - shared) / uint64_t(o.gpus);
    }
  }
  // --activations auto prices recompute against the link on the machine
  // predicted for (the rtx4090's rates without one).
  if (predicting) l.set_machine_rates(CostModel::parse(rank_machine(o)));
  // Ranks on one machine: each has 1/N of its memory bus (as predict() gives it).
  if (o.gpus > 1 && find_link(o.link).ethernet_gbit == 0) l.host_memory_bytes_per_s /= double(o.gpus);
  Plan p = Plan::make(spec, l);
  // A mixture of experts: its expert pieces by the predicted speed.
  if (predicting)
    p = fastest_expert_pieces(spec, l, std::move(p), [&](const Plan& q, const PlanLimits& ql) {
      return predict(spec, q, ql, o, false).step.tokens_per_s;
    });
  // An NVMe folder too small for what the plan puts there: strider finetune
  // would refuse, and so does the plan (its JSON as its first line).
  // A folder that does not exist here is another machine's (a plan made
  // ahead): its space is not checked, and the answer says so.
  std::optional<uint64_t> nvme_free;
  if (std::error_code ec; !o.nvme.empty() && std::filesystem::is_directory(o.nvme, ec)) {
    const auto room = std::filesystem::space(o.nvme, ec);
    if (!ec) nvme_free = room.available;
  }
  if (p.feasible && p.nvme_bytes > 0 && nvme_free && *nvme_free < p.nvme_bytes) {
    p.feasible = false;
    p.reason = fmt::format("the plan puts {} of optimizer state under --nvme {}, which has {} free; free space "
                           "there, or name a larger folder",
                           format_bytes(p.nvme_bytes), o.nvme, format_bytes(*nvme_free));
  }
  // What the plan advises: the accumulation worth running at, or what would make a refused plan fit.
  const PlanSpeed speed = !predicting ? PlanSpeed() : PlanSpeed([&](const Plan& q, const PlanLimits& ql) {
    // An option of LoRA over the model trains another model than the one asked about.
    const ModelSpec trained = ql.lora == l.lora ? spec : load_spec(o.model).with_lora(ql.lora, "--lora");
    return predict(trained, q, ql, o, false).step.tokens_per_s * double(o.gpus);
  });
  const std::optional<AccumulationAdvice> advice = p.feasible ? advise_accumulation(spec, l, speed) : std::nullopt;
  const std::vector<FitOption> fits_with = p.feasible ? std::vector<FitOption>{} : fitting_options(spec, l, speed, nvme_free);
  nlohmann::json out = p.to_json();
  out["nvme_free_bytes"] = nvme_free ? nlohmann::json(*nvme_free) : nlohmann::json();
  if (advice) {
    nlohmann::json trials = nlohmann::json::array();
    for (const auto& [acc, tps] : advice->trials) trials.push_back({{"accumulation", acc}, {"tokens_per_s", tps}});
    out["accumulation_advice"] = {{"accumulation", advice->accumulation}, {"tokens_per_s", advice->tokens_per_s},
                                  {"best_accumulation", advice->best_accumulation},
                                  {"best_tokens_per_s", advice->best_tokens_per_s}, {"trials", trials}};
  }
  if (!p.feasible) {
    out["fits_with"] = nlohmann::json::array();
    for (const FitOption& f : fits_with)
      out["fits_with"].push_back({{"change", f.change}, {"host_peak_bytes", f.host_peak_bytes},
                                  {"nvme_bytes", f.nvme_bytes},
                                  {"tokens_per_s", f.tokens_per_s > 0 ? nlohmann::json(f.tokens_per_s) : nlohmann::json()}});
  }
  out["model"] = spec.summary();
  out["seq"] = l.seq;
  out["micro_batch"] = l.micro_batch;
  out["accumulation"] = l.accumulation;
  if (!demo.empty()) out["demo_settings"] = demo;
  if (o.gpus > 1) {
    const EngineFootprint f = footprint(spec, p.engine_config(l));
    out["gpus"] = o.gpus;
    out["link"] = o.link;
    out["shared_host_bytes"] = shared;
    // What the machine holds: one machine's N ranks and their shared compute
    // copy, or (Ethernet) one rank's machine.
    out["machine_host_bytes"] = one_machine ? uint64_t(o.gpus) * p.host_peak_bytes + shared : p.host_peak_bytes;
    out["rank_optimizer_host_bytes"] = f.optimizer_host_bytes;
  }
  if (l.devices > 1) out["devices"] = l.devices;
  if (predicting && p.feasible) {
    Prediction pr = predict(spec, p, l, o, true);
    const StepReport& r = pr.step;
    out["step_s"] = r.step_s;
    out["lower_bound_s"] = pr.lower_bound_s;
    out["tokens_per_s"] = r.tokens_per_s;
    out["overlap_efficiency"] = r.stats.overlap_efficiency;
    out["critical_lane"] = std::string(lane_name(r.stats.critical));
    for (int i = 0; i < kNumLanes; ++i)
      out["lane_busy_s"][std::string(lane_name(Lane(i)))] = r.stats.lanes[size_t(i)].busy_s;
    out["machine"] = o.predict;
    if (pr.forward_s > 0) out["forward_pass_s"] = pr.forward_s;
    if (!o.trace.empty()) out["trace"] = o.trace;
    if (o.gpus > 1) {
      out["machine"] = rank_machine(o);
      out["rank_tokens_per_s"] = r.tokens_per_s;
      out["tokens_per_s"] = r.tokens_per_s * double(o.gpus);  // N ranks, each on its own batch
    }
  } else if (predicting) {
    out["step_s"] = out["lower_bound_s"] = out["tokens_per_s"] = nullptr;
  }
  // The program a training step runs (one rank's, with data parallel).
  std::string schedule;
  if (o.schedule && p.feasible) {
    const EngineConfig cfg = p.engine_config(l);
    const Placement pl = place(spec, cfg);
    const StepProgram prog = compile_step(pl, program_inputs(cfg, int(o.gpus)));
    out["schedule"] = to_json(prog, spec, pl);
    schedule = describe(prog, spec, pl);
  }
  out["host_ram_bytes"] = ram;  // --ram, the machine's
  out["os_headroom_bytes"] = os_ram_headroom_bytes(ram);
  out["answer"] = answer_line(p, l, out, o);
  if (o.json) {
    fmt::print("{}\n", out.dump());
  } else {
    std::string options;
    for (const FitOption& f : fits_with) options += "  " + fit_option_text(f) + "\n";
    if (!p.feasible && fits_with.empty()) options = "  no single change of --optimizer-state, --nvme, --lora, "
                                                    "--base-format, --accumulation or --micro-batch makes it fit\n";
    fmt::print("{}\n{}{}\n{}{}{}", answer_line(p, l, out, o), options, spec.summary(),
               demo.empty() ? "" : "  " + demo + "\n", ram == 0 ? "" : "  RAM: " + ram_headroom_text("--ram", ram) + "\n",
               p.explain());
    if (o.gpus > 1)
      fmt::print("  data parallel: {} GPUs on {} ({}): each rank plans the above with 1/{} of master, m and v; {}\n",
                 o.gpus, o.link, one_machine ? "one machine" : "a machine each", o.gpus,
                 one_machine ? fmt::format("the machine holds ~{} ({} ranks ~{} each + their shared compute copy {})",
                                           format_bytes(out["machine_host_bytes"].get<uint64_t>()), o.gpus,
                                           format_bytes(p.host_peak_bytes), format_bytes(shared))
                             : fmt::format("each machine holds ~{}", format_bytes(p.host_peak_bytes)));
    if (out.contains("step_s") && !out["step_s"].is_null()) {
      fmt::print("  predicted on {}: {:.3f} s/step, {:.0f} tokens/s (batch {} x seq {}{}); lower bound {:.3f} s "
                 "(the busiest lane alone); overlap efficiency {:.2f}, critical lane {}\n",
                 out["machine"].get<std::string>(), out["step_s"].get<double>(), out["tokens_per_s"].get<double>(),
                 l.micro_batch * l.accumulation, l.seq, o.gpus > 1 ? fmt::format(" on each of {} ranks", o.gpus) : "",
                 out["lower_bound_s"].get<double>(), out["overlap_efficiency"].get<double>(),
                 out["critical_lane"].get<std::string>());
      for (const auto& [lane, busy] : out["lane_busy_s"].items())
        fmt::print("    {:>10}: {:.3f} s ({:.0f}% of the step)\n", lane, busy.get<double>(),
                   100.0 * busy.get<double>() / out["step_s"].get<double>());
      if (out.contains("forward_pass_s")) fmt::print("{}\n", forward_pass_text(l, out));
    }
    if (!schedule.empty())
      fmt::print("\nOne training step's program ({} operations: index, lane, operation, what, what it waits "
                 "for){}:\n{}",
                 out["schedule"].size(), o.gpus > 1 ? " of rank 0" : "", schedule);
  }
  return p.feasible ? 0 : 1;
}

}  // namespace

std::function<int()> add_plan(CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* c = app.add_subcommand("plan", "print the plan for a model and a machine, without running");
  c->add_option("--model", o->model,
                fmt::format("config.json, a checkpoint directory, a Hub id in the local Hugging Face cache, or a "
                            "preset: {}", fmt::join(model_preset_names(), ", ")))
      ->capture_default_str();
  o->gpu_option = c->add_option("--gpu", o->gpu,
                                "device memory (e.g. 24GiB); unset: the --predict preset's (its board less 0.5 GiB), "
                                "else 24GiB")
                      ->capture_default_str();
  c->add_option("--ram", o->ram,
                "the machine's host RAM (0: no limit): strider's whole process plans to hold at most this less 5% "
                "left to the OS")
      ->capture_default_str();
  ConfigOptions& f = o->config;
  f.add(*c, "nvme_dir", o->nvme);
  f.add(*c, "seq", o->seq);
  f.add(*c, "micro_batch", o->micro_batch);
  f.add(*c, "accumulation", o->accumulation);
  f.add(*c, "window", o->window);
  f.add(*c, "dtype", o->dtype);
  f.add(*c, "matmul_accumulate", o->matmul_accumulate);
  f.add(*c, "activations", o->activations);
  f.add(*c, "optimizer_state", o->optimizer_state);
  f.add(*c, "layer_pieces", o->layer_pieces);
  f.add(*c, "expert_pieces", o->expert_pieces);
  f.add(*c, "mlp_pieces", o->mlp_pieces);
  f.add(*c, "lora", o->lora);
  f.add(*c, "base_format", o->base_format);
  f.add(*c, "devices", o->devices);
  f.add(*c, "vocab_shard_rows", o->vocab_shard_rows);
  f.add(*c, "packed_documents", o->packed_documents,
        "rows pack several documents: each layer's attention takes a [micro-batch, seq, seq] mask (what "
        "`strider finetune` does for a token file whose documents start inside its --seq windows)");
  c->add_option("--predict", o->predict,
                "predict the step on a machine: a cost-model preset (rtx4090, h200) with optional "
                "key=value overrides, e.g. 'rtx4090,h2d_gbps=20'; 'none' to skip")
      ->capture_default_str();
  f.add(*c, "objective", o->objective);
  f.add(*c, "loss_type", o->loss_type);
  f.add(*c, "beta", o->beta);
  f.add(*c, "label_smoothing", o->label_smoothing);
  f.add(*c, "simpo_gamma", o->simpo_gamma);
  f.add(*c, "epsilon", o->epsilon);
  f.add(*c, "epsilon_high", o->epsilon_high);
  f.add(*c, "max_completion_length", o->max_completion_length);
  f.add(*c, "keep_reference", o->keep_reference,
        "full fine-tuning: price a frozen copy of the starting weights in RAM (strider.EngineConfig's "
        "keep_reference, the reference model of Engine.logprobs(..., reference=True) for GRPO's KL)");
  f.add(*c, "clip_norm", o->clip,
        "global-norm clip (0: off); with clipping, NVMe-tier gradients are spilled to NVMe until the norm is known");
  c->add_option("--gpus", o->gpus,
                "data-parallel ranks, one GPU each (each steps on its own batch of --micro-batch x --accumulation)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  c->add_option("--link", o->link,
                "with --gpus: pcie3, pcie4, pcie5 (the GPUs in one machine, each on its own x16 link) or eth10, eth25, "
                "eth100, eth200 (a GPU per machine, Ethernet between them)")
      ->capture_default_str();
  c->add_flag("--json", o->json, "one JSON object");
  c->add_option("--trace", o->trace,
                "with --predict: write the predicted steps' Chrome trace (Perfetto) here, a process per device");
  c->add_flag("--schedule", o->schedule,
              "print the step's program: every operation, its lane and what it waits for (with --json: \"schedule\")");
  return [o] { return run(*o); };
}

}  // namespace strider::cli
