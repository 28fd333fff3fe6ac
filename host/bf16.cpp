#include "host/bf16.h"

#include "host/error.h"

namespace strider {

void float_to_bf16(std::span<const float> src, std::span<uint16_t> dst) {
  STRIDER_CHECK(src.size() == dst.size(), "float_to_bf16: {} floats into {} bf16", src.size(), dst.size());
  for (size_t i = 0; i < src.size(); ++i) dst[i] = float_to_bf16(src[i]);
}

void bf16_to_float(std::span<const uint16_t> src, std::span<float> dst) {
  STRIDER_CHECK(src.size() == dst.size(), "bf16_to_float: {} bf16 into {} floats", src.size(), dst.size());
  for (size_t i = 0; i < src.size(); ++i) dst[i] = bf16_to_float(src[i]);
}

}  // namespace strider
