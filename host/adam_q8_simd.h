// Internal to host/: the q8 update of adam_q8_kernel.h written once over a
// vector type V, for the hand-written AVX2 and AVX-512 builds
// (adam_q8_avx2.cpp and adam_q8_avx512.cpp define V from intrinsics and
// instantiate it). Every lane gets exactly the floats the loops give each
// element, in the same order, so the bits are the scalar build's. What
// differs is the instructions, and that is where the time went: the update
// is bound by its count of vector instructions (with both divisions replaced
// by multiplies it ran only 6% faster, and it moves well under the memory
// roofline), so each item below saves instructions:
//   - One pass decodes, updates, hashes and encodes the master with
//     everything in registers, keeping the groups' maxima as a running
//     integer max; only the moments' re-encodings go back over the group
//     (their scale is the group's maximum).
//   - A moment code is a half-precision float: m's sign << 15 | c << 7 and
//     v's c << 6 are exactly the fp16 bits of the values the format defines
//     (c >= 8 or 16: exponent and mantissa; below: fp16's subnormal steps,
//     2^-17 and 2^-18 apart), so the hardware's fp16 conversion (exact, and
//     it ignores denormals-are-zero: a test sets it) decodes them in one
//     instruction. m's
//     bits are its code sign-extended, shifted by 7, with bit 14 cleared.
//   - The master's carry: (hi - (ext >> 7)) << 16 | ext << 8 is
//     hi << 16 + (ext as a signed byte) << 8.
//   - Codes and the master's halves are narrowed several vectors at a
//     time, by packs or byte permutations (V::store_u8x4, store_high16x2,
//     store_byte1_x4); a vector's two moments' codes are widened and decoded
//     together, and two vectors' masters are decoded before either's update
//     (AVX2 ran 4% faster for that order alone).
//   - The hash's first multiply, of consecutive indices, is an add.
//   - The codes below 2^-14 of the scale (a subnormal step, rare) are
//     computed only in a block of four vectors that has one.
//   - |m| is kept from the group's maximum for the encode.
//   - unit()'s clamp and the exponent's rebias leave the common group: where
//     its scale is a normal number at most 2^14, a product abs * inv of an
//     element below the maximum is at most 1 (abs <= pred(amax), and inv is
//     1/amax within half an ulp), so only the maximum needs the select (a
//     masked multiply), and multiplying by inv * 2^-112 instead gives
//     y * 2^-112 exactly, whose bits are y's less the rebias, wherever y is
//     at least 2^-14 (normal both ways). Where y' is at most 2^-126, y may
//     be below 2^-14 (or flushed to zero by FTZ), and that block takes y
//     itself and the subnormal steps. Other groups (NaN, infinite, huge or
//     tiny scales) keep the select, the clamp and the rebias.
//   - The hash's slices are cut by ternary logic ((x ^ x >> 16) & mask, with
//     the last xor of mix32 folded in); v's slice is x's bits 20..31, which
//     that xor does not touch.
//   - A root's sign bit is 0 (v >= +0) except on a NaN, so the group's
//     maximum takes the roots' bits unmasked, and a group whose maximum says
//     NaN or infinity takes it again over |root|.
//
// V provides, with F a vector of floats, I of 32-bit integers, H of twice as
// many 16-bit integers (two vectors' codes), and M a mask:
//   kLanes; F set(float); I iset(uint32_t); H hset(uint16_t); I iota() (0, 1, ...)
//   I load_s8(const int8_t*) (sign-extended), load_u16(const uint16_t*):
//   widened to lanes; H load_u8_h2(const uint8_t*), load_s8_h2(const int8_t*);
//   F load_bf16(const uint16_t*), load_f32(const float*)
//   I load(const uint32_t*), store(uint32_t*, I): aligned
//   store_high16x2(uint16_t*, I, I): two vectors' lanes' bits 31..16;
//   store_u8x4(uint8_t*, I, I, I, I): four vectors of lanes of 0..0xFF; the
//   same in two steps: I pack_u8x4(I, I, I, I) (bytes in any order),
//   store_packed_u8x4(uint8_t*, I); bool any_le_u8(I, uint8_t) (of the bytes);
//   store_byte1_x4(uint8_t*, I, I, I, I): bits 15..8 of four vectors' lanes
//   F arithmetic: add mul div sqrt min cvt (int -> float) cvtt (float -> int,
//   truncating); I: iadd isub imul (low 32 bits) and_ or_ xor_ srl<n> sll<n>
//   max_u (unsigned), reduce_max_u2(I, I, uint32_t&, uint32_t&) (each one's
//   largest lane); H: hand hsll<n>; F from_f16_lo(H),
//   from_f16_hi(H) (the first and second vector's halves)
//   as_f, as_i (bit casts); M lt_f, le_f, gt_f (ordered), eq_i, mand; bool any(M);
//   select(M, t, f) for F and I: t where the mask is set; I xor_and(a, b, c):
//   (a ^ b) & c; F mul_unless_eq(I x, I y, F t, F a, F b): t where x == y,
//   else a * b
// and may provide, where it has a shorter way (adam_q8_avx512_vbmi.cpp):
//   load_master_x2(const uint16_t* hi, const uint8_t* ext, F& p0, F& p1): two
//   vectors' masters decoded; store_u8x4_signed(uint8_t*, I* c, const
//   uint32_t* m): store_u8x4 of four vectors' m codes with the sign of the
//   elements of m (bit 31) set as bit 7; kVCodeByte = 2 with
//   pack_u8x4_byte2 and store_u8x4_byte2 (pack_u8x4 and store_u8x4 of each
//   lane's bits 16..23): v's codes are left there.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "host/adam_q8_kernel.h"

namespace strider::detail {
namespace {

// mix32 of adam_q8_kernel.h after element_hash's multiply-add (x0), but for
// its last step: the word is x ^ (x >> 16) of what this returns.
template <class V>
inline typename V::I simd_mix_but_last(typename V::I x) {
  x = V::xor_(x, V::template srl<16>(x));
  x = V::imul(x, V::iset(0x7FEB352Du));
  x = V::xor_(x, V::template srl<15>(x));
  return V::imul(x, V::iset(0x846CA68Bu));
}

// The group's scale and the inputs of unit(): as encode_group_m / _v.
struct GroupScale {
  float scale, inv;
  uint32_t amax_bits;
};
inline GroupScale group_scale(uint32_t max_abs_bits) {
  const float amax = std::bit_cast<float>(max_abs_bits);
  return {amax, 1.0f / (amax > 0.0f ? amax : 1.0f), amax > 0.0f ? max_abs_bits : ~0u};
}

template <class V, bool kAdamW, class G>
void q8_update_simd(const AdamStep& s, const Q8Args& a, const G* g) {
  using F = typename V::F;
  using I = typename V::I;
  constexpr size_t L = V::kLanes;
  static_assert(kN % (4 * L) == 0);  // the narrowing goes four vectors at a time
  constexpr uint32_t kHashMul = 0x9E3779B1u;  // element_hash's
  const F scale = V::set(s.grad_scale), decay = V::set(s.decay), l2 = V::set(s.l2), b1 = V::set(s.beta1),
          omb1 = V::set(s.one_minus_beta1), b2 = V::set(s.beta2), omb2 = V::set(s.one_minus_beta2),
          nstep = V::set(s.neg_step_size), bc2 = V::set(s.bc2_sqrt), eps = V::set(s.eps);
  const I lane_mul = V::imul(V::iota(), V::iset(kHashMul)), abs_mask = V::iset(0x7FFFFFFFu),
          low8 = V::iset(0xFFu), rebias = V::iset(kRebias);
  const F one = V::set(1.0f), tiny = V::set(kTwoToMinus14), r_unit = V::set(0x1p-12f);
  // unit()'s 1 and 2^-14 times 2^-112 (the common group's scaled products).
  const F scaled_one = V::set(0x1p-112f), scaled_tiny = V::set(0x1p-126f);
  const I m_bits = V::iset(0xFFF00u);  // m's slice of the hash word
  // Per element of the group: m's bits and |m|'s, sqrt(v)'s, the hash's
  // slice for m (bits 8..19 of its word) and its x (bits 20..31 for v), and
  // the master's bits with its random byte added.
  alignas(64) uint32_t m[kN], m_abs[kN], sv[kN], rm[kN], rx[kN], mv[kN];
  // Locals: a byte store may alias anything, so fields read through `a`
  // would be reloaded after every store.
  uint16_t* const hi = a.state.hi;
  uint8_t *const ext = a.state.ext, *const mq = a.state.m, *const vq = a.state.v;
  float *const m_scale = a.state.m_scale, *const v_scale = a.state.v_scale;
  const uint32_t first = a.first_elem, salt = a.salt;
  // Where v's codes come out of the encode: in bits 0..7 of their lanes, or
  // (V::kVCodeByte 2) in bits 16..23, which saves two shifts per vector where
  // V narrows by byte permutation (adam_q8_avx512_vbmi.cpp).
  constexpr int kVByte = [] {
    if constexpr (requires { V::kVCodeByte; }) return V::kVCodeByte;
    else return 0;
  }();
  static_assert(kVByte == 0 || kVByte == 2);
  for (size_t base = 0; base < a.n; base += kN) {
    const size_t grp = base / kN;
    const F ms = V::set(m_scale[grp]), vs = V::set(v_scale[grp]);
    I m_max = V::iset(0), v_max = V::iset(0);
    // element_hash's multiply-add of the vector's indices, advanced by an add.
    I hash_in = V::iadd(V::iset((first + uint32_t(base)) * kHashMul + salt), lane_mul);
    // One vector's update from its decoded m and sqrt(v) (mi, si).
    const auto update = [&](size_t j, F mi, F si, F p) {
      const size_t e = base + j;
      F vi = V::mul(si, si);
      F gi;
      if constexpr (std::is_same_v<G, uint16_t>) gi = V::mul(V::load_bf16(g + e), scale);
      else gi = V::mul(V::load_f32(g + e), scale);
      if constexpr (kAdamW) p = V::mul(p, decay);
      else gi = V::add(gi, V::mul(l2, p));
      mi = V::add(V::mul(b1, mi), V::mul(omb1, gi));
      vi = V::add(V::mul(b2, vi), V::mul(omb2, V::mul(gi, gi)));
      const F root = V::sqrt(vi);
      const F denom = V::add(V::div(root, bc2), eps);
      p = V::add(p, V::mul(nstep, V::div(mi, denom)));
      const I x = simd_mix_but_last<V>(hash_in), xs = V::template srl<16>(x);  // the word: x ^ xs
      hash_in = V::iadd(hash_in, V::iset(uint32_t(L) * kHashMul));
      // encode_master, narrowed below: the low byte need not be cleared
      // before the carry add (0x8000 cannot carry out of it).
      V::store(mv + j, V::iadd(V::as_i(p), V::xor_and(x, xs, low8)));
      const I abs = V::and_(V::as_i(mi), abs_mask);
      V::store(m + j, V::as_i(mi));
      V::store(m_abs + j, abs);
      V::store(sv + j, V::as_i(root));
      V::store(rm + j, V::xor_and(x, xs, m_bits));
      if constexpr (kVByte == 2) V::store(rx + j, V::and_(xs, V::iset(0xFFF0u)));  // v's 12 bits << 4
      else V::store(rx + j, x);
      m_max = V::max_u(m_max, abs);
      v_max = V::max_u(v_max, V::as_i(root));  // a root is >= +0 but for a NaN's sign (below)
    };
    for (size_t j = 0; j < kN; j += 2 * L) {
      const auto mcode = V::load_s8_h2(reinterpret_cast<const int8_t*>(mq + base + j));
      const auto vcode = V::template hsll<6>(V::load_u8_h2(vq + base + j));
      const auto mhalf = V::hand(V::template hsll<7>(mcode), V::hset(0xBFFFu));
      F p0, p1;
      if constexpr (requires { V::load_master_x2(hi, ext, p0, p1); }) {
        V::load_master_x2(hi + base + j, ext + base + j, p0, p1);
      } else {  // hi << 16 plus ext, a signed byte, << 8
        const auto master = [&](size_t e) {
          return V::as_f(V::iadd(V::template sll<16>(V::load_u16(hi + e)),
                                 V::template sll<8>(V::load_s8(reinterpret_cast<const int8_t*>(ext + e)))));
        };
        p0 = master(base + j);
        p1 = master(base + j + L);
      }
      update(j, V::mul(V::from_f16_lo(mhalf), ms), V::mul(V::from_f16_lo(vcode), vs), p0);
      update(j + L, V::mul(V::from_f16_hi(mhalf), ms), V::mul(V::from_f16_hi(vcode), vs), p1);
    }
    for (size_t j = 0; j < kN; j += 4 * L) {
      const I w[4] = {V::load(mv + j), V::load(mv + j + L), V::load(mv + j + 2 * L), V::load(mv + j + 3 * L)};
      const I carry = V::iset(0x8000u);
      V::store_high16x2(hi + base + j, V::iadd(w[0], carry), V::iadd(w[1], carry));
      V::store_high16x2(hi + base + j + 2 * L, V::iadd(w[2], carry), V::iadd(w[3], carry));
      V::store_byte1_x4(ext + base + j, w[0], w[1], w[2], w[3]);  // bits 15..8
    }
    uint32_t m_top, v_top;
    V::reduce_max_u2(m_max, v_max, m_top, v_top);
    if (v_top >= 0x7F800000u) [[unlikely]] {  // NaN or infinity: the largest |root|, as group_absmax takes it
      v_top = 0;
      for (size_t j = 0; j < kN; ++j) v_top = std::max(v_top, sv[j] & 0x7FFFFFFFu);
    }
    const GroupScale gm = group_scale(m_top), gv = group_scale(v_top);
    m_scale[grp] = gm.scale;
    v_scale[grp] = gv.scale;
    // The codes of one moment, four vectors at a time: `bits` its elements'
    // (|m|, sqrt(v)), `code` the magnitude's code from unit()'s value (its
    // bits less the rebias, in kScaled's case already) and the element's
    // index, `small` the code below 2^-14 of the scale from unit()'s value
    // (the subnormal steps), all under one test of the four vectors (y is
    // never NaN: unit() clamps it, and the scaled product's inputs are
    // finite, so the minimum sees every lane). kScaled: the common group
    // (the header comment); its test also takes y' = 2^-126, whose y may lie
    // just below 2^-14, and there computes y itself. kCodeTest > 0 (v's, in
    // the common group): the test is any packed code <= kCodeTest (a y' at
    // most 2^-126 codes to at most 16; a few larger y' do too, and take the
    // exact test), one byte compare instead of the minimum's three, and the
    // packed codes are stored at out + j as they are.
    const auto encode = [&]<bool kScaled, int kCodeTest>(const uint32_t* bits, const GroupScale& gs, auto code,
                                                          auto small, auto store, uint8_t* out) {
      const F inv = V::set(gs.inv), inv_scaled = V::set(gs.inv * 0x1p-112f);
      const I amax = V::iset(gs.amax_bits);
      const auto unit = [&](size_t i) {  // y, exactly as unit()
        const I b = V::load(bits + i);
        if constexpr (kScaled) return V::mul_unless_eq(b, amax, one, V::as_f(b), inv);
        else return V::select(V::eq_i(b, amax), one, V::min(V::mul(V::as_f(b), inv), one));
      };
      for (size_t j = 0; j < kN; j += 4 * L) {
        F y[4];
        I c[4];
        for (size_t k = 0; k < 4; ++k) {
          const size_t i = j + k * L;
          if constexpr (kScaled) {
            const I b = V::load(bits + i);
            y[k] = V::mul_unless_eq(b, amax, scaled_one, V::as_f(b), inv_scaled);
            c[k] = code(i, V::as_i(y[k]));
          } else {
            y[k] = unit(i);
            c[k] = code(i, V::isub(V::as_i(y[k]), rebias));
          }
        }
        bool rare;
        if constexpr (kCodeTest > 0) {
          static_assert(kScaled);
          I packed;
          if constexpr (kVByte == 2) packed = V::pack_u8x4_byte2(c[0], c[1], c[2], c[3]);
          else packed = V::pack_u8x4(c[0], c[1], c[2], c[3]);
          rare = V::any_le_u8(packed, uint8_t(kCodeTest));
          if (!rare) [[likely]] V::store_packed_u8x4(out + j, packed);
        } else {
          const F lowest = V::min(V::min(y[0], y[1]), V::min(y[2], y[3]));
          rare = V::any(kScaled ? V::le_f(lowest, scaled_tiny) : V::lt_f(lowest, tiny));
          if (!rare) [[likely]] store(j, c);
        }
        if (rare) [[unlikely]] {
          for (size_t k = 0; k < 4; ++k) {
            const F yk = kScaled ? unit(j + k * L) : y[k];
            c[k] = V::select(V::lt_f(yk, tiny), small(j + k * L, yk), c[k]);
          }
          store(j, c);
        }
      }
    };
    // m: sign | magnitude (encode_group_m).
    const auto m_code = [&](size_t i, I rebiased) { return V::template srl<20>(V::iadd(rebiased, V::load(rm + i))); };
    const auto m_small = [&](size_t i, F y) {
      const I r12 = V::template srl<8>(V::load(rm + i));
      return V::cvtt(V::add(V::mul(y, V::set(131072.0f)), V::mul(V::cvt(r12), r_unit)));
    };
    const auto m_store = [&](size_t j, I* c) {
      if constexpr (requires { V::store_u8x4_signed(mq, c, m); }) {
        V::store_u8x4_signed(mq + base + j, c, m + j);
      } else {
        for (size_t k = 0; k < 4; ++k)
          c[k] = V::or_(c[k], V::and_(V::template srl<24>(V::load(m + j + k * L)), V::iset(0x80u)));
        V::store_u8x4(mq + base + j, c[0], c[1], c[2], c[3]);
      }
    };
    // v: magnitude, never 0 for a nonzero sqrt(v) (encode_group_v).
    const auto v_code = [&](size_t i, I rebiased) {
      // The code is (y + (r12 << 7)) >> 19, which is ((y >> 3) + (r12 << 4))
      // >> 16: r12 << 7 has no bits below 7, so dropping y's three lowest
      // first changes no carry into bit 19. kVByte 2 keeps the sum, the code
      // in its bits 16..23 (y's bits here, less the rebias where it applies).
      if constexpr (kVByte == 2) return V::iadd(V::template srl<3>(rebiased), V::load(rx + i));
      else return V::template srl<19>(V::iadd(rebiased, V::template sll<7>(V::template srl<20>(V::load(rx + i)))));
    };
    const auto v_small = [&](size_t i, F y) {
      const I r12 = kVByte == 2 ? V::template srl<4>(V::load(rx + i)) : V::template srl<20>(V::load(rx + i));
      const I c = V::cvtt(V::add(V::mul(y, V::set(262144.0f)), V::mul(V::cvt(r12), r_unit)));
      const I code =
          V::or_(c, V::select(V::mand(V::eq_i(c, V::iset(0)), V::gt_f(y, V::set(0.0f))), V::iset(1), V::iset(0)));
      if constexpr (kVByte == 2) return V::template sll<16>(code);
      else return code;
    };
    const auto v_store = [&](size_t j, I* c) {
      if constexpr (kVByte == 2) V::store_u8x4_byte2(vq + base + j, c[0], c[1], c[2], c[3]);
      else V::store_u8x4(vq + base + j, c[0], c[1], c[2], c[3]);
    };
    // The common group: a normal, finite scale (group_scale makes a NaN's
    // reciprocal 1) whose reciprocal is at least 2^-14, so that inv * 2^-112
    // is normal and exact.
    const auto common = [](uint32_t top, const GroupScale& gs) {
      return top >= 0x00800000u && top < 0x7F800000u && gs.inv >= 0x1p-14f;
    };
    uint8_t* const m_out = mq + base;
    uint8_t* const v_out = vq + base;
    if (!common(m_top, gm)) [[unlikely]] encode.template operator()<false, 0>(m_abs, gm, m_code, m_small, m_store, m_out);
    else encode.template operator()<true, 0>(m_abs, gm, m_code, m_small, m_store, m_out);
    if (!common(v_top, gv)) [[unlikely]] encode.template operator()<false, 0>(sv, gv, v_code, v_small, v_store, v_out);
    else encode.template operator()<true, 16>(sv, gv, v_code, v_small, v_store, v_out);
  }
}

template <class V, class G>
void q8_update_simd(const AdamStep& s, const Q8Args& a, const G* g) {
  if (s.adamw) q8_update_simd<V, true>(s, a, g);
  else q8_update_simd<V, false>(s, a, g);
}

}  // namespace
}  // namespace strider::detail
