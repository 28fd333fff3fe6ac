// EngineConfig <-> JSON, with the command line's names (seq, micro_batch,
// accumulation, window, lr, ...), so the CLI, the Python package and saved
// training state describe a run the same way. Unknown keys are refused by name.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "engine/config/engine_config.h"

namespace strider {

// Refuses, naming the field, a value the declaration does not allow, and
// (with check_rules) the first of settings_problems.
EngineConfig engine_config_from_json(const nlohmann::json& j, bool check_rules = true);
nlohmann::json engine_config_to_json(const EngineConfig& c);

// The rules between settings that no field can state alone and that need no
// model (fp16 accumulation needs the fp16 dtype, ...), in this one place for
// every front end: engine_config_from_json refuses the first (so the command
// line, strider.Engine and a saved checkpoint's config meet them),
// strider.EngineConfig asks here through the op library
// (torch.classes.strider.EngineSettings.problems), and the engine's check_config
// (engine/placement/placement.h) adds the rules that need the model.
// Each problem names its field, the other field it is held against (empty
// for a rule of the one field's values), and a text that starts with the
// field and its value.
struct SettingsProblem {
  std::string field, other, text;
};
std::vector<SettingsProblem> settings_problems(const EngineConfig& c);
void check_settings(const EngineConfig& c);  // throws the first problem's text

}  // namespace strider
