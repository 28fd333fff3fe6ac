// Choices the plan makes by predicted speed rather than by what fits: a
// mixture of experts' expert pieces. The prediction is the caller's (strider
// plan's simulated machine, engine/cli/plan.cpp): the plan's search itself
// (engine/plan/plan.cpp) only counts bytes.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/plan/plan.h"
#include "host/error.h"

namespace strider {

namespace {
// Pieces of fewer experts each need less RAM per gradient ring slot and
// land their gradients sooner (the D2H, the AdamW job and the NVMe write of
// a piece start while the next piece's gradients are made), but each is a
// copy and a job of its own. Which wins depends on the model and machine
// (batch 32 x 1024 on the rtx4090 preset, q8: Qwen3-30B-A3B on 128 GiB + NVMe
// 1131 tokens/s whole, 1212 with pieces of 4; Mixtral-8x7B 438 whole, 479
// with pieces of 1; Qwen3-30B-A3B on 256 GiB the same 2258 for every size).
// Every fourth size: 8 and 2 predicted between their neighbours (Qwen3-30B-A3B
// on 128 GiB + NVMe: 16 1167, 8 1197, 4 1212, 2 1202, 1 1198), and each size
// tried is a simulated step or two (seconds for a 30B model).
constexpr int64_t kSizes[] = {16, 4, 1};
// A smaller piece must be this much faster to be chosen: more pieces are
// more copies and jobs for a gain inside the prediction's own error.
constexpr double kMinGain = 1.01;

std::string pieces_text(int64_t pieces) {
  return pieces == 0 ? std::string("whole layers")
                     : fmt::format("{} expert{} per piece", pieces, pieces == 1 ? "" : "s");
}
}  // namespace

Plan fastest_expert_pieces(const ModelSpec& spec, const PlanLimits& l, Plan base, const PlanSpeed& tokens_per_s) {
  const int64_t experts = spec.dims.moe.experts;
  if (!base.feasible || spec.sparse_layer_count() == 0 || l.expert_pieces != 0 || l.mlp_pieces != 0 ||
      base.mlp_pieces != 0 || !l.lora.empty())
    return base;
  std::vector<Plan::ExpertTrial> trials;
  Plan best;
  double best_speed = 0;
  const auto consider = [&](Plan p, const PlanLimits& pl) {
    const double speed = tokens_per_s(p, pl);
    trials.push_back({p.expert_pieces, speed});
    if (best.feasible && speed < best_speed * kMinGain) return;
    best = std::move(p);
    best_speed = speed;
  };
  const int64_t base_pieces = base.expert_pieces;
  // Whole layers first where they fit (base is then Plan::make's plan with them).
  if (base_pieces == 0) consider(base, l);
  for (int64_t n : kSizes) {
    if (n >= experts) continue;
    if (n == base_pieces) {
      consider(base, l);
      continue;
    }
    PlanLimits cut = l;
    cut.expert_pieces = n;
    Plan p;
    try {
      p = Plan::make(spec, cut);
    } catch (const Error&) {
      continue;  // a size the optimizer state's groups cannot cut
    }
    if (p.feasible) consider(std::move(p), cut);
  }
  if (!best.feasible) return base;  // nothing predicted (no size below the expert count)
  std::vector<std::string> tried;
  for (const Plan::ExpertTrial& t : trials)
    tried.push_back(fmt::format("{} {:.0f}", pieces_text(t.expert_pieces), t.tokens_per_s));
  const bool changed = best.expert_pieces != base_pieces;
  best.why.push_back(fmt::format(
      "expert pieces: {} ({}, tokens/s predicted: {}; a smaller piece is chosen when at least {:.0f}% faster){}",
      pieces_text(best.expert_pieces),
      changed ? fmt::format("chosen for speed over {}", pieces_text(base_pieces)) : std::string("the fastest"),
      fmt::join(tried, ", "), (kMinGain - 1) * 100,
      // strider finetune makes no prediction: it takes the size as an option.
      changed ? fmt::format("; strider finetune: --expert-pieces {}", best.expert_pieces) : std::string()));
  best.expert_trials = std::move(trials);
  return best;
}

}  // namespace strider
