// The q8 update for AVX2, 8 lanes: the hand-written kernel (adam_q8_simd.h
// over the vector type below) and the loops of adam_q8_kernel.h as the
// compiler vectorizes them (the kernel before the hand-written one, kept as
// bench_adam's reference and a test's witness). Only called after cpuid said
// yes.
#include <immintrin.h>

#include "host/adam_q8_simd.h"

namespace strider::detail {
namespace {

struct Avx2 {
  using F = __m256;
  using I = __m256i;
  using H = __m256i;  // 16 halves
  using M = __m256i;  // all ones or all zeros per lane
  static constexpr size_t kLanes = 8;
  static F set(float x) { return _mm256_set1_ps(x); }
  static I iset(uint32_t x) { return _mm256_set1_epi32(int(x)); }
  static H hset(uint16_t x) { return _mm256_set1_epi16(short(x)); }
  static I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static I load_s8(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I load_u16(const uint16_t* p) { return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static H load_u8_h2(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static H load_s8_h2(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F load_bf16(const uint16_t* p) { return as_f(sll<16>(load_u16(p))); }
  static F load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static I load(const uint32_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(uint32_t* p, I x) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), x); }
  // Four vectors' lanes of 0..0xFF: the packs interleave the two 128-bit
  // lanes (a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7), one permutation undoes it.
  static I pack_u8x4(I a, I b, I c, I d) {
    return _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
  }
  static void store_packed_u8x4(uint8_t* p, I bytes) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  static void store_u8x4(uint8_t* p, I a, I b, I c, I d) { store_packed_u8x4(p, pack_u8x4(a, b, c, d)); }
  // Unsigned x <= n per byte: min(x, n) == x.
  static bool any_le_u8(I bytes, uint8_t n) {
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_min_epu8(bytes, _mm256_set1_epi8(char(n))), bytes)) != 0;
  }
  // Bits 31..16 of a's lanes, then b's: packus (lanes of 0..0xFFFF) gives
  // a0-3 b0-3 | a4-7 b4-7.
  static void store_high16x2(uint16_t* p, I a, I b) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm256_permute4x64_epi64(_mm256_packus_epi32(srl<16>(a), srl<16>(b)), 0xD8));
  }
  static void store_byte1_x4(uint8_t* p, I a, I b, I c, I d) {
    const I ff = _mm256_set1_epi32(0xFF);
    store_u8x4(p, _mm256_and_si256(srl<8>(a), ff), _mm256_and_si256(srl<8>(b), ff), _mm256_and_si256(srl<8>(c), ff),
               _mm256_and_si256(srl<8>(d), ff));
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }  // a < b ? a : b, as MINPS
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static I cvtt(F a) { return _mm256_cvttps_epi32(a); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I imul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I xor_and(I a, I b, I c) { return _mm256_and_si256(_mm256_xor_si256(a, b), c); }
  template <int n> static I srl(I a) { return _mm256_srli_epi32(a, n); }
  template <int n> static I sll(I a) { return _mm256_slli_epi32(a, n); }
  static I max_u(I a, I b) { return _mm256_max_epu32(a, b); }
  // Both reductions share their shuffles: a's and b's halves side by side.
  static void reduce_max_u2(I a, I b, uint32_t& ra, uint32_t& rb) {
    I x = _mm256_max_epu32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));  // a | b
    x = _mm256_max_epu32(x, _mm256_shuffle_epi32(x, 0x4E));
    x = _mm256_max_epu32(x, _mm256_shuffle_epi32(x, 0xB1));
    ra = uint32_t(_mm256_cvtsi256_si32(x));
    rb = uint32_t(_mm_cvtsi128_si32(_mm256_extracti128_si256(x, 1)));
  }
  static H hand(H a, H b) { return _mm256_and_si256(a, b); }
  template <int n> static H hsll(H a) { return _mm256_slli_epi16(a, n); }
  static F from_f16_lo(H a) { return _mm256_cvtph_ps(_mm256_castsi256_si128(a)); }  // F16C
  static F from_f16_hi(H a) { return _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)); }
  static F as_f(I a) { return _mm256_castsi256_ps(a); }
  static I as_i(F a) { return _mm256_castps_si256(a); }
  static M eq_i(I a, I b) { return _mm256_cmpeq_epi32(a, b); }
  static M lt_f(F a, F b) { return as_i(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
  static M gt_f(F a, F b) { return as_i(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
  static M le_f(F a, F b) { return as_i(_mm256_cmp_ps(a, b, _CMP_LE_OQ)); }
  static M mand(M a, M b) { return _mm256_and_si256(a, b); }
  static bool any(M m) { return _mm256_movemask_epi8(m) != 0; }
  static F select(M m, F t, F f) { return _mm256_blendv_ps(f, t, as_f(m)); }
  static F mul_unless_eq(I x, I y, F t, F a, F b) { return select(eq_i(x, y), t, mul(a, b)); }
  static I select(M m, I t, I f) { return _mm256_blendv_epi8(f, t, m); }
};

}  // namespace

void adam_q8_avx2(const AdamStep& s, const Q8Args& a) {
  if (a.grad_dtype == DType::kBF16) q8_update_simd<Avx2>(s, a, static_cast<const uint16_t*>(a.grad));
  else q8_update_simd<Avx2>(s, a, static_cast<const float*>(a.grad));
}

void adam_q8_avx2_loops(const AdamStep& s, const Q8Args& a) {
  if (a.grad_dtype == DType::kBF16) q8_update(s, a, static_cast<const uint16_t*>(a.grad));
  else q8_update(s, a, static_cast<const float*>(a.grad));
}

}  // namespace strider::detail
