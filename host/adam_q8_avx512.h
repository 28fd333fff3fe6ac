// Internal to host/: the AVX-512 vector type (F + BW + VL + DQ, 16 lanes) of
// the hand-written q8 kernel (adam_q8_simd.h), shared by adam_q8_avx512.cpp
// (this type) and adam_q8_avx512_vbmi.cpp (the same with VBMI's byte
// permutations for the narrowing). In an anonymous namespace like
// adam_q8_simd.h: each of those translation units, built for its own ISA,
// gets its own copy.
#pragma once

#include <immintrin.h>

#include "host/adam_q8_simd.h"

namespace strider::detail {
namespace {

struct Avx512 {
  using F = __m512;
  using I = __m512i;
  using H = __m512i;  // 32 halves
  using M = __mmask16;
  static constexpr size_t kLanes = 16;
  static F set(float x) { return _mm512_set1_ps(x); }
  static I iset(uint32_t x) { return _mm512_set1_epi32(int(x)); }
  static H hset(uint16_t x) { return _mm512_set1_epi16(short(x)); }
  static I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static I load_s8(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I load_u16(const uint16_t* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static H load_u8_h2(const uint8_t* p) {
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static H load_s8_h2(const int8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F load_bf16(const uint16_t* p) { return as_f(sll<16>(load_u16(p))); }
  static F load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static I load(const uint32_t* p) { return _mm512_load_si512(p); }
  static void store(uint32_t* p, I x) { _mm512_store_si512(p, x); }
  // Packs (which saturate as signed, so lanes must hold 0..0xFF) interleave
  // the 128-bit lanes: lane k of the result holds bytes 4k..4k+3 of a, b, c
  // and d in turn, and one permutation puts them back in order.
  static I pack_u8x4(I a, I b, I c, I d) {
    return _mm512_packus_epi16(_mm512_packus_epi32(a, b), _mm512_packus_epi32(c, d));
  }
  static void store_packed_u8x4(uint8_t* p, I bytes) {
    const I order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_si512(p, _mm512_permutexvar_epi32(order, bytes));
  }
  static void store_u8x4(uint8_t* p, I a, I b, I c, I d) { store_packed_u8x4(p, pack_u8x4(a, b, c, d)); }
  static bool any_le_u8(I bytes, uint8_t x) { return _mm512_cmple_epu8_mask(bytes, _mm512_set1_epi8(char(x))) != 0; }
  // Bits 31..16 of a's lanes, then b's: one two-source word permutation
  // (it replaced two shifts, a pack and a permutation: 1.6% of the update).
  static void store_high16x2(uint16_t* p, I a, I b) {
    const I odd_words = _mm512_setr_epi32(0x00030001, 0x00070005, 0x000B0009, 0x000F000D, 0x00130011, 0x00170015,
                                          0x001B0019, 0x001F001D, 0x00230021, 0x00270025, 0x002B0029, 0x002F002D,
                                          0x00330031, 0x00370035, 0x003B0039, 0x003F003D);
    _mm512_storeu_si512(p, _mm512_permutex2var_epi16(a, odd_words, b));
  }
  // Byte 1 of every lane of a, b, c, d in order: a byte shuffle gathers each
  // 128-bit quarter's four into its first lane, and two two-source
  // permutations and an insert put the quarters in order.
  static void store_byte1_x4(uint8_t* p, I a, I b, I c, I d) {
    const I pick = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 5, 9, 13, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    const I firsts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
    const I ab = _mm512_permutex2var_epi32(_mm512_shuffle_epi8(a, pick), firsts, _mm512_shuffle_epi8(b, pick));
    const I cd = _mm512_permutex2var_epi32(_mm512_shuffle_epi8(c, pick), firsts, _mm512_shuffle_epi8(d, pick));
    _mm512_storeu_si512(p, _mm512_inserti64x4(ab, _mm512_castsi512_si256(cd), 1));
  }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }  // a < b ? a : b, as MINPS
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static I cvtt(F a) { return _mm512_cvttps_epi32(a); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I imul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I xor_and(I a, I b, I c) { return _mm512_ternarylogic_epi32(a, b, c, 0x28); }  // (a ^ b) & c
  template <int n> static I srl(I a) { return _mm512_srli_epi32(a, n); }
  template <int n> static I sll(I a) { return _mm512_slli_epi32(a, n); }
  static I max_u(I a, I b) { return _mm512_max_epu32(a, b); }
  // Both reductions share their shuffles: a's and b's 128-bit quarters side
  // by side, then within the quarters.
  static void reduce_max_u2(I a, I b, uint32_t& ra, uint32_t& rb) {
    I x = _mm512_max_epu32(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xEE));  // a01 a23 b01 b23
    x = _mm512_max_epu32(x, _mm512_shuffle_i64x2(x, x, 0xB1));
    x = _mm512_max_epu32(x, _mm512_shuffle_epi32(x, _MM_PERM_BADC));
    x = _mm512_max_epu32(x, _mm512_shuffle_epi32(x, _MM_PERM_CDAB));
    ra = uint32_t(_mm512_cvtsi512_si32(x));
    rb = uint32_t(_mm_cvtsi128_si32(_mm512_extracti32x4_epi32(x, 2)));
  }
  static H hand(H a, H b) { return _mm512_and_si512(a, b); }
  template <int n> static H hsll(H a) { return _mm512_slli_epi16(a, n); }
  static F from_f16_lo(H a) { return _mm512_cvtph_ps(_mm512_castsi512_si256(a)); }
  static F from_f16_hi(H a) { return _mm512_cvtph_ps(_mm512_extracti64x4_epi64(a, 1)); }
  static F as_f(I a) { return _mm512_castsi512_ps(a); }
  static I as_i(F a) { return _mm512_castps_si512(a); }
  static M eq_i(I a, I b) { return _mm512_cmpeq_epi32_mask(a, b); }
  static M lt_f(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M gt_f(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static M le_f(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
  static M mand(M a, M b) { return a & b; }
  static bool any(M m) { return m != 0; }
  static F select(M m, F t, F f) { return _mm512_mask_blend_ps(m, f, t); }
  // One masked multiply: the lanes where x != y get a * b, the others t.
  static F mul_unless_eq(I x, I y, F t, F a, F b) { return _mm512_mask_mul_ps(t, _mm512_cmpneq_epi32_mask(x, y), a, b); }
  static I select(M m, I t, I f) { return _mm512_mask_blend_epi32(m, f, t); }
};

}  // namespace
}  // namespace strider::detail
