// The q8 codec and kernel. Codes are built from float bit patterns, so the
// maths is integer shifts and adds plus the fp32 kernel's float operations:
//   m code   sign | magnitude c in 0..120 of |m| / scale in [0, 1]:
//            c >= 8: exponent field c >> 3 (bias 15), 3 mantissa bits (c = 120 is 1.0)
//            c <  8: c * 2^-17 (the subnormal steps below 2^-14)
//   v code   magnitude c in 0..240 of sqrt(v) / scale in [0, 1]:
//            c >= 16: exponent field c >> 4 (bias 15), 4 mantissa bits (c = 240 is 1.0)
//            c <  16: c * 2^-18; a nonzero sqrt(v) never codes to 0, so the
//            denominator of an update is never smaller than the truth allows
//   scale    the group's largest |m| (or sqrt(v)); y = |x| / scale is exact
//            at the maximum (1.0), so decode(encode) keeps the scale and a
//            checkpoint's round trip through floats is exact.
//   master   bits(p) + r (r < 256), low 8 bits dropped: V; hi = (V + 0x8000) >> 16
//            (nearest, ties up), ext = bits 15..8 of V. Decoding undoes the
//            carry: high half = hi - (ext >= 0x80).
// Stochastic rounding adds a random value below the dropped bits' unit
// before truncating: 8 bits of the element's hash for the master, 12 for m,
// 12 for v. Nearest rounding adds half of it. The element operations and the
// group update are in adam_q8_kernel.h, built here for the scalar ISA and in
// adam_q8_avx2.cpp / adam_q8_avx512.cpp for those, which also hold the
// hand-written kernels (adam_q8_simd.h).
#include "host/adam_q8.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "host/adam_q8_kernel.h"
#include "host/error.h"

namespace strider {
namespace detail {
// The ISA builds (adam_q8_avx2.cpp, adam_q8_avx512.cpp, adam_q8_avx512_vbmi.cpp): hand-written, and the loops.
void adam_q8_avx2(const AdamStep& s, const Q8Args& a);
void adam_q8_avx512(const AdamStep& s, const Q8Args& a);
void adam_q8_avx512_vbmi(const AdamStep& s, const Q8Args& a);
void adam_q8_avx2_loops(const AdamStep& s, const Q8Args& a);
void adam_q8_avx512_loops(const AdamStep& s, const Q8Args& a);
}  // namespace detail

namespace {

void check_groups(size_t n, const char* what) {
  STRIDER_CHECK(n % kQ8GroupElems == 0, "q8 {}: {} elements are not a whole number of groups of {}", what, n,
                kQ8GroupElems);
}

// AVX-512 VBMI (vpermt2b), which the AVX-512 kernel uses where it can.
bool has_vbmi() { return __builtin_cpu_supports("avx512vbmi"); }

void adam_q8_scalar(const AdamStep& s, const Q8Args& a) {
  if (a.grad_dtype == DType::kBF16) detail::q8_update(s, a, static_cast<const uint16_t*>(a.grad));
  else detail::q8_update(s, a, static_cast<const float*>(a.grad));
}

}  // namespace

uint32_t q8_salt(int64_t step, int64_t block) {
  using detail::mix32;
  return mix32(uint32_t(step) * 0x85EBCA6Bu ^ mix32(uint32_t(block) + 0x5BD1E995u) ^ uint32_t(uint64_t(step) >> 32));
}

void adam_q8_update(Isa isa, const AdamStep& step, const Q8Args& a, Q8Build build) {
  check_groups(a.n, "AdamW");
  STRIDER_CHECK(a.grad_dtype == DType::kBF16 || a.grad_dtype == DType::kF32,
                "no q8 AdamW kernel for gradient dtype {} (gradients must be BF16 or F32)", dtype_name(a.grad_dtype));
  STRIDER_CHECK(isa_supported(isa), "q8 AdamW kernel for {} requested but this CPU lacks it", isa_name(isa));
  if (a.n == 0) return;
  const Q8View& q = a.state;
  STRIDER_CHECK(q.hi && q.ext && q.m && q.m_scale && q.v && q.v_scale && a.grad,
                "q8 AdamW over {} elements given a null pointer", a.n);
  switch (isa) {
    case Isa::kAvx512:
      if (build == Q8Build::kLoops) detail::adam_q8_avx512_loops(step, a);
      else if (build == Q8Build::kSimd && has_vbmi()) detail::adam_q8_avx512_vbmi(step, a);
      else detail::adam_q8_avx512(step, a);
      break;
    case Isa::kAvx2:
      if (build == Q8Build::kLoops) detail::adam_q8_avx2_loops(step, a);
      else detail::adam_q8_avx2(step, a);
      break;
    case Isa::kScalar: adam_q8_scalar(step, a); break;
  }
}

std::string q8_kernel_name(Isa isa, Q8Build build) {
  if (isa == Isa::kScalar || build == Q8Build::kLoops) return fmt::format("{} loops", isa_name(isa));
  const bool vbmi = isa == Isa::kAvx512 && build == Q8Build::kSimd && has_vbmi();
  return fmt::format("{}{} hand-written", isa_name(isa), vbmi ? "+vbmi" : "");
}

void q8_encode_master(const float* in, uint16_t* hi, uint8_t* ext, size_t n) {
  for (size_t i = 0; i < n; ++i) detail::encode_master(in[i], detail::kHalfWord & 0xFFu, hi[i], ext[i]);
}

void q8_decode_master(const uint16_t* hi, const uint8_t* ext, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = detail::decode_master(hi[i], ext[i]);
}

void q8_encode_moment(StateKind kind, const float* in, uint8_t* codes, float* scales, size_t n) {
  check_groups(n, "encode");
  STRIDER_CHECK(kind != StateKind::kMaster, "q8_encode_moment: the master has its own encoding");
  constexpr size_t N = kQ8GroupElems;
  uint32_t rnd[N];
  std::fill(rnd, rnd + N, detail::kHalfWord);
  float x[N];
  for (size_t base = 0; base < n; base += N) {
    if (kind == StateKind::kAdamM) {
      detail::encode_group_m(in + base, codes + base, scales + base / N, rnd);
    } else {
      for (size_t j = 0; j < N; ++j) {
        STRIDER_CHECK(!(in[base + j] < 0.0f), "q8 encode: Adam v[{}] = {} is negative", base + j, in[base + j]);
        x[j] = std::sqrt(in[base + j]);
      }
      detail::encode_group_v(x, codes + base, scales + base / N, rnd);
    }
  }
}

void q8_decode_moment(StateKind kind, const uint8_t* codes, const float* scales, float* out, size_t n) {
  check_groups(n, "decode");
  for (size_t i = 0; i < n; ++i) {
    const float s = scales[i / kQ8GroupElems];
    if (kind == StateKind::kAdamM) {
      out[i] = detail::decode_m_unit(codes[i]) * s;
    } else {
      const float r = detail::decode_v_unit(codes[i]) * s;
      out[i] = r * r;
    }
  }
}

}  // namespace strider
