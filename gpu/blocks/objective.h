// Objectives past supervised fine-tuning, over the step's per-token
// log-probabilities: preference pairs (DPO, SimPO, ORPO) and the RL policy
// loss (GRPO), as TRL 1.16 defines them (trl/trainer/dpo_trainer.py
// _compute_loss; trl/experimental/cpo/cpo_trainer.py cpo_loss;
// trl/experimental/orpo/orpo_trainer.py odds_ratio_loss; trl/trainer/
// grpo_trainer.py _compute_loss).
//
// The head's pass 1 leaves every token's log-probability of its label
// (target logit - log-sum-exp) for every micro-batch of the step before any
// pass 2 runs, so an objective may couple any rows of a step. It maps them to
// the step's loss and to d(loss)/d(log-probability) per token; the head's
// pass 2 turns that into the logits' gradient (-coefficient x (softmax -
// onehot), chunked_loss.h's head_grad_shard) and nothing below changes.
//
// The map is ATen autograd over a [rows, seq] fp32 tensor: the derivative is
// the formula's own, with no hand-derived gradient to keep in step with it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace strider {

enum class ObjectiveKind : uint8_t { kSft, kDpo, kSimpo, kOrpo, kGrpo };
// TRL's loss_type: DPO's (sigmoid, ipo, hinge, robust) and GRPO's (grpo,
// bnpo, dapo, dr_grpo). SimPO is CPO's "simpo"; ORPO has one.
enum class ObjectiveLoss : uint8_t { kNone, kSigmoid, kIpo, kHinge, kRobust, kGrpo, kBnpo, kDapo, kDrGrpo };

// What the executors read of an objective (resolved from the engine
// config's fields, engine/config/objective_config.h: defaults filled in).
struct ObjectiveSettings {
  ObjectiveKind kind = ObjectiveKind::kSft;
  ObjectiveLoss loss = ObjectiveLoss::kNone;
  double beta = 0;             // DPO's, SimPO's, ORPO's beta; GRPO's KL coefficient
  double label_smoothing = 0;  // DPO robust's flip probability; SimPO's label smoothing
  double simpo_gamma = 0;      // SimPO's target reward margin
  double epsilon = 0, epsilon_high = 0;  // GRPO's clipping range [1 - epsilon, 1 + epsilon_high]
  int64_t max_completion_length = 0;     // dr_grpo's normaliser
  bool sft() const { return kind == ObjectiveKind::kSft; }
  // The step's rows are N chosen sequences followed by their N rejected ones.
  bool pairs() const { return kind == ObjectiveKind::kDpo || kind == ObjectiveKind::kSimpo || kind == ObjectiveKind::kOrpo; }
  // Per-row inputs: DPO's reference log-probability sums, GRPO's advantages.
  bool takes_rows() const { return kind == ObjectiveKind::kDpo || kind == ObjectiveKind::kGrpo; }
  bool takes_reference_tokens() const { return kind == ObjectiveKind::kGrpo && beta != 0; }
};

// Engine::step's inputs of an objective past SFT (engine/run/engine.h),
// per row of the batch, fp32, in host memory. The preference objectives
// (dpo, simpo, orpo) pair row i of the first rows / 2 (chosen) with row
// rows / 2 + i (rejected); every one of the `rows` rows needs a target.
struct ObjectiveInputs {
  int64_t rows = 0;                  // the caller's rows: the first of the batch (the rest are padding)
  const float* row = nullptr;        // [batch]: dpo's reference log-probability sums; grpo's advantages
  const float* old_logps = nullptr;  // [batch, seq] aligned with the labels: grpo's sampling log-probabilities
                                     // (null: on-policy)
  const float* ref_logps = nullptr;  // [batch, seq] aligned with the labels: grpo's reference ones (beta > 0)
};

// One step's inputs beyond its tokens, on the device that runs the objective.
struct ObjectiveBatch {
  at::Tensor row;       // fp32 [batch]: DPO: each row's reference log-probability sum; GRPO: its advantage
  at::Tensor old_logp;  // fp32 [batch, seq], aligned with the labels: GRPO's sampling log-probabilities, or
                        // undefined: on-policy (the ratio is 1, its gradient kept)
  at::Tensor ref_logp;  // fp32 [batch, seq]: GRPO's reference log-probabilities (beta > 0), else undefined
  int64_t rows = 0;     // the caller's rows: the first `rows` of the batch (the rest are padding)
  // This rank's share of a mean over the ranks (1 / ranks): the ranks'
  // gradients sum, so a loss that is a mean over each rank's rows counts
  // once over all of them, as DDP's averaging does in TRL.
  double rank_share = 1;
  double global_tokens = 0;  // dapo: the target tokens of every rank's batch
};

// ObjectiveBatch's row, old_logp and ref_logp in one fp32 buffer of this
// many elements ([batch], then [batch, seq] twice), staged and copied as one.
inline size_t objective_in_elems(int64_t batch, int64_t seq) { return size_t(batch) * size_t(1 + 2 * seq); }

// The figures the objective reports, summed over the ranks (float64
// [kObjectiveStats]): the loss (this rank's share; the sum is the step's),
// and TRL's metrics as sums with their counts.
enum ObjectiveStat : int {
  kStatLoss,
  kStatPairs,        // preference pairs
  kStatChosen,       // sum of the chosen rewards (beta x log-ratio; SimPO, ORPO: beta x mean log-probability)
  kStatRejected,     // the rejected ones'
  kStatAccurate,     // pairs whose chosen reward exceeds the rejected one's
  kStatTokens,       // GRPO: target tokens
  kStatClipLow,      // GRPO: target tokens clipped below (ratio < 1 - epsilon, advantage < 0)
  kStatClipHigh,     // ... above (ratio > 1 + epsilon_high, advantage > 0)
  kStatClipRegion,   // either
  kStatKl,           // GRPO (beta > 0): the k3 estimator summed over target tokens
  kStatLogpsChosen,  // the chosen rows' log-probabilities as the objective takes them (DPO: sums; SimPO, ORPO: means)
  kStatLogpsRejected,
  kStatNll,          // ORPO: its cross-entropy term, times the pairs
  kStatLogOddsRatio, // ORPO: log-sigmoid of the log odds ratio, summed over pairs
  kStatLogOdds,      // ORPO: the log odds ratio, summed over pairs
  kObjectiveStats
};

// The step's loss share and d(it)/d(logp) ([batch, seq] fp32, 0 where `mask`
// is false and in rows past in.rows) for log-probabilities `logp` ([batch,
// seq] fp32, 0 where there is no target) and targets `mask` ([batch, seq]
// bool); writes `stats` (float64 [kObjectiveStats]). A device-side map: no
// host read.
at::Tensor objective_grad(const ObjectiveSettings& o, const at::Tensor& logp, const at::Tensor& mask,
                          const ObjectiveBatch& in, const at::Tensor& stats);

}  // namespace strider
