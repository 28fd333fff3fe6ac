// AVX-512 kernel (F + BW + VL): 16 floats per iteration, masked tail, so any
// length is handled without a scalar epilogue. Compiled with -mavx512*; only
// called after cpuid said yes.
#include <immintrin.h>

#include <type_traits>

#include "host/adam_kernel.h"

namespace strider::detail {
namespace {

inline __m512 load_grad(const uint16_t* g, __mmask16 k) {
  __m256i h = _mm256_maskz_loadu_epi16(k, g);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load_grad(const float* g, __mmask16 k) { return _mm512_maskz_loadu_ps(k, g); }

// Round to nearest even; NaN keeps its sign and becomes quiet (as bf16.h).
inline __m256i to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

// IEEE fp16, round to nearest even (the F16C conversion AVX-512F carries).
inline __m256i to_f16(__m512 x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

template <class G>
void adam_avx512(const AdamStep& s, float* p, float* m, float* v, const G* g, uint16_t* out,
                 bool out_f16, size_t n) {
  const __m512 scale = _mm512_set1_ps(s.grad_scale), decay = _mm512_set1_ps(s.decay),
               l2 = _mm512_set1_ps(s.l2), b1 = _mm512_set1_ps(s.beta1),
               omb1 = _mm512_set1_ps(s.one_minus_beta1), b2 = _mm512_set1_ps(s.beta2),
               omb2 = _mm512_set1_ps(s.one_minus_beta2), nstep = _mm512_set1_ps(s.neg_step_size),
               bc2 = _mm512_set1_ps(s.bc2_sqrt), eps = _mm512_set1_ps(s.eps);
  for (size_t i = 0; i < n; i += 16) {
    const size_t left = n - i;
    const __mmask16 k = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    __m512 gi = _mm512_mul_ps(load_grad(g + i, k), scale);
    __m512 pi = _mm512_maskz_loadu_ps(k, p + i);
    if (s.adamw) pi = _mm512_mul_ps(pi, decay);
    else gi = _mm512_add_ps(gi, _mm512_mul_ps(l2, pi));
    __m512 mi = _mm512_add_ps(_mm512_mul_ps(b1, _mm512_maskz_loadu_ps(k, m + i)),
                              _mm512_mul_ps(omb1, gi));
    __m512 vi = _mm512_add_ps(_mm512_mul_ps(b2, _mm512_maskz_loadu_ps(k, v + i)),
                              _mm512_mul_ps(omb2, _mm512_mul_ps(gi, gi)));
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2), eps);
    pi = _mm512_add_ps(pi, _mm512_mul_ps(nstep, _mm512_div_ps(mi, denom)));
    _mm512_mask_storeu_ps(p + i, k, pi);
    _mm512_mask_storeu_ps(m + i, k, mi);
    _mm512_mask_storeu_ps(v + i, k, vi);
    if (out != nullptr) _mm256_mask_storeu_epi16(out + i, k, out_f16 ? to_f16(pi) : to_bf16(pi));
  }
}

}  // namespace

void adam_avx512_bf16(const AdamStep& s, float* p, float* m, float* v, const uint16_t* g,
                      uint16_t* out, bool out_f16, size_t n) {
  adam_avx512(s, p, m, v, g, out, out_f16, n);
}
void adam_avx512_f32(const AdamStep& s, float* p, float* m, float* v, const float* g,
                     uint16_t* out, bool out_f16, size_t n) {
  adam_avx512(s, p, m, v, g, out, out_f16, n);
}

}  // namespace strider::detail
