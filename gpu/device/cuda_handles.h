// The CUDA device's RAII handles: the current device for a scope, an event,
// and the registrar that pins host memory. Shared by gpu/device/cuda_device.cpp
// (the Device) and gpu/device/cuda_probe.cpp (the probe and the memory query).
// Compiled only when STRIDER_HAVE_CUDA.
#pragma once

#include <string_view>

#include "gpu/device/cuda_check.h"
#include "gpu/device/device.h"
#include "host/error.h"
#include "host/pinned_arena.h"

namespace strider::cuda_detail {

// Makes `ordinal` current for the scope: the engine may call from any host
// thread, and CUDA's current device is per thread.
class CurrentDevice {
 public:
  explicit CurrentDevice(int ordinal) {
    STRIDER_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != ordinal) STRIDER_CUDA_CHECK(cudaSetDevice(ordinal));
    restore_ = prev_ != ordinal;
  }
  ~CurrentDevice() {
    if (restore_) (void)cudaSetDevice(prev_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int prev_ = 0;
  bool restore_ = false;
};

class CudaEvent final : public Event {
 public:
  CudaEvent(const void* owner, int ordinal) : owner_(owner), ordinal_(ordinal) {
    CurrentDevice cd(ordinal_);
    STRIDER_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~CudaEvent() override { (void)cudaEventDestroy(event_); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  bool query() const override {
    cudaError_t rc = cudaEventQuery(event_);
    if (rc == cudaErrorNotReady) {
      (void)cudaGetLastError();  // NotReady is an answer, not a sticky error
      return false;
    }
    STRIDER_CUDA_CHECK(rc);
    return true;
  }
  void synchronize() const override { STRIDER_CUDA_CHECK(cudaEventSynchronize(event_)); }
  cudaEvent_t get() const { return event_; }
  const void* owner() const { return owner_; }

 private:
  const void* owner_;
  int ordinal_;
  cudaEvent_t event_ = nullptr;
};

class CudaHostRegistrar final : public MemoryRegistrar {
 public:
  void register_memory(void* base, size_t bytes) override {
    STRIDER_CUDA_CHECK(cudaHostRegister(base, bytes, cudaHostRegisterPortable));
  }
  void unregister_memory(void* base, size_t) noexcept override { (void)cudaHostUnregister(base); }
  std::string_view name() const override { return "cudaHostRegister"; }
};

}  // namespace strider::cuda_detail
