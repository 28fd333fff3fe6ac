// bench_transfer: what the sliding window's copies get on this GPU.
//
//   1. H2D and D2H through the Device seam (cudaMemcpyAsync from registered
//      pinned memory on the h2d / d2h streams), against the baseline measured
//      in the same run: plain synchronous cudaMemcpy from the same pinned
//      memory (the peak), and from pageable memory (what not pinning costs).
//   2. Overlap: an H2D on the h2d stream alongside bf16 matmuls (cuBLAS) on the
//      compute stream. overlap = hidden time / the shorter of the two: 1.0 means
//      the copy is fully hidden behind compute, 0.0 that they serialise.
//   3. H2D and D2H at once (PCIe is full duplex; the window needs both).
//
// Prints figures and ends with ONE JSON line (also written to --out FILE).
// Never fails on speed; without a GPU it says why and prints a "skipped" line.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "gpu/device/cuda_check.h"
#include "gpu/device/cuda_device.h"
#include "gpu/device/device.h"
#include "host/error.h"
#include "host/pinned_arena.h"

using namespace strider;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Best of `reps` timings of `fn` (which must synchronize), after one warm-up.
template <class F>
double best_seconds(int reps, F&& fn) {
  fn();
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_s();
    fn();
    best = std::min(best, now_s() - t0);
  }
  return best;
}

void emit(const std::string& json, const std::string& out_path) {
  std::printf("%s\n", json.c_str());
  if (!out_path.empty()) std::ofstream(out_path) << json << "\n";
}

}  // namespace

int main(int argc, char** argv) try {
  size_t mib = 256;
  int reps = 5;
  std::string out_path;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--mib" && i + 1 < argc) mib = std::stoul(argv[++i]);
    else if (a == "--reps" && i + 1 < argc) reps = std::stoi(argv[++i]);
    else if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_transfer [--mib N] [--reps N] [--out FILE]\n");
      return 2;
    }
  }
  const CudaProbe probe = probe_cuda();
  if (probe.device_count == 0) {
    std::printf("bench_transfer: skipped: %s\n", probe.reason.c_str());
    emit(fmt::format(R"({{"bench":"transfer","skipped":true,"reason":"{}"}})", probe.reason), out_path);
    return 0;
  }

  DeviceOptions opts;
  opts.spec = "cuda:0";
  auto dev = make_device(opts);
  const size_t bytes = mib << 20;
  std::printf("bench_transfer on %s: %zu MiB per copy, best of %d\n", dev->name().c_str(), mib, reps);

  ArenaOptions ao;
  ao.lock = LockPolicy::kNone;  // cudaHostRegister pins the pages itself
  ao.name = "bench pinned";
  PinnedArena arena(2 * bytes + (size_t{4} << 20), ao);
  arena.attach(dev->host_registrar());
  auto host_a = arena.carve(bytes, 4096, "h2d source");
  auto host_b = arena.carve(bytes, 4096, "d2h target");
  std::memset(host_a.data(), 1, bytes);
  std::vector<std::byte> pageable(bytes, std::byte{2});
  DeviceBuffer dbuf_a = dev->allocate(bytes, "copy target");
  DeviceBuffer dbuf_b = dev->allocate(bytes, "copy source");
  const double gb = bytes / 1e9;

  // --- 1. bandwidth: the baseline, then the seam.
  const double t_memcpy_h2d = best_seconds(reps, [&] {
    STRIDER_CUDA_CHECK(cudaMemcpy(dbuf_a.data(), host_a.data(), bytes, cudaMemcpyHostToDevice));
  });
  const double t_memcpy_d2h = best_seconds(reps, [&] {
    STRIDER_CUDA_CHECK(cudaMemcpy(host_b.data(), dbuf_b.data(), bytes, cudaMemcpyDeviceToHost));
  });
  const double t_pageable_h2d = best_seconds(reps, [&] {
    STRIDER_CUDA_CHECK(cudaMemcpy(dbuf_a.data(), pageable.data(), bytes, cudaMemcpyHostToDevice));
  });
  const double t_h2d = best_seconds(reps, [&] {
    dev->copy_h2d(StreamId::kH2D, dbuf_a.data(), host_a.data(), bytes, OpTag{"h2d"});
    dev->synchronize(StreamId::kH2D);
  });
  const double t_d2h = best_seconds(reps, [&] {
    dev->copy_d2h(StreamId::kD2H, host_b.data(), dbuf_b.data(), bytes, OpTag{"d2h"});
    dev->synchronize(StreamId::kD2H);
  });
  const double t_bidir = best_seconds(reps, [&] {
    dev->copy_h2d(StreamId::kH2D, dbuf_a.data(), host_a.data(), bytes, OpTag{"h2d"});
    dev->copy_d2h(StreamId::kD2H, host_b.data(), dbuf_b.data(), bytes, OpTag{"d2h"});
    dev->synchronize();
  });
  std::printf("  plain cudaMemcpy (pinned)  H2D %7.2f GB/s   D2H %7.2f GB/s   <- baseline peak\n",
              gb / t_memcpy_h2d, gb / t_memcpy_d2h);
  std::printf("  plain cudaMemcpy (pageable) H2D %6.2f GB/s\n", gb / t_pageable_h2d);
  std::printf("  seam copy_h2d / copy_d2h   H2D %7.2f GB/s   D2H %7.2f GB/s   (%.0f%% / %.0f%% of peak)\n",
              gb / t_h2d, gb / t_d2h, 100 * t_memcpy_h2d / t_h2d, 100 * t_memcpy_d2h / t_d2h);
  std::printf("  H2D + D2H at once          %7.2f GB/s total\n", 2 * gb / t_bidir);

  // --- 2. overlap of a copy with matmuls on the compute stream.
  const int n = 4096;
  const size_t mat_bytes = size_t{n} * n * 2;
  DeviceBuffer ma = dev->allocate(mat_bytes, "matmul A");
  DeviceBuffer mb = dev->allocate(mat_bytes, "matmul B");
  DeviceBuffer mc = dev->allocate(mat_bytes, "matmul C");
  STRIDER_CUDA_CHECK(cudaMemset(ma.data(), 0, mat_bytes));
  STRIDER_CUDA_CHECK(cudaMemset(mb.data(), 0, mat_bytes));
  cublasHandle_t handle = nullptr;
  STRIDER_CUBLAS_CHECK(cublasCreate(&handle));
  const double flops_per_mm = 2.0 * n * n * n;
  auto enqueue_matmuls = [&](int count) {
    for (int i = 0; i < count; ++i) {
      dev->launch(StreamId::kCompute, OpTag{"gemm", -1, flops_per_mm}, [&](const LaunchContext& ctx) {
        const float alpha = 1.0f, beta = 0.0f;
        STRIDER_CUBLAS_CHECK(cublasSetStream(handle, static_cast<cudaStream_t>(ctx.native_stream)));
        STRIDER_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, ma.data(), CUDA_R_16BF,
                                          n, mb.data(), CUDA_R_16BF, n, &beta, mc.data(), CUDA_R_16BF, n,
                                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      });
    }
  };
  const double t_one_mm = best_seconds(reps, [&] {
    enqueue_matmuls(1);
    dev->synchronize(StreamId::kCompute);
  });
  // As many matmuls as take about as long as the copy: the hardest case to hide.
  const int mm_count = std::max(1, static_cast<int>(t_h2d / t_one_mm + 0.5));
  const double t_mm = best_seconds(reps, [&] {
    enqueue_matmuls(mm_count);
    dev->synchronize(StreamId::kCompute);
  });
  const double t_both = best_seconds(reps, [&] {
    dev->copy_h2d(StreamId::kH2D, dbuf_a.data(), host_a.data(), bytes, OpTag{"h2d"});
    enqueue_matmuls(mm_count);
    dev->synchronize();
  });
  cublasDestroy(handle);
  const double hidden = t_h2d + t_mm - t_both;
  const double overlap = std::clamp(hidden / std::min(t_h2d, t_mm), 0.0, 1.0);
  const double tflops = flops_per_mm / t_one_mm / 1e12;
  std::printf("  bf16 gemm %dx%dx%d: %.3f ms (%.1f TFLOP/s); %d of them: %.2f ms\n", n, n, n, t_one_mm * 1e3,
              tflops, mm_count, t_mm * 1e3);
  std::printf("  copy alone %.2f ms, matmuls alone %.2f ms, together %.2f ms -> overlap %.2f (1.0 = copy hidden)\n",
              t_h2d * 1e3, t_mm * 1e3, t_both * 1e3, overlap);
  std::printf("  peak device bytes %zu\n", dev->peak_allocated_bytes());

  emit(fmt::format(
           R"({{"bench":"transfer","device":"{}","bytes":{},"memcpy_h2d_gbps":{:.3f},"memcpy_d2h_gbps":{:.3f},)"
           R"("pageable_h2d_gbps":{:.3f},"h2d_gbps":{:.3f},"d2h_gbps":{:.3f},"bidir_gbps":{:.3f},)"
           R"("gemm_tflops":{:.2f},"matmuls":{},"copy_ms":{:.3f},"matmul_ms":{:.3f},"both_ms":{:.3f},"overlap":{:.3f}}})",
           dev->name(), bytes, gb / t_memcpy_h2d, gb / t_memcpy_d2h, gb / t_pageable_h2d, gb / t_h2d, gb / t_d2h,
           2 * gb / t_bidir, tflops, mm_count, t_h2d * 1e3, t_mm * 1e3, t_both * 1e3, overlap),
       out_path);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_transfer: %s\n", e.what());
  return 1;
}
