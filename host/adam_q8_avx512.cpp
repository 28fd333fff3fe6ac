// The q8 update for AVX-512 (F + BW + VL + DQ), 16 lanes: the hand-written
// kernel (adam_q8_simd.h over adam_q8_avx512.h's vector type; the one with
// VBMI is adam_q8_avx512_vbmi.cpp) and the loops of
// adam_q8_kernel.h as the compiler vectorizes them (the kernel before the
// hand-written one, kept as bench_adam's reference and a test's witness).
// Only called after cpuid said yes.
#include "host/adam_q8_avx512.h"

namespace strider::detail {

void adam_q8_avx512(const AdamStep& s, const Q8Args& a) {
  if (a.grad_dtype == DType::kBF16) q8_update_simd<Avx512>(s, a, static_cast<const uint16_t*>(a.grad));
  else q8_update_simd<Avx512>(s, a, static_cast<const float*>(a.grad));
}

void adam_q8_avx512_loops(const AdamStep& s, const Q8Args& a) {
  if (a.grad_dtype == DType::kBF16) q8_update(s, a, static_cast<const uint16_t*>(a.grad));
  else q8_update(s, a, static_cast<const float*>(a.grad));
}

}  // namespace strider::detail
