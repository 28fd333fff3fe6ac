// ObjectiveConfig: the engine config's fields of the training objective
// (EngineConfig::objective; declared in config_fields.json), as given, and
// what the executors read of them (gpu/blocks/objective.h's
// ObjectiveSettings, with TRL 1.16's defaults filled in).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gpu/blocks/objective.h"

namespace strider {

struct ObjectiveConfig {
  std::string objective = "sft";    // sft, dpo, simpo, orpo, grpo
  std::string loss_type = "auto";   // auto: sigmoid (dpo), dapo (grpo)
  double beta = -1;                 // -1: 0.1 (dpo, simpo, orpo), 0 (grpo)
  double label_smoothing = 0;       // dpo robust, simpo
  double simpo_gamma = 0.5;         // simpo
  double epsilon = 0.2;             // grpo
  double epsilon_high = -1;         // grpo; -1: epsilon
  int64_t max_completion_length = 0;  // grpo dr_grpo
  bool sft() const { return objective == "sft"; }
  // The settings with their defaults; the rules hold (objective_problems is empty).
  ObjectiveSettings resolve() const;
};

// (field, text) for each rule the objective's fields break (engine_config_json.h's settings_problems).
struct ObjectiveProblem {
  const char* field;
  std::string text;
};
std::vector<ObjectiveProblem> objective_problems(const ObjectiveConfig& c, bool packed_documents);

}  // namespace strider
