// CpuAdam: AdamW (and L2 Adam) over one block's flat fp32 master/m/v, reading
// the gradient in bf16 or fp32 and writing the new bf16 (or fp16) compute copy in the
// same pass, so the state is streamed through memory exactly once per step.
//
// Run-time dispatch AVX-512 / AVX2 / scalar (every SIMD kernel is bit-identical
// to the scalar reference); oneTBB parallel over cache-friendly chunks, with a
// callback per finished chunk so a copy of that chunk can start before the
// whole block is done.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "host/dtype.h"

namespace strider {

struct Q8Args;  // host/adam_q8.h

enum class AdamMode {
  kAdamW,  // decoupled weight decay: p *= 1 - lr * wd (torch.optim.AdamW)
  kAdam,   // L2: g += wd * p (torch.optim.Adam with weight_decay)
};

// The optimizer's hyper-parameters, in double as the user gave them (torch
// computes its bias corrections from Python floats, i.e. doubles).
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  AdamMode mode = AdamMode::kAdamW;
};

// The per-step constants the kernels use, computed once per step in double and
// rounded to float once.
struct AdamStep {
  float grad_scale;      // clipping factor (and 1/accumulation if wanted)
  float decay;           // AdamW: 1 - lr * wd; Adam: 1
  float l2;              // Adam: wd; AdamW: 0
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float neg_step_size;   // -lr / (1 - beta1^t)
  float bc2_sqrt;        // sqrt(1 - beta2^t)
  float eps;
  bool adamw;

  // `step` counts from 1 (the first update is step 1, as in torch).
  static AdamStep make(const AdamHyper& h, int64_t step, double grad_scale = 1.0);
};

// Destination-passing arguments for one flat span of `n` elements.
struct AdamArgs {
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kBF16;   // kBF16 or kF32
  uint16_t* compute_out = nullptr;   // 16-bit copy of the new master; nullptr: none
  size_t n = 0;
  DType compute_dtype = DType::kBF16;  // compute_out's bits: kBF16 or kF16
};

enum class Isa { kScalar, kAvx2, kAvx512 };
// The best ISA this CPU runs (cpuid), or the one STRIDER_ISA=scalar|avx2|avx512 names.
Isa detect_isa();
const char* isa_name(Isa isa);
// Whether this CPU can run `isa`.
bool isa_supported(Isa isa);
// Which build of the q8 kernel (host/adam_q8.h): kSimd, hand-written for AVX2
// and AVX-512 (the scalar ISA has only the loops), on AVX-512 with VBMI's
// byte permutations where the CPU has them; kSimdNoVbmi, the same without
// them (on AVX2 it is kSimd), what a CPU with AVX-512 but not VBMI runs, kept
// so a test checks it on any machine; kLoops, adam_q8_kernel.h's loops as the
// compiler vectorizes them, the kernel before the hand-written one, kept as
// bench_adam's baseline. All give the same bits.
enum class Q8Build { kSimd, kSimdNoVbmi, kLoops };

// One thread, elements [0, args.n): the kernel itself. Throws naming both
// dtypes for an unsupported (gradient, output) pair or an ISA this CPU lacks.
void adam_update(Isa isa, const AdamStep& step, const AdamArgs& args);

class CpuAdam {
 public:
  struct Options {
    int threads = 0;                  // 0: all hardware threads
    size_t chunk_elems = size_t{1} << 16;  // 64 Ki elements = 1.75 MiB of traffic
    Isa isa = detect_isa();
    Q8Build q8_build = Q8Build::kSimd;
  };
  // Called once per finished chunk, from the worker that ran it: [begin, end).
  using ChunkDone = std::function<void(size_t begin, size_t end)>;

  explicit CpuAdam(Options options);
  CpuAdam() : CpuAdam(Options{}) {}
  ~CpuAdam();
  CpuAdam(const CpuAdam&) = delete;
  CpuAdam& operator=(const CpuAdam&) = delete;

  // Updates all `args.n` elements on this optimizer's threads and returns when
  // every chunk is done.
  void step(const AdamStep& step, const AdamArgs& args, const ChunkDone& on_chunk = {});
  // The same over q8 state (host/adam_q8.h): chunks of chunk_elems (a
  // multiple of the format's groups) on this optimizer's threads.
  void step_q8(const AdamStep& step, const Q8Args& args);

  int threads() const { return threads_; }
  Isa isa() const { return options_.isa; }
  size_t chunk_elems() const { return options_.chunk_elems; }

 private:
  Options options_;
  int threads_;
  struct Arena;
  std::unique_ptr<Arena> arena_;  // oneTBB task_arena limiting the thread count
};

}  // namespace strider
