// The CUDA probe, the memory query and the host registrar (gpu/device/cuda_device.h).
// Compiled only when STRIDER_HAVE_CUDA.
#include "gpu/device/cuda_device.h"

#include "gpu/device/cuda_handles.h"

namespace strider {

using cuda_detail::CudaHostRegistrar;
using cuda_detail::CurrentDevice;

CudaProbe probe_cuda() {
  CudaProbe p;
  int n = 0;
  cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    const char* why = rc == cudaErrorInsufficientDriver ? "no usable NVIDIA driver (none, or older than this CUDA runtime)"
                      : rc == cudaErrorNoDevice         ? "no CUDA device"
                                                        : "CUDA is not usable";
    p.reason = fmt::format("{}: cudaGetDeviceCount returned {} ({})", why, cudaGetErrorName(rc),
                           cudaGetErrorString(rc));
    return p;
  }
  p.device_count = n;
  if (n == 0) p.reason = "no CUDA device (cudaGetDeviceCount returned 0)";
  return p;
}

CudaMemory cuda_memory(int ordinal) {
  const CudaProbe probe = probe_cuda();
  STRIDER_CHECK(probe.device_count > 0, "cuda:{}: {}", ordinal, probe.reason);
  STRIDER_CHECK(ordinal >= 0 && ordinal < probe.device_count, "cuda:{} requested but only {} CUDA device(s) exist",
                ordinal, probe.device_count);
  CurrentDevice cd(ordinal);
  CudaMemory m;
  STRIDER_CUDA_CHECK(cudaMemGetInfo(&m.free_bytes, &m.total_bytes));
  return m;
}

std::shared_ptr<MemoryRegistrar> make_cuda_host_registrar() { return std::make_shared<CudaHostRegistrar>(); }

}  // namespace strider
