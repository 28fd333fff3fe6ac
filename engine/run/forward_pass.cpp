// Passes without a gradient: evaluate's loss, the log-probabilities (under
// the current weights or the reference model's) and the price of such a pass
// on a simulated machine. Each runs the eval program (engine/program/,
// compile_eval): the layers' forward and the head's first pass.
#include <fmt/ranges.h>

#include <algorithm>

#include "engine/config/engine_config.h"
#include "engine/run/engine.h"
#include "engine/run/engine_core.h"
#include "gpu/device/sim_device.h"
#include "host/error.h"

namespace strider {

double Engine::evaluate(const int64_t* ids, const int64_t* labels, const int64_t* positions,
                        const int64_t* attention) {
  EngineCore& core = *core_;
  STRIDER_CHECK(!simulated(), "evaluate: a simulated engine computes no loss");
  core.check_usable("evaluate");
  core.eval_pass(ids, labels, positions, attention);
  const auto [loss, valid] = core.pass_loss(false);
  core.collect_device_spans();
  STRIDER_CHECK(valid > 0, "evaluate: the batch has no label other than -100");
  return loss;
}

std::vector<float> Engine::logprobs(const int64_t* ids, const int64_t* labels, const int64_t* positions,
                                   const int64_t* attention, bool reference) {
  EngineCore& core = *core_;
  STRIDER_CHECK(!simulated(), "logprobs: a simulated engine computes no log-probability");
  core.check_usable("logprobs");
  const LoraSpec& lora = core.spec_.lora;
  // Refused before any work, as a batch is (the caller may go on).
  if (reference && !lora.enabled() && !core.config_->keep_reference)
    throw BatchRefused("logprobs: reference=True needs the reference model, but this engine trains every parameter "
                       "and keeps no copy of its starting weights; build it with keep_reference "
                       "(EngineConfig(keep_reference=True)), or score the reference before training");
  if (reference && !lora.train.empty())
    throw BatchRefused(fmt::format("logprobs: the reference model is LoRA's frozen base, but {} train in full "
                                   "(modules_to_save) and their starting values are not kept",
                                   fmt::join(lora.train, ", ")));
  if (reference) core.ensure_reference();
  core.reference_pass_ = reference;
  try {
    core.eval_pass(ids, labels, positions, attention);
  } catch (...) {
    core.reference_pass_ = false;
    throw;
  }
  core.reference_pass_ = false;
  // The last head shard's device holds each micro-batch's whole pass-1 state:
  // the label's logit and the log-sum-exp, whose difference is the token's
  // log-probability (the loss sums their negatives).
  const EngineCore::Seat& st = core.seats_[size_t(core.place_.last_head_device())];
  std::vector<float> out;
  out.reserve(size_t(core.config_->batch() * core.config_->seq));
  for (const EngineCore::MicroBatch& x : st.mb) {
    const at::Tensor lp = (x.head.target - x.head_lse).masked_fill(x.labels.view({-1}) == -100, 0.0f).cpu();
    const float* p = lp.data_ptr<float>();
    out.insert(out.end(), p, p + lp.numel());
  }
  core.collect_device_spans();
  return out;
}

void EngineCore::eval_pass(const int64_t* ids, const int64_t* labels, const int64_t* positions,
                           const int64_t* attention) {
  settle_compute();
  upload_batch(ids, labels, positions, attention);
  run_pass(eval_program_);
  synchronize_devices(StreamId::kCompute);
}

double Engine::priced_forward_pass(bool reference) {
  EngineCore& core = *core_;
  STRIDER_CHECK(simulated(), "priced_forward_pass: prices a pass on a simulated machine; this engine computes");
  const auto now = [&] {
    double t = 0;
    for (const EngineCore::Seat& st : core.seats_) t = std::max(t, static_cast<SimDevice&>(*st.device).virtual_time_us());
    return t;
  };
  const std::vector<int64_t> zeros(size_t(core.config_->batch() * core.config_->seq), 0);
  const double begin = now();
  core.reference_pass_ = reference;
  core.eval_pass(zeros.data(), zeros.data(), nullptr, nullptr);
  core.reference_pass_ = false;
  core.collect_device_spans();
  return (now() - begin) * 1e-6;
}

}  // namespace strider
