// Dynamic loss scaling for the fp16 compute dtype (EngineConfig::loss_scaling),
// and where it stands between steps.
#pragma once

#include <algorithm>
#include <cstdint>

namespace strider {

// Dynamic loss scaling, as torch.amp.GradScaler does it (the fp16 compute
// dtype uses it; the others never scale). The loss's gradient is multiplied
// by the scale, so fp16 activation gradients keep their small values; the
// fp32 gradients that reach the host are divided by it before the norm,
// clipping and AdamW. A step whose scaled gradients are not finite is
// skipped before any update and the scale is multiplied by `backoff` (not
// below `floor`); after `growth_interval` steps in a row without one it is
// multiplied by `growth`.
struct LossScaling {
  double init = 65536.0;         // GradScaler's init_scale (2^16)
  double growth = 2.0;
  double backoff = 0.5;
  int64_t growth_interval = 2000;
  double floor = 1.0;            // an overflow at this scale is a divergence (StepReport::overflow)
};

// Where loss scaling stands between steps: what a checkpoint keeps.
struct LossScaleState {
  double scale = 1.0;
  int64_t good_steps = 0;        // steps since the last overflow (or growth)
};

// torch.amp.GradScaler.update: after a skipped step the scale backs off (and
// the run of good steps restarts); after growth_interval good steps in a row
// it grows.
inline LossScaleState next_loss_scale(const LossScaling& ls, LossScaleState s, bool skipped) {
  if (skipped) return {std::max(ls.floor, s.scale * ls.backoff), 0};
  if (++s.good_steps < ls.growth_interval) return s;
  return {s.scale * ls.growth, 0};
}

}  // namespace strider
