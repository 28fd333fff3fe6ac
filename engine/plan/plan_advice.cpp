// What the plan advises beside its answer: the accumulation worth running at,
// and for a refused plan the options that would make it fit, each tried as a
// plan of its own (and predicted where a machine is given), so that advice is
// a figure the plan computed, never a rule of thumb.
#include <algorithm>

#include <fmt/format.h>

#include "engine/plan/plan.h"
#include "host/error.h"

namespace strider {

namespace {

// The plan the limits make, with a mixture of experts' pieces as strider plan
// chooses them where predictions are given.
Plan plan_of(const ModelSpec& spec, const PlanLimits& l, const PlanSpeed& tokens_per_s) {
  Plan p = Plan::make(spec, l);
  return tokens_per_s ? fastest_expert_pieces(spec, l, std::move(p), tokens_per_s) : p;
}

}  // namespace

std::optional<AccumulationAdvice> advise_accumulation(const ModelSpec& spec, const PlanLimits& l,
                                                      const PlanSpeed& tokens_per_s) {
  if (!tokens_per_s) return std::nullopt;
  AccumulationAdvice a;
  for (int64_t acc = 1; acc <= kMaxAdvisedAccumulation; acc *= 2) {
    PlanLimits trial = l;
    trial.accumulation = acc;
    double speed = 0;
    try {  // a batch the settings refuse (DPO's pairs need an even one) is no trial
      const Plan p = plan_of(spec, trial, tokens_per_s);
      if (!p.feasible) continue;
      speed = tokens_per_s(p, trial);
    } catch (const Error&) {
      continue;
    }
    a.trials.emplace_back(acc, speed);
    if (speed > a.best_tokens_per_s) {
      a.best_tokens_per_s = speed;
      a.best_accumulation = acc;
    }
  }
  if (a.trials.empty()) return std::nullopt;
  for (const auto& [acc, speed] : a.trials)
    if (speed >= kAdvisedShareOfBest * a.best_tokens_per_s) {
      a.accumulation = acc;
      a.tokens_per_s = speed;
      break;
    }
  return a;
}

std::vector<FitOption> fitting_options(const ModelSpec& spec, const PlanLimits& l, const PlanSpeed& tokens_per_s,
                                       std::optional<uint64_t> nvme_free_bytes) {
  // An NVMe folder the user has not named yet: the plan places state there as
  // it would, but nothing is predicted (the simulated run would create its files).
  constexpr const char* kSomeFolder = "/nonexistent/strider-plan-nvme";
  struct Change {
    std::string text;
    std::function<void(PlanLimits&)> apply;
    bool lora = false;  // the model becomes LoRA adapters over it
  };
  std::vector<Change> changes;
  const bool full = l.lora.empty();
  const std::string lora = "r=16,alpha=32,targets=all-linear";
  if (l.optimizer_state == StateFormat::kFp32)
    changes.push_back({"--optimizer-state q8", [](PlanLimits& x) { x.optimizer_state = StateFormat::kQ8; }});
  if (l.nvme_dir.empty()) changes.push_back({"--nvme DIR", [&](PlanLimits& x) { x.nvme_dir = kSomeFolder; }});
  if (full) changes.push_back({"--lora " + lora, [&](PlanLimits& x) { x.lora = lora; }, true});
  if (!full && l.base_format == BaseFormat::kCompute)
    for (BaseFormat f : {BaseFormat::kInt8, BaseFormat::kNf4})
      changes.push_back({fmt::format("--base-format {}", base_format_name(f)), [f](PlanLimits& x) { x.base_format = f; }});
  for (int64_t acc = l.accumulation / 2; acc >= 1; acc /= 2)
    changes.push_back({fmt::format("--accumulation {}", acc), [acc](PlanLimits& x) { x.accumulation = acc; }});
  for (int64_t mb = l.micro_batch / 2; mb >= 1; mb /= 2)
    changes.push_back({fmt::format("--micro-batch {}", mb), [mb](PlanLimits& x) { x.micro_batch = mb; }});

  std::vector<FitOption> out;
  const auto attempt = [&](const std::string& text, const std::function<void(PlanLimits&)>& apply, bool with_lora) {
    PlanLimits trial = l;
    apply(trial);
    Plan p;
    std::optional<ModelSpec> adapted;
    FitOption o{text, 0, 0, 0.0};
    try {  // a change the model or the settings refuse (LoRA on experts, a cut that splits q8's groups, an odd
           // batch of DPO pairs) is no option
      if (with_lora) adapted = spec.with_lora(trial.lora, "--lora");
      p = plan_of(adapted ? *adapted : spec, trial, trial.nvme_dir == kSomeFolder ? PlanSpeed() : tokens_per_s);
      if (!p.feasible) return false;
      if (trial.nvme_dir == l.nvme_dir && nvme_free_bytes && p.nvme_bytes > *nvme_free_bytes) return false;
      o.host_peak_bytes = p.host_peak_bytes;
      o.nvme_bytes = p.nvme_bytes;
      if (tokens_per_s && trial.nvme_dir != kSomeFolder) o.tokens_per_s = tokens_per_s(p, trial);
    } catch (const Error&) {
      return false;
    }
    out.push_back(std::move(o));
    return true;
  };
  bool accumulation = false, micro_batch = false;  // the largest of each that fits only
  bool q8 = false, nvme = false;
  for (const Change& c : changes) {
    bool* found = c.text.starts_with("--accumulation") ? &accumulation
                  : c.text.starts_with("--micro-batch") ? &micro_batch
                                                        : nullptr;
    if (found && *found) continue;
    const bool fit = attempt(c.text, c.apply, c.lora);
    if (found) *found = fit;
    if (c.text == "--optimizer-state q8") q8 = !fit;
    if (c.text == "--nvme DIR") nvme = !fit;
  }
  if (full && !std::any_of(out.begin(), out.end(), [](const FitOption& o) { return o.change.starts_with("--lora"); }))
    attempt("--lora " + lora + " --base-format nf4", [&](PlanLimits& x) {  // QLoRA, where LoRA alone does not fit
      x.lora = lora;
      x.base_format = BaseFormat::kNf4;
    }, true);
  if (q8 && nvme)  // neither alone: both
    attempt("--optimizer-state q8 --nvme DIR", [&](PlanLimits& x) {
      x.optimizer_state = StateFormat::kQ8;
      x.nvme_dir = kSomeFolder;
    }, false);
  return out;
}

std::string fit_option_text(const FitOption& o) {
  std::string figures = fmt::format("the process ~{} at its peak", format_bytes(o.host_peak_bytes));
  if (o.nvme_bytes > 0) figures += fmt::format(", {} on NVMe", format_bytes(o.nvme_bytes));
  if (o.tokens_per_s > 0) figures += fmt::format(", {:.0f} tokens/s predicted", o.tokens_per_s);
  return fmt::format("fits with {}: {}", o.change, figures);
}

}  // namespace strider
