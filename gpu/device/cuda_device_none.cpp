// The CUDA entry points in a build without CUDA: they say so instead of failing to link.
#include "gpu/device/cuda_device.h"
#include "host/error.h"

namespace strider {

CudaProbe probe_cuda() { return {0, "built without CUDA (no toolkit found, or STRIDER_WITH_CUDA=OFF)"}; }

std::unique_ptr<Device> make_cuda_device(int ordinal, const DeviceOptions&) {
  throw Error(fmt::format("cuda:{} requested but strider was built without CUDA; rebuild with a CUDA toolkit "
                          "(STRIDER_WITH_CUDA=ON) or use the device \"cpu\"", ordinal));
}

CudaMemory cuda_memory(int ordinal) {
  throw Error(fmt::format("cuda:{}: strider was built without CUDA; its memory cannot be read", ordinal));
}

std::shared_ptr<MemoryRegistrar> make_cuda_host_registrar() {
  throw Error("cudaHostRegister requested but strider was built without CUDA");
}

}  // namespace strider
