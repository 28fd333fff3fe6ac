// The q8 update built for AVX2 (the compiler vectorizes adam_q8_kernel.h's
// group loops); only called after cpuid said yes.
#include "host/adam_q8_kernel.h"

namespace strider::detail {

void adam_q8_avx2(const AdamStep& s, const Q8Args& a) {
  if (a.grad_dtype == DType::kBF16) q8_update(s, a, static_cast<const uint16_t*>(a.grad));
  else q8_update(s, a, static_cast<const float*>(a.grad));
}

}  // namespace strider::detail
