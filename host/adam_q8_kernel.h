// Internal to host/: the q8 codec's element operations and the update of one
// group, written as straight loops over a group of 128 with no branches in
// them (selects only), so the compiler vectorizes them for whatever ISA the
// including translation unit is built for. adam_q8.cpp (the scalar build),
// adam_q8_avx2.cpp and adam_q8_avx512.cpp include it; everything is in an
// anonymous namespace so each gets its own copy (no ODR mix of ISAs).
//
// Bit-identity across ISAs holds by construction: the same IEEE operations in
// the same order per element (contraction off for the whole library), integer
// bit manipulation, and the groups' maxima taken on the bit patterns of
// non-negative floats (an integer max: exact in any order).
//
// The format (host/state_format.h, codes in adam_q8.cpp's header comment):
//   m code   sign | magnitude c in 0..120 of |m| / scale in [0, 1]
//   v code   magnitude c in 0..240 of sqrt(v) / scale in [0, 1]
//   master   hi (bf16, nearest) and ext (next 8 mantissa bits)
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "host/adam_q8.h"

namespace strider::detail {
namespace {

constexpr uint32_t kRebias = 112u << 23;  // fp32 exponent bias 127 -> 15
constexpr float kTwoToMinus14 = 0x1p-14f;
// Nearest rounding: each random slice at half its range (8 bits for the
// master, 12 for m at bit 8, 12 for v at bit 20).
constexpr uint32_t kHalfWord = 0x80u | 0x800u << 8 | 0x800u << 20;

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}
inline uint32_t element_hash(uint32_t index, uint32_t salt) { return mix32(index * 0x9E3779B1u + salt); }

inline float decode_master(uint16_t hi, uint8_t ext) {
  const uint32_t high = uint32_t(hi) - (uint32_t(ext) >> 7);
  return std::bit_cast<float>(high << 16 | uint32_t(ext) << 8);
}
// r8: the low 8 bits of the element's random word.
inline void encode_master(float p, uint32_t r8, uint16_t& hi, uint8_t& ext) {
  const uint32_t V = (std::bit_cast<uint32_t>(p) + r8) & ~0xFFu;
  hi = uint16_t((V + 0x8000u) >> 16);
  ext = uint8_t(V >> 8);
}

inline float decode_m_unit(uint8_t code) {
  const uint32_t c = code & 0x7Fu;
  const float small = float(int32_t(c)) * 0x1p-17f;
  const float normal = std::bit_cast<float>((c << 20) + kRebias);
  const float mag = c < 8 ? small : normal;
  return std::bit_cast<float>(std::bit_cast<uint32_t>(mag) | (uint32_t(code & 0x80u) << 24));
}
// y in [0, 1]; sign: 0 or 0x80; r12: 12 random bits.
inline uint8_t encode_m_unit(float y, uint32_t sign, uint32_t r12) {
  const uint32_t small = uint32_t(int32_t(y * 131072.0f + float(int32_t(r12)) * 0x1p-12f));
  const uint32_t normal = (std::bit_cast<uint32_t>(y) - kRebias + (r12 << 8)) >> 20;
  return uint8_t((y < kTwoToMinus14 ? small : normal) | sign);
}

inline float decode_v_unit(uint8_t code) {
  const uint32_t c = code;
  const float small = float(int32_t(c)) * 0x1p-18f;
  const float normal = std::bit_cast<float>((c << 19) + kRebias);
  return c < 16 ? small : normal;
}
inline uint8_t encode_v_unit(float y, uint32_t r12) {
  const uint32_t small = uint32_t(int32_t(y * 262144.0f + float(int32_t(r12)) * 0x1p-12f));
  const uint32_t normal = (std::bit_cast<uint32_t>(y) - kRebias + (r12 << 7)) >> 19;
  uint32_t c = y < kTwoToMinus14 ? small : normal;
  c |= uint32_t((c == 0) & (y > 0.0f));  // a nonzero sqrt(v) never codes to 0
  return uint8_t(c);
}

constexpr size_t kN = kQ8GroupElems;

// The largest |x| of a group, as the max of the bit patterns of |x|.
inline float group_absmax(const float* x) {
  uint32_t best = 0;
  for (size_t j = 0; j < kN; ++j) {
    const uint32_t b = std::bit_cast<uint32_t>(x[j]) & 0x7FFFFFFFu;
    best = b > best ? b : best;
  }
  return std::bit_cast<float>(best);
}

// |x| / amax in [0, 1] from the bits of |x|: a multiply by the reciprocal,
// with the maximum itself exactly 1 (so it codes to the top code and a decode
// then encode keeps the scale: checkpoints round-trip exactly) and nothing
// past 1.
inline float unit(uint32_t abs_bits, uint32_t amax_bits, float inv) {
  const float y = std::bit_cast<float>(abs_bits) * inv;
  return abs_bits == amax_bits ? 1.0f : (y < 1.0f ? y : 1.0f);
}

// Codes of one group of m (signed) from its values, with the group's random words.
inline void encode_group_m(const float* x, uint8_t* codes, float* scale, const uint32_t* rnd) {
  const float amax = group_absmax(x);
  *scale = amax;
  const float inv = 1.0f / (amax > 0.0f ? amax : 1.0f);  // an all-zero group codes to zeros
  const uint32_t amax_bits = amax > 0.0f ? std::bit_cast<uint32_t>(amax) : ~0u;  // ~0u: no element is the maximum
  for (size_t j = 0; j < kN; ++j) {
    const uint32_t bits = std::bit_cast<uint32_t>(x[j]);
    codes[j] = encode_m_unit(unit(bits & 0x7FFFFFFFu, amax_bits, inv), (bits >> 24) & 0x80u, (rnd[j] >> 8) & 0xFFFu);
  }
}
// Codes of one group of sqrt(v) (non-negative).
inline void encode_group_v(const float* s, uint8_t* codes, float* scale, const uint32_t* rnd) {
  const float amax = group_absmax(s);
  *scale = amax;
  const float inv = 1.0f / (amax > 0.0f ? amax : 1.0f);
  const uint32_t amax_bits = amax > 0.0f ? std::bit_cast<uint32_t>(amax) : ~0u;
  for (size_t j = 0; j < kN; ++j) codes[j] = encode_v_unit(unit(std::bit_cast<uint32_t>(s[j]), amax_bits, inv), rnd[j] >> 20);
}

template <class G>
inline float grad_value(const G* g, size_t i) {
  if constexpr (std::is_same_v<G, uint16_t>) return std::bit_cast<float>(uint32_t(g[i]) << 16);
  else return g[i];
}

// AdamW (or Adam) over args.n elements of q8 state: per group, decode, the
// fp32 kernel's arithmetic (host/adam_kernel.h, the same order), encode.
template <bool kAdamW, class G>
void q8_update(const AdamStep& s, const Q8Args& a, const G* g) {
  alignas(64) float p[kN], m[kN], sv[kN];
  alignas(64) uint32_t rnd[kN];
  const Q8View& q = a.state;
  for (size_t base = 0; base < a.n; base += kN) {
    const size_t grp = base / kN;
    const float ms = q.m_scale[grp], vs = q.v_scale[grp];
    const uint16_t* hi = q.hi + base;
    const uint8_t *ext = q.ext + base, *mc = q.m + base, *vc = q.v + base;
    const G* gg = g + base;
    for (size_t j = 0; j < kN; ++j) {
      float pi = decode_master(hi[j], ext[j]);
      float mi = decode_m_unit(mc[j]) * ms;
      const float si = decode_v_unit(vc[j]) * vs;
      float vi = si * si;
      float gi = grad_value(gg, j) * s.grad_scale;
      if constexpr (kAdamW) pi = pi * s.decay;
      else gi = gi + s.l2 * pi;
      mi = s.beta1 * mi + s.one_minus_beta1 * gi;
      vi = s.beta2 * vi + s.one_minus_beta2 * (gi * gi);
      const float root = std::sqrt(vi);
      const float denom = root / s.bc2_sqrt + s.eps;
      p[j] = pi + s.neg_step_size * (mi / denom);
      m[j] = mi;
      sv[j] = root;
      rnd[j] = element_hash(a.first_elem + uint32_t(base + j), a.salt);
    }
    uint16_t* hio = q.hi + base;
    uint8_t* exto = q.ext + base;
    for (size_t j = 0; j < kN; ++j) encode_master(p[j], rnd[j] & 0xFFu, hio[j], exto[j]);
    encode_group_m(m, q.m + base, q.m_scale + grp, rnd);
    encode_group_v(sv, q.v + base, q.v_scale + grp, rnd);
  }
}

template <class G>
void q8_update(const AdamStep& s, const Q8Args& a, const G* g) {
  if (s.adamw) q8_update<true>(s, a, g);
  else q8_update<false>(s, a, g);
}

}  // namespace
}  // namespace strider::detail
