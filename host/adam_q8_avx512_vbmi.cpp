// The hand-written q8 update for AVX-512 with VBMI (Ice Lake and later, AMD
// Zen 4 and later): adam_q8_avx512.h's vector type, but for the narrowing,
// which picks bytes out of 32-bit lanes with one two-source byte permutation
// (vpermt2b) per two vectors where the base type needs packs and shuffles.
// The lanes' values are the base type's; only their route to memory differs,
// so the bits are the same (a test compares every build). What it saves, timed
// in one process against the base type on an AMD EPYC (Zen 4): the codes of m
// and v packed by permutation, m's signs gathered as bytes and merged by one
// ternary-logic op per 32 codes instead of a shift and an or per lane, ext's
// bytes by permutation, and the master decoded from one permutation of its hi
// and ext bytes: 3-4% of the whole update; v's codes left in bits 16..23 of
// their lanes (kVCodeByte, adam_q8_simd.h) and picked from there: 1-2% more.
// Built with -mavx512vbmi; only called after cpuid said the CPU has it
// (adam_q8.cpp).
#include <array>

#include "host/adam_q8_avx512.h"

namespace strider::detail {
namespace {

struct Avx512Vbmi : Avx512 {
  // Byte B of every lane of a, then of b: 32 bytes in the low half.
  template <int B>
  static I bytes_x2(I a, I b) {
    alignas(64) static constexpr auto kIndex = [] {
      std::array<uint8_t, 64> x{};
      for (int i = 0; i < 64; ++i) x[i] = uint8_t(4 * (i % 32) + B);  // 0..63: a's bytes, 64..127: b's
      return x;
    }();
    return _mm512_permutex2var_epi8(a, _mm512_load_si512(kIndex.data()), b);
  }
  // Byte B of every lane of a, b, c, d, in order.
  template <int B>
  static void store_bytes_x4(uint8_t* p, I a, I b, I c, I d) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_castsi512_si256(bytes_x2<B>(a, b)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), _mm512_castsi512_si256(bytes_x2<B>(c, d)));
  }
  template <int B>
  static I pack_bytes_x4(I a, I b, I c, I d) {
    return _mm512_inserti64x4(bytes_x2<B>(a, b), _mm512_castsi512_si256(bytes_x2<B>(c, d)), 1);
  }
  static I pack_u8x4(I a, I b, I c, I d) { return pack_bytes_x4<0>(a, b, c, d); }
  static void store_packed_u8x4(uint8_t* p, I bytes) { _mm512_storeu_si512(p, bytes); }  // already in order
  static void store_u8x4(uint8_t* p, I a, I b, I c, I d) { store_bytes_x4<0>(p, a, b, c, d); }
  static void store_byte1_x4(uint8_t* p, I a, I b, I c, I d) { store_bytes_x4<1>(p, a, b, c, d); }
  // v's codes are in bits 16..23 of their lanes (adam_q8_simd.h, kVCodeByte).
  static constexpr int kVCodeByte = 2;
  static I pack_u8x4_byte2(I a, I b, I c, I d) { return pack_bytes_x4<2>(a, b, c, d); }
  static void store_u8x4_byte2(uint8_t* p, I a, I b, I c, I d) { store_bytes_x4<2>(p, a, b, c, d); }
  // The codes' bytes, and m's top bytes (its sign is their bit 7), merged:
  // code | (top & 0x80), 32 at a time.
  static void store_u8x4_signed(uint8_t* p, I* c, const uint32_t* m) {
    const __m256i sign = _mm256_set1_epi8(char(0x80));
    for (size_t h = 0; h < 2; ++h) {
      const __m256i codes = _mm512_castsi512_si256(bytes_x2<0>(c[2 * h], c[2 * h + 1]));
      const I m0 = load(m + 2 * h * kLanes), m1 = load(m + (2 * h + 1) * kLanes);
      const __m256i tops = _mm512_castsi512_si256(bytes_x2<3>(m0, m1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32 * h), _mm256_ternarylogic_epi32(codes, tops, sign, 0xF8));
    }
  }
  // One permutation puts each lane's hi and ext bytes where hi << 16 | ext << 8
  // has them (byte 0 zeroed by the mask); with ext's top bit flipped first,
  // subtracting 0x8000 makes ext a signed byte: (x ^ 0x80) - 0x80 is its
  // signed value.
  static void load_master_x2(const uint16_t* hi, const uint8_t* ext, F& p0, F& p1) {
    alignas(64) static constexpr auto kIndex = [] {
      std::array<std::array<uint8_t, 64>, 2> x{};
      for (int k = 0; k < 2; ++k)
        for (int i = 0; i < 16; ++i) {
          const int e = 16 * k + i;         // the element: hi at bytes 2e, 2e + 1 of the first table
          x[k][4 * i + 1] = uint8_t(64 + e);  // ext at byte e of the second
          x[k][4 * i + 2] = uint8_t(2 * e);
          x[k][4 * i + 3] = uint8_t(2 * e + 1);
        }
      return x;
    }();
    const I h = _mm512_loadu_si512(hi);
    const I e = _mm512_castsi256_si512(
        _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ext)), _mm256_set1_epi8(char(0x80))));
    const __mmask64 not_byte0 = 0xEEEEEEEEEEEEEEEEull;
    const I bias = iset(0x8000u);
    p0 = as_f(isub(_mm512_maskz_permutex2var_epi8(not_byte0, h, _mm512_load_si512(kIndex[0].data()), e), bias));
    p1 = as_f(isub(_mm512_maskz_permutex2var_epi8(not_byte0, h, _mm512_load_si512(kIndex[1].data()), e), bias));
  }
};

}  // namespace

void adam_q8_avx512_vbmi(const AdamStep& s, const Q8Args& a) {
  if (a.grad_dtype == DType::kBF16) q8_update_simd<Avx512Vbmi>(s, a, static_cast<const uint16_t*>(a.grad));
  else q8_update_simd<Avx512Vbmi>(s, a, static_cast<const float*>(a.grad));
}

}  // namespace strider::detail
