// bfloat16 <-> float conversion, bit-exact with torch's `to(torch.bfloat16)`:
// round to nearest, ties to even; Inf stays Inf; denormals are rounded, not
// flushed; NaN stays NaN (quiet, sign kept). bf16 values are carried as
// uint16_t bits so host/ needs no half-precision type.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>

namespace strider {

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u)           // NaN: keep sign, force quiet
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);                // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// Whole-span conversions (vectorised where the compiler can).
void float_to_bf16(std::span<const float> src, std::span<uint16_t> dst);
void bf16_to_float(std::span<const uint16_t> src, std::span<float> dst);

}  // namespace strider
