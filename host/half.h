// IEEE fp16 <-> float, bit-exact with torch's `to(torch.float16)` and with
// the F16C instructions the AdamW kernels use: round to nearest, ties to
// even; a value past 65504 rounds to Inf; subnormals are kept, not flushed;
// NaN stays NaN (quiet, sign kept). Carried as uint16_t bits, as bf16 is
// (host/bf16.h); the conversion is the compiler's _Float16, not ours.
//
// A 16-bit compute copy holds bf16 or fp16 bits: round_to_16 and widen_16
// convert by its dtype.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>

#include "host/dtype.h"

namespace strider {

inline float f16_to_float(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, sizeof h);
  return static_cast<float>(x);
}

inline uint16_t float_to_f16(float f) {
  const auto x = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &x, sizeof h);
  return h;
}

void float_to_f16(std::span<const float> src, std::span<uint16_t> dst);
void f16_to_float(std::span<const uint16_t> src, std::span<float> dst);

// `dtype` is kBF16 or kF16 (anything else throws, naming it).
void round_to_16(DType dtype, std::span<const float> src, std::span<uint16_t> dst);
void widen_16(DType dtype, std::span<const uint16_t> src, std::span<float> dst);
float widen_16(DType dtype, uint16_t x);

}  // namespace strider
