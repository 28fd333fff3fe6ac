// `strider finetune --resume`: the newest checkpoint of the series that
// loads into the engine (the maths settings the run's, unless --allow-changed
// names them), on the same data and the same number of ranks unless
// --allow-changed names data or world: each refusal names the option that
// allows it, or says that none does. The caller restores its own state from
// the checkpoint's extra (the data position, DPO's reference, ...).
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/checkpoint/series.h"
#include "engine/cli/finetune_options.h"
#include "engine/run/engine.h"

namespace strider::cli {

// `data`: the training file as checkpoints record it (path, bytes, xxh3); `world_now`: this run's ranks.
CheckpointSeries::Resumed resume_checkpoint(const FinetuneOptions& o, CheckpointSeries& series, Engine& engine,
                                            const std::string& data_path, const nlohmann::json& data,
                                            int64_t world_now);

}  // namespace strider::cli
