// The machine a plan prices its choices on, from the device a run uses: the
// one function `strider finetune`, `strider profile` and strider.Engine call,
// so that the same model, settings and device give the same plan from each.
#pragma once

#include <string>

#include "engine/plan/plan.h"

namespace strider {

// Sets `l`'s machine rates, ATen working-memory coefficients and
// device_memory_on_host for a run on `device_spec` (gpu/device/device.h):
//   sim:<preset>: that cost model's rates (no work coefficients: it runs none);
//   the CPU device: its own rates and coefficients, measured here (its "GPU"
//     is these cores and its "link" a memcpy, nothing like a preset's), once
//     per process and compute dtype (about a tenth of a second; an engine
//     made again in the same process plans on the same figures);
//   a GPU: the rtx4090 cost model's rates and the analytic coefficients
//     (PlanLimits' defaults) until one has been measured (gpu_check/gpu_check.sh).
// Call after the settings (PlanLimits::take_settings): the rates depend on
// the compute dtype and matmul accumulation.
void set_device_rates(PlanLimits& l, const std::string& device_spec);

}  // namespace strider
