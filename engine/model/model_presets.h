// config.json of well-known models, by name, so `strider plan` can answer
// "what would this model do on that machine" without the weights.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace strider {

// The names model_preset() knows ("llama-3.1-8b", "qwen2.5-72b", ...).
std::vector<std::string> model_preset_names();
// The published config.json fields of `name` (case-insensitive); throws
// naming the known presets for an unknown name.
nlohmann::json model_preset(const std::string& name);

}  // namespace strider
