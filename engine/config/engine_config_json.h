// EngineConfig <-> JSON, with the command line's names (seq, micro_batch,
// accumulation, window, lr, ...), so the CLI, the Python package and saved
// training state describe a run the same way. Unknown keys are refused by name.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include "engine/config/engine_config.h"

namespace strider {

EngineConfig engine_config_from_json(const nlohmann::json& j);
nlohmann::json engine_config_to_json(const EngineConfig& c);

}  // namespace strider
