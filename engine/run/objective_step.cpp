// An objective past SFT in Engine::step: its inputs, checked before any work
// (a refused batch changes nothing: BatchRefused, and the caller may go on),
// and its figures under TRL's names once the pass ended.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "engine/run/collectives.h"
#include "engine/run/engine.h"
#include "engine/run/engine_core.h"
#include "gpu/blocks/objective.h"

namespace strider {

void check_objective_inputs(const ObjectiveSettings& o, const ObjectiveInputs* in, const int64_t* labels,
                            int64_t batch, int64_t seq, std::string_view name) {
  auto refuse = [](std::string text) { throw BatchRefused(std::move(text)); };
  if (o.sft()) {
    if (in != nullptr)
      refuse("objective inputs (ref_logps, advantages, old_logps) given, but the engine's objective is sft; make it "
             "with EngineConfig(objective=...)");
    return;
  }
  const int64_t rows = in != nullptr ? in->rows : batch;
  if (rows < 1 || rows > batch) refuse(fmt::format("objective {}: {} rows; the engine takes 1 to {}", name, rows, batch));
  if (o.pairs() && rows % 2 != 0)
    refuse(fmt::format("objective {}: {} rows do not make pairs: give N chosen rows followed by their N rejected ones",
                       name, rows));
  const bool row = in != nullptr && in->row != nullptr;
  const char* row_name = o.kind == ObjectiveKind::kGrpo ? "advantages" : "ref_logps";
  if (o.takes_rows() && !row)
    refuse(o.kind == ObjectiveKind::kGrpo
               ? fmt::format("objective {}: advantages (one per row) are needed", name)
               : fmt::format("objective {}: ref_logps (each row's log-probability sum under the reference model) are "
                             "needed", name));
  if (!o.takes_rows() && row)
    refuse(fmt::format("objective {} takes no per-row values (it has no reference); leave them out", name));
  if (in != nullptr && in->old_logps != nullptr && o.kind != ObjectiveKind::kGrpo)
    refuse(fmt::format("objective {}: old_logps are grpo's", name));
  if (in != nullptr && in->ref_logps != nullptr && !o.takes_reference_tokens())
    refuse(fmt::format("objective {}: per-token ref_logps are grpo's with beta > 0 (the KL term); {}", name,
                       o.kind == ObjectiveKind::kGrpo ? "beta is 0, so they would be ignored" : "leave them out"));
  if (o.takes_reference_tokens() && (in == nullptr || in->ref_logps == nullptr))
    refuse(fmt::format("objective {} with beta {}: per-token ref_logps (the reference model's) are needed for the "
                       "KL term", name, o.beta));
  for (int64_t r = 0; r < rows; ++r) {
    if (row && !std::isfinite(in->row[r])) refuse(fmt::format("{}[{}] is {}: not finite", row_name, r, in->row[r]));
    int64_t targets = 0;
    for (int64_t t = 0; t < seq; ++t) {
      const size_t i = size_t(r * seq + t);
      if (labels[i] == -100) continue;
      ++targets;
      for (const auto& [p, what] : {std::pair{in ? in->old_logps : nullptr, "old_logps"},
                                    std::pair{in ? in->ref_logps : nullptr, "ref_logps"}})
        if (p != nullptr && !std::isfinite(p[i]))
          refuse(fmt::format("{}[{}][{}] is {}: not finite", what, r, t, p[i]));
    }
    if (o.pairs() && targets == 0)
      refuse(fmt::format("objective {}: row {} has no target token (every label -100); each sequence of a pair needs "
                         "its completion", name, r));
  }
}

std::vector<std::pair<std::string, double>> EngineCore::objective_metrics() {
  std::vector<double> s(objective_stats_host_.begin(), objective_stats_host_.end());  // kLossOut's copy, landed
  dist_->all_reduce_sum(s);
  return objective_figures(s);
}

ObjectiveEval Engine::evaluate_objective(const int64_t* ids, const int64_t* labels, const int64_t* positions,
                                         const int64_t* attention, const ObjectiveInputs* objective) {
  EngineCore& core = *core_;
  STRIDER_CHECK(!core.objective_.sft(), "evaluate_objective: the engine's objective is sft (evaluate)");
  const int64_t B = core.config_->batch(), S = core.config_->seq;
  check_objective_inputs(core.objective_, objective, labels, B, S, core.config_->objective.objective);
  // The log-probabilities by evaluate's pass, then the objective's map on the host: the step's loss
  // share and figures, no gradient kept (the map computes one, small next to the pass).
  std::vector<float> lp = logprobs(ids, labels, positions, attention, false);
  const at::Tensor logp = at::from_blob(lp.data(), {B, S}, at::kFloat);
  const at::Tensor mask = at::from_blob(const_cast<int64_t*>(labels), {B, S}, at::kLong).ne(-100);
  ObjectiveBatch b;
  b.rows = objective != nullptr ? objective->rows : B;
  b.row = at::zeros({B}, at::kFloat);
  auto given = [&](const float* p, int64_t n) { return at::from_blob(const_cast<float*>(p), {n}, at::kFloat); };
  if (objective != nullptr && objective->row != nullptr) b.row.slice(0, 0, b.rows).copy_(given(objective->row, b.rows));
  auto tokens = [&](const float* p) {
    if (p == nullptr) return at::Tensor();
    at::Tensor t = at::zeros({B, S}, at::kFloat);
    t.view(-1).slice(0, 0, b.rows * S).copy_(given(p, b.rows * S));
    return t;
  };
  b.old_logp = tokens(objective != nullptr ? objective->old_logps : nullptr);
  b.ref_logp = tokens(objective != nullptr ? objective->ref_logps : nullptr);
  b.rank_share = 1.0 / double(core.dist_->ranks().world);
  b.global_tokens = double(core.batch_valid_);  // over every rank (the pass's upload_batch)
  const at::Tensor stats = at::zeros({kObjectiveStats}, at::kDouble);
  objective_grad(core.objective_, logp, mask, b, stats);
  std::vector<double> s(stats.data_ptr<double>(), stats.data_ptr<double>() + kObjectiveStats);
  core.dist_->all_reduce_sum(s);
  // As the step's loss: its share summed over the ranks, plus a mixture of experts' load-balancing term.
  return {.loss = s[kStatLoss] + core.router_aux_term(), .metrics = core.objective_figures(s)};
}

std::vector<std::pair<std::string, double>> EngineCore::objective_figures(const std::vector<double>& s) const {
  std::vector<std::pair<std::string, double>> out;
  if (objective_.pairs()) {
    const double n = s[kStatPairs];
    out = {{"rewards/chosen", s[kStatChosen] / n},
           {"rewards/rejected", s[kStatRejected] / n},
           {"rewards/accuracies", s[kStatAccurate] / n},
           {"rewards/margins", (s[kStatChosen] - s[kStatRejected]) / n},
           {"logps/chosen", s[kStatLogpsChosen] / n},
           {"logps/rejected", s[kStatLogpsRejected] / n}};
    if (objective_.kind == ObjectiveKind::kOrpo)
      out.insert(out.end(), {{"nll_loss", s[kStatNll] / n},
                             {"log_odds_ratio", s[kStatLogOddsRatio] / n},
                             {"log_odds_chosen", s[kStatLogOdds] / n}});
    return out;
  }
  const double t = std::max(s[kStatTokens], 1.0);  // TRL's global masked mean
  out = {{"clip_ratio/low_mean", s[kStatClipLow] / t},
         {"clip_ratio/high_mean", s[kStatClipHigh] / t},
         {"clip_ratio/region_mean", s[kStatClipRegion] / t}};
  if (objective_.beta != 0) out.push_back({"kl", s[kStatKl] / t});
  return out;
}

}  // namespace strider
