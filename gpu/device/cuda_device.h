// CudaDevice: the Device seam on the CUDA runtime. Declared without CUDA
// headers; defined in cuda_device.cpp only when STRIDER_HAVE_CUDA (otherwise
// the probe says "built without CUDA" and the factory throws).
//
// Three non-blocking streams (compute, h2d, d2h), CUDA events, cudaMemcpyAsync
// from pinned memory, cudaMalloc for the pool. launch() sets ATen's current
// stream to ours while the closure runs (when built with torch's CUDA half).
#pragma once

#include <memory>
#include <string>

#include "gpu/device/device.h"

namespace strider {

// Whether a GPU is usable, and why not ("no CUDA driver", "no device", "built
// without CUDA"). Never throws.
struct CudaProbe {
  int device_count = 0;
  std::string reason;  // empty when device_count > 0
};
CudaProbe probe_cuda();

// The CUDA device `ordinal`; throws strider::Error when it is not usable.
std::unique_ptr<Device> make_cuda_device(int ordinal, const DeviceOptions& options);

// Memory of CUDA device `ordinal` now (cudaMemGetInfo: its context is made if
// there is none yet, so `free_bytes` is net of it); throws strider::Error when
// the device is not usable.
struct CudaMemory {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};
CudaMemory cuda_memory(int ordinal);

// A MemoryRegistrar that page-locks a PinnedArena for the GPU (cudaHostRegister).
std::shared_ptr<MemoryRegistrar> make_cuda_host_registrar();

}  // namespace strider
