// Internal to host/: the per-ISA AdamW kernels cpu_adam.cpp dispatches to. Each
// lives in its own translation unit compiled for that ISA only.
//
// Every kernel computes, per element, in float and in this order (contraction
// off), so all ISAs give the same bits:
//   g  = grad * grad_scale;  AdamW: p = p * decay;  Adam: g = g + l2 * p
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * (g * g)
//   p  = p + neg_step_size * (m / (sqrt(v) / bc2_sqrt + eps))
//   out = bf16_round_nearest_even(p), or fp16_round_nearest_even(p) (out_f16)
#pragma once

#include <cstddef>
#include <cstdint>

#include "host/cpu_adam.h"

namespace strider::detail {

// Signature shared by every kernel: grad is bf16 bits or fp32; out may be
// null, else it gets bf16 bits, or fp16 bits when out_f16.
using AdamKernelBf16 = void (*)(const AdamStep&, float* p, float* m, float* v,
                                const uint16_t* g, uint16_t* out, bool out_f16, size_t n);
using AdamKernelF32 = void (*)(const AdamStep&, float* p, float* m, float* v,
                               const float* g, uint16_t* out, bool out_f16, size_t n);

void adam_scalar_bf16(const AdamStep&, float*, float*, float*, const uint16_t*, uint16_t*, bool, size_t);
void adam_scalar_f32(const AdamStep&, float*, float*, float*, const float*, uint16_t*, bool, size_t);
void adam_avx2_bf16(const AdamStep&, float*, float*, float*, const uint16_t*, uint16_t*, bool, size_t);
void adam_avx2_f32(const AdamStep&, float*, float*, float*, const float*, uint16_t*, bool, size_t);
void adam_avx512_bf16(const AdamStep&, float*, float*, float*, const uint16_t*, uint16_t*, bool, size_t);
void adam_avx512_f32(const AdamStep&, float*, float*, float*, const float*, uint16_t*, bool, size_t);

}  // namespace strider::detail
