#include "host/cpu_adam.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <string_view>
#include <thread>

#include "host/adam_kernel.h"
#include "host/adam_q8.h"
#include "host/error.h"

namespace strider {

AdamStep AdamStep::make(const AdamHyper& h, int64_t step, double grad_scale) {
  STRIDER_CHECK(step >= 1, "AdamStep: step {} must be >= 1 (the first update is step 1)", step);
  STRIDER_CHECK(h.beta1 >= 0 && h.beta1 < 1 && h.beta2 >= 0 && h.beta2 < 1,
                "Adam betas ({}, {}) must lie in [0, 1)", h.beta1, h.beta2);
  STRIDER_CHECK(h.eps > 0 && h.lr >= 0 && h.weight_decay >= 0,
                "Adam: lr {}, eps {} and weight_decay {} must be non-negative (eps > 0)", h.lr,
                h.eps, h.weight_decay);
  const double bc1 = 1.0 - std::pow(h.beta1, double(step));
  const double bc2 = 1.0 - std::pow(h.beta2, double(step));
  const bool adamw = h.mode == AdamMode::kAdamW;
  AdamStep s;
  s.grad_scale = float(grad_scale);
  s.decay = adamw ? float(1.0 - h.lr * h.weight_decay) : 1.0f;
  s.l2 = adamw ? 0.0f : float(h.weight_decay);
  s.beta1 = float(h.beta1);
  s.one_minus_beta1 = float(1.0 - h.beta1);
  s.beta2 = float(h.beta2);
  s.one_minus_beta2 = float(1.0 - h.beta2);
  s.neg_step_size = float(-h.lr / bc1);
  s.bc2_sqrt = float(std::sqrt(bc2));
  s.eps = float(h.eps);
  s.adamw = adamw;
  return s;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2:  // F16C too: the kernel writes an fp16 compute copy with it
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  return false;
}

Isa detect_isa() {
  if (const char* forced = std::getenv("STRIDER_ISA")) {
    for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
      if (std::string_view(forced) == isa_name(isa)) {
        STRIDER_CHECK(isa_supported(isa), "STRIDER_ISA={} but this CPU does not support it", forced);
        return isa;
      }
    }
    throw Error(fmt::format("STRIDER_ISA={} is not one of scalar, avx2, avx512", forced));
  }
  if (isa_supported(Isa::kAvx512)) return Isa::kAvx512;
  if (isa_supported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

namespace {

// The dispatch table: [isa][gradient dtype]. The output (bf16 or fp16, or none) is an argument.
struct Kernels {
  detail::AdamKernelBf16 bf16;
  detail::AdamKernelF32 f32;
};
constexpr std::array<Kernels, 3> kKernels = {{
    {detail::adam_scalar_bf16, detail::adam_scalar_f32},
    {detail::adam_avx2_bf16, detail::adam_avx2_f32},
    {detail::adam_avx512_bf16, detail::adam_avx512_f32},
}};

void run_kernel(const Kernels& k, const AdamStep& s, const AdamArgs& a, size_t begin, size_t end) {
  float* p = a.master + begin;
  float* m = a.m + begin;
  float* v = a.v + begin;
  uint16_t* out = a.compute_out ? a.compute_out + begin : nullptr;
  const bool f16 = a.compute_dtype == DType::kF16;
  if (a.grad_dtype == DType::kBF16)
    k.bf16(s, p, m, v, static_cast<const uint16_t*>(a.grad) + begin, out, f16, end - begin);
  else
    k.f32(s, p, m, v, static_cast<const float*>(a.grad) + begin, out, f16, end - begin);
}

void check_args(Isa isa, const AdamArgs& a) {
  STRIDER_CHECK((a.grad_dtype == DType::kBF16 || a.grad_dtype == DType::kF32) &&
                    (a.compute_dtype == DType::kBF16 || a.compute_dtype == DType::kF16),
                "no AdamW kernel for gradient dtype {} with output dtype {} (gradients must "
                "be BF16 or F32, the compute copy BF16 or F16)",
                dtype_name(a.grad_dtype), dtype_name(a.compute_dtype));
  STRIDER_CHECK(isa_supported(isa), "AdamW kernel for {} requested but this CPU lacks it",
                isa_name(isa));
  STRIDER_CHECK(a.n == 0 || (a.master && a.m && a.v && a.grad),
                "AdamW over {} elements given a null master, m, v or gradient pointer", a.n);
}

}  // namespace

void adam_update(Isa isa, const AdamStep& step, const AdamArgs& args) {
  check_args(isa, args);
  run_kernel(kKernels[static_cast<size_t>(isa)], step, args, 0, args.n);
}

struct CpuAdam::Arena {
  tbb::task_arena arena;
  explicit Arena(int threads) : arena(threads) {}
};

CpuAdam::CpuAdam(Options options) : options_(options) {
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  threads_ = options_.threads > 0 ? options_.threads : (hw > 0 ? hw : 1);
  STRIDER_CHECK(options_.chunk_elems >= 16 && options_.chunk_elems % 16 == 0,
                "CpuAdam: chunk_elems {} must be a positive multiple of 16", options_.chunk_elems);
  STRIDER_CHECK(isa_supported(options_.isa), "CpuAdam: ISA {} is not supported by this CPU",
                isa_name(options_.isa));
  arena_ = std::make_unique<Arena>(threads_);
}

CpuAdam::~CpuAdam() = default;

void CpuAdam::step(const AdamStep& step, const AdamArgs& args, const ChunkDone& on_chunk) {
  check_args(options_.isa, args);
  const Kernels& k = kKernels[static_cast<size_t>(options_.isa)];
  const size_t chunk = options_.chunk_elems;
  const size_t chunks = (args.n + chunk - 1) / chunk;
  auto body = [&](const tbb::blocked_range<size_t>& r) {
    for (size_t c = r.begin(); c != r.end(); ++c) {
      const size_t begin = c * chunk, end = std::min(args.n, begin + chunk);
      run_kernel(k, step, args, begin, end);
      if (on_chunk) on_chunk(begin, end);
    }
  };
  if (threads_ == 1 || chunks <= 1) {
    body(tbb::blocked_range<size_t>(0, chunks));
    return;
  }
  // One chunk per task: chunks are large (MiBs of traffic), so scheduling cost
  // is noise and the callback fires as soon as each chunk is written.
  arena_->arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, chunks, 1), body, tbb::simple_partitioner());
  });
}

void CpuAdam::step_q8(const AdamStep& step, const Q8Args& args) {
  const size_t chunk = options_.chunk_elems;
  STRIDER_CHECK(chunk % kQ8GroupElems == 0, "CpuAdam: chunk_elems {} is not a multiple of the q8 group ({})", chunk,
                kQ8GroupElems);
  const size_t chunks = (args.n + chunk - 1) / chunk;
  const size_t gbytes = dtype_size(args.grad_dtype);
  auto body = [&](const tbb::blocked_range<size_t>& r) {
    for (size_t c = r.begin(); c != r.end(); ++c) {
      const size_t begin = c * chunk, end = std::min(args.n, begin + chunk), g = begin / kQ8GroupElems;
      Q8Args a = args;
      a.state = {args.state.hi + begin, args.state.ext + begin,     args.state.m + begin,
                 args.state.m_scale + g, args.state.v + begin,       args.state.v_scale + g};
      a.grad = static_cast<const std::byte*>(args.grad) + begin * gbytes;
      a.n = end - begin;
      a.first_elem = args.first_elem + uint32_t(begin);
      adam_q8_update(options_.isa, step, a, options_.q8_build);
    }
  };
  if (threads_ == 1 || chunks <= 1) {
    body(tbb::blocked_range<size_t>(0, chunks));
    return;
  }
  arena_->arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, chunks, 1), body, tbb::simple_partitioner());
  });
}

}  // namespace strider
