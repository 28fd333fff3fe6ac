// Learning-rate schedules, with the semantics of transformers'
// get_{constant,linear,cosine}_schedule_with_warmup so a run can be compared
// step for step with a Hugging Face reference: `step` counts optimizer steps
// already taken (0 for the first update).
#pragma once

#include <cstdint>
#include <string>

namespace strider {

enum class LrShape { kConstant, kLinear, kCosine };

struct LrSchedule {
  LrShape shape = LrShape::kConstant;
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;  // linear/cosine decay to 0 at total_steps

  // The multiplier of the base learning rate for update number `step` (0-based).
  double factor(int64_t step) const;
  static LrShape parse_shape(const std::string& name);  // "constant", "linear", "cosine"
};

}  // namespace strider
