// AVX2 kernel: 8 floats per iteration. AVX2 has no 16-bit masked load, so the
// tail (< 8 elements) goes through a small zero-padded stack copy and runs the
// same vector code: one code path, bit-identical to the scalar reference.
#include <immintrin.h>

#include <cstring>

#include "host/adam_kernel.h"

namespace strider::detail {
namespace {

inline __m256 load_grad(const uint16_t* g) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load_grad(const float* g) { return _mm256_loadu_ps(g); }

// Round to nearest even; NaN keeps its sign and becomes quiet (as bf16.h).
inline __m128i to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  // Values fit in 16 bits, so unsigned saturation is exact; fix the lane order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000);
  return _mm256_castsi256_si128(packed);
}

// IEEE fp16, round to nearest even (F16C, which every AVX2 CPU this runs on has: isa_supported checks).
inline __m128i to_f16(__m256 x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

struct Consts {
  __m256 scale, decay, l2, b1, omb1, b2, omb2, nstep, bc2, eps;
  explicit Consts(const AdamStep& s)
      : scale(_mm256_set1_ps(s.grad_scale)), decay(_mm256_set1_ps(s.decay)),
        l2(_mm256_set1_ps(s.l2)), b1(_mm256_set1_ps(s.beta1)),
        omb1(_mm256_set1_ps(s.one_minus_beta1)), b2(_mm256_set1_ps(s.beta2)),
        omb2(_mm256_set1_ps(s.one_minus_beta2)), nstep(_mm256_set1_ps(s.neg_step_size)),
        bc2(_mm256_set1_ps(s.bc2_sqrt)), eps(_mm256_set1_ps(s.eps)) {}
};

template <class G>
inline void step8(const Consts& c, bool adamw, float* p, float* m, float* v, const G* g,
                  uint16_t* out, bool out_f16) {
  __m256 gi = _mm256_mul_ps(load_grad(g), c.scale);
  __m256 pi = _mm256_loadu_ps(p);
  if (adamw) pi = _mm256_mul_ps(pi, c.decay);
  else gi = _mm256_add_ps(gi, _mm256_mul_ps(c.l2, pi));
  __m256 mi = _mm256_add_ps(_mm256_mul_ps(c.b1, _mm256_loadu_ps(m)), _mm256_mul_ps(c.omb1, gi));
  __m256 vi = _mm256_add_ps(_mm256_mul_ps(c.b2, _mm256_loadu_ps(v)),
                            _mm256_mul_ps(c.omb2, _mm256_mul_ps(gi, gi)));
  __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), c.bc2), c.eps);
  pi = _mm256_add_ps(pi, _mm256_mul_ps(c.nstep, _mm256_div_ps(mi, denom)));
  _mm256_storeu_ps(p, pi);
  _mm256_storeu_ps(m, mi);
  _mm256_storeu_ps(v, vi);
  if (out != nullptr) _mm_storeu_si128(reinterpret_cast<__m128i*>(out), out_f16 ? to_f16(pi) : to_bf16(pi));
}

template <class G>
void adam_avx2(const AdamStep& s, float* p, float* m, float* v, const G* g, uint16_t* out,
               bool out_f16, size_t n) {
  const Consts c(s);
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    step8(c, s.adamw, p + i, m + i, v + i, g + i, out ? out + i : nullptr, out_f16);
  if (i == n) return;
  const size_t t = n - i;
  alignas(32) float tp[8] = {}, tm[8] = {}, tv[8] = {};
  alignas(32) G tg[8] = {};
  alignas(16) uint16_t to[8] = {};
  std::memcpy(tp, p + i, t * sizeof(float));
  std::memcpy(tm, m + i, t * sizeof(float));
  std::memcpy(tv, v + i, t * sizeof(float));
  std::memcpy(tg, g + i, t * sizeof(G));
  step8(c, s.adamw, tp, tm, tv, tg, out ? to : nullptr, out_f16);
  std::memcpy(p + i, tp, t * sizeof(float));
  std::memcpy(m + i, tm, t * sizeof(float));
  std::memcpy(v + i, tv, t * sizeof(float));
  if (out != nullptr) std::memcpy(out + i, to, t * sizeof(uint16_t));
}

}  // namespace

void adam_avx2_bf16(const AdamStep& s, float* p, float* m, float* v, const uint16_t* g,
                    uint16_t* out, bool out_f16, size_t n) {
  adam_avx2(s, p, m, v, g, out, out_f16, n);
}
void adam_avx2_f32(const AdamStep& s, float* p, float* m, float* v, const float* g,
                   uint16_t* out, bool out_f16, size_t n) {
  adam_avx2(s, p, m, v, g, out, out_f16, n);
}

}  // namespace strider::detail
