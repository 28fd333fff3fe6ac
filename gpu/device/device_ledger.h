// DeviceLedger: the byte budget and live allocations of a device that hands
// out memory itself (CpuDevice: aligned host memory; SimDevice: reserved
// address space). One place for the budget refusal, the peak, and the range
// checks both devices use to prove the engine's copies: the device side of a
// copy lies inside one allocation, the host side inside none.
// Not thread-safe: the owning device holds its lock around every call.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "host/pinned_arena.h"

namespace strider {

class DeviceLedger {
 public:
  // `device` names the owner in messages ("CpuDevice", "SimDevice").
  DeviceLedger(std::string device, size_t budget_bytes);

  size_t budget_bytes() const { return budget_bytes_; }
  size_t allocated_bytes() const { return allocated_bytes_; }
  size_t peak_bytes() const { return peak_bytes_; }
  size_t allocation_count() const { return allocation_count_; }
  const std::map<const std::byte*, size_t>& live() const { return live_; }  // base -> bytes

  // Throws naming `what`, the budget, what is in use and what is free when
  // `bytes` more would pass the budget.
  void check_fits(size_t bytes, std::string_view what) const;
  void add(const std::byte* base, size_t bytes);
  // Forgets the allocation starting at `base`; its bytes, or 0 if unknown.
  size_t remove(const std::byte* base);

  // `op` and `role` name the caller in the message ("copy_h2d", "destination").
  void check_device_range(const void* p, size_t bytes, const char* op, const char* role) const;
  void check_host_range(const void* p, size_t bytes, const char* op, const char* role) const;

 private:
  std::string device_;
  size_t budget_bytes_;
  std::map<const std::byte*, size_t> live_;
  size_t allocated_bytes_ = 0, peak_bytes_ = 0, allocation_count_ = 0;
};

// The host memory registered with a device, as cudaHostRegister would pin it,
// so a device without pinning (CpuDevice) can prove that every copy's host side
// lies in registered memory. Thread-safe: arenas register from the caller's
// thread while the copy streams check.
class HostRegistry final : public MemoryRegistrar {
 public:
  explicit HostRegistry(std::string device) : device_(std::move(device)) {}
  void register_memory(void* base, size_t bytes) override;
  void unregister_memory(void* base, size_t bytes) noexcept override;
  std::string_view name() const override { return "host registration"; }
  // Throws when something is registered and [p, p + bytes) is not inside one
  // registered range (nothing registered: a test's plain buffers, no check).
  void check(const void* p, size_t bytes, const char* op, const char* role) const;

 private:
  std::string device_;
  mutable std::mutex mutex_;
  std::map<const std::byte*, size_t> ranges_;  // base -> bytes
};

}  // namespace strider
