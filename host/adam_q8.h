// The q8 optimizer-state format's codec and its AdamW kernel (the format is
// described in host/state_format.h). Destination-passing over raw pointers;
// every count of elements is a multiple of kQ8GroupElems and every pointer
// points at the start of a group.
//
// The update decodes a group's master, m and v to float, runs exactly the
// fp32 kernel's arithmetic on them (host/adam_kernel.h, same order), then
// encodes the group's new values with stochastic rounding. The reference is
// adam_q8_kernel.h's loops, built per ISA (scalar, AVX2, AVX-512; the
// compiler vectorizes them); AVX2 and AVX-512 also have a hand-written
// kernel (adam_q8_simd.h), the default. Every build gives the same bits,
// which a test checks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "host/cpu_adam.h"
#include "host/dtype.h"
#include "host/state_format.h"

namespace strider {

// One span of q8 state: n elements, n / kQ8GroupElems scales per moment.
struct Q8View {
  uint16_t* hi = nullptr;   // the bf16 compute copy: the master's high half
  uint8_t* ext = nullptr;   // the master's 8-bit extension
  uint8_t* m = nullptr;
  float* m_scale = nullptr;
  uint8_t* v = nullptr;     // codes of sqrt(v)
  float* v_scale = nullptr;
};

struct Q8Args {
  Q8View state;
  const void* grad = nullptr;
  DType grad_dtype = DType::kBF16;  // kBF16 or kF32
  size_t n = 0;
  // The index of element 0 within its block and the step's salt
  // (q8_salt(step, block)): what the stochastic rounding hashes, so the bits
  // depend on neither chunking nor placement.
  uint32_t first_elem = 0;
  uint32_t salt = 0;
};

uint32_t q8_salt(int64_t step, int64_t block);

// Elements [0, n) on this thread, with `isa`'s `build` of the kernel (Q8Build: host/cpu_adam.h).
void adam_q8_update(Isa isa, const AdamStep& step, const Q8Args& args, Q8Build build = Q8Build::kSimd);
// The kernel that call runs on this CPU, in words ("avx512+vbmi hand-written", "avx2 loops", ...).
std::string q8_kernel_name(Isa isa, Q8Build build);

// Caller-facing conversions (checkpoint loads, tests): to nearest.
void q8_encode_master(const float* in, uint16_t* hi, uint8_t* ext, size_t n);
void q8_decode_master(const uint16_t* hi, const uint8_t* ext, float* out, size_t n);
// kind kAdamM: the values of m; kAdamV: the values of v (sqrt is taken inside
// encode and squared inside decode).
void q8_encode_moment(StateKind kind, const float* in, uint8_t* codes, float* scales, size_t n);
void q8_decode_moment(StateKind kind, const uint8_t* codes, const float* scales, float* out, size_t n);

}  // namespace strider
