// Internal to the plan (engine/plan/plan.cpp): where the RAM limit does not hold
// the training state, what goes to NVMe.
#pragma once

#include <cstdint>
#include <string>

#include "engine/plan/plan.h"

namespace strider {

// Moves the largest blocks' optimizer state to NVMe, the fewest that make
// the pinned arena fit `arena_limit`; where every block's does not, decoder
// layers' compute copies too (the fewest, the last layers first). Sets p's
// nvme_blocks and nvme_compute_blocks and its lines, `f` to the chosen
// footprint, and lim.nvme_dir; false (p.reason set) where nothing fits.
bool place_on_nvme(const ModelSpec& spec, const PlanLimits& l, PlanLimits& lim, Plan& p, EngineFootprint& f,
                   uint64_t arena_limit, const std::string& limit_text);

}  // namespace strider
