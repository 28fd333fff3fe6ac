#include "engine/config/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "host/error.h"

namespace strider {

double LrSchedule::factor(int64_t step) const {
  if (step < warmup_steps) return double(step) / double(std::max<int64_t>(1, warmup_steps));
  if (shape == LrShape::kConstant) return 1.0;
  STRIDER_CHECK(total_steps > 0, "a {} learning-rate schedule needs the total number of steps",
                shape == LrShape::kLinear ? "linear" : "cosine");
  const double progress = double(step - warmup_steps) / double(std::max<int64_t>(1, total_steps - warmup_steps));
  if (shape == LrShape::kLinear)
    return std::max(0.0, double(total_steps - step) / double(std::max<int64_t>(1, total_steps - warmup_steps)));
  return std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * progress)));
}

LrShape LrSchedule::parse_shape(const std::string& name) {
  if (name == "constant") return LrShape::kConstant;
  if (name == "linear") return LrShape::kLinear;
  if (name == "cosine") return LrShape::kCosine;
  throw Error(fmt::format("learning-rate schedule '{}' is not one of constant, linear, cosine", name));
}

}  // namespace strider
