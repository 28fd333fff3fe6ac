#include "host/half.h"

#include "host/bf16.h"
#include "host/error.h"

namespace strider {
namespace {

void check_16(DType dtype) {
  STRIDER_CHECK(dtype == DType::kBF16 || dtype == DType::kF16, "a 16-bit compute copy is BF16 or F16, not {}",
                dtype_name(dtype));
}

}  // namespace

void float_to_f16(std::span<const float> src, std::span<uint16_t> dst) {
  STRIDER_CHECK(src.size() == dst.size(), "float_to_f16: {} floats into {} fp16", src.size(), dst.size());
  for (size_t i = 0; i < src.size(); ++i) dst[i] = float_to_f16(src[i]);
}

void f16_to_float(std::span<const uint16_t> src, std::span<float> dst) {
  STRIDER_CHECK(src.size() == dst.size(), "f16_to_float: {} fp16 into {} floats", src.size(), dst.size());
  for (size_t i = 0; i < src.size(); ++i) dst[i] = f16_to_float(src[i]);
}

void round_to_16(DType dtype, std::span<const float> src, std::span<uint16_t> dst) {
  check_16(dtype);
  if (dtype == DType::kBF16) float_to_bf16(src, dst);
  else float_to_f16(src, dst);
}

void widen_16(DType dtype, std::span<const uint16_t> src, std::span<float> dst) {
  check_16(dtype);
  if (dtype == DType::kBF16) bf16_to_float(src, dst);
  else f16_to_float(src, dst);
}

float widen_16(DType dtype, uint16_t x) {
  check_16(dtype);
  return dtype == DType::kBF16 ? bf16_to_float(x) : f16_to_float(x);
}

}  // namespace strider
