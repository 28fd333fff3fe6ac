// The scalar reference: the definition every SIMD kernel is tested against.
#include <cmath>

#include "host/adam_kernel.h"
#include "host/bf16.h"
#include "host/half.h"

namespace strider::detail {
namespace {

template <class G>
inline float load_grad(const G* g, size_t i) {
  if constexpr (std::is_same_v<G, uint16_t>) return bf16_to_float(g[i]);
  else return g[i];
}

template <class G>
void adam_scalar(const AdamStep& s, float* p, float* m, float* v, const G* g, uint16_t* out, bool out_f16, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float gi = load_grad(g, i) * s.grad_scale;
    float pi = p[i];
    if (s.adamw) pi = pi * s.decay;
    else gi = gi + s.l2 * pi;
    float mi = s.beta1 * m[i] + s.one_minus_beta1 * gi;
    float vi = s.beta2 * v[i] + s.one_minus_beta2 * (gi * gi);
    float denom = std::sqrt(vi) / s.bc2_sqrt + s.eps;
    pi = pi + s.neg_step_size * (mi / denom);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (out != nullptr) out[i] = out_f16 ? float_to_f16(pi) : float_to_bf16(pi);
  }
}

}  // namespace

void adam_scalar_bf16(const AdamStep& s, float* p, float* m, float* v, const uint16_t* g,
                      uint16_t* out, bool out_f16, size_t n) {
  adam_scalar(s, p, m, v, g, out, out_f16, n);
}
void adam_scalar_f32(const AdamStep& s, float* p, float* m, float* v, const float* g,
                     uint16_t* out, bool out_f16, size_t n) {
  adam_scalar(s, p, m, v, g, out, out_f16, n);
}

}  // namespace strider::detail
