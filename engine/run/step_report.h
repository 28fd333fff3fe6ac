// What a training step reports (Engine::step, engine/run/engine.h), and the
// refusal of a bad batch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/program/timeline.h"  // StepStats
#include "host/error.h"

namespace strider {

// Engine::evaluate_objective's: an objective's loss and its figures under TRL's names.
struct ObjectiveEval {
  double loss = 0;
  std::vector<std::pair<std::string, double>> metrics;
};

struct StepReport {
  int64_t step = 0;            // 1 for the first update
  double loss = 0;             // mean over the batch's valid tokens (an objective past SFT: its loss)
  int64_t tokens = 0;          // batch * seq
  int64_t valid_tokens = 0;
  double grad_norm = 0;        // before clipping
  double lr = 0;
  double step_s = 0;
  double tokens_per_s = 0;
  StepStats stats;             // per-lane busy time, overlap efficiency
  size_t peak_device_bytes = 0;
  // What the step's device work moved and needed. The bytes sum the spans of
  // the step's copies (so they need DeviceOptions::record_spans): H2D the
  // parameters of each visit, the batch, host checkpoints coming back, a tied
  // embedding's gradient; D2H gradients, checkpoints going out, the loss
  // figures. The working memory is Device::work_peak_bytes over the step: the
  // most ATen held inside any one compute op (0 where not measured).
  uint64_t h2d_bytes = 0;
  uint64_t d2h_bytes = 0;
  uint64_t work_peak_bytes = 0;
  // The numerics guard: a step whose loss, gradient norm (with clipping) or
  // first-updated block's gradient (without) is not finite changes nothing:
  // no block is updated, steps_done() does not advance (nor AdamW's count or
  // the schedule), and the report says why. The batch is consumed.
  bool skipped = false;
  std::string skip_reason;     // "loss is nan", "gradient norm is inf", ...
  // The batch had no target token (every label -100; over every rank's rows
  // in data parallel): nothing was computed, nothing changed, and the step is
  // skipped without being a fault (a sparse chat data set has such batches).
  bool no_targets = false;
  // fp16 (EngineConfig::loss_scaling): the scale this step's gradients
  // carried (0: the dtype does not scale). An overflow is a skip of finite
  // loss while the scale was above its floor: the scale backs off, and it
  // is not a divergence (--max-skipped-steps does not count it).
  double loss_scale = 0;
  bool overflow = false;
  int64_t nonfinite_block = -1;  // the first block (in forward order) with a non-finite gradient, or -1
  std::string nonfinite_tensor;  // that block's first non-finite gradient tensor
  // An objective past SFT (EngineConfig::objective): its figures over every
  // rank's rows under TRL's names (rewards/chosen, rewards/margins, ...;
  // clip_ratio/region_mean, kl, ...).
  std::vector<std::pair<std::string, double>> metrics;
};

// A batch that step() or evaluate() refused before any work (a token id, a
// label, a position or the attention mask out of its range): the engine is as
// it was, and the next call may go on.
class BatchRefused : public Error {
 public:
  using Error::Error;
};

}  // namespace strider
