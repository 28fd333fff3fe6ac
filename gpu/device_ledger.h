// DeviceLedger: the byte budget and live allocations of a device that hands
// out memory itself (CpuDevice: aligned host memory; SimDevice: reserved
// address space). One place for the budget refusal, the peak, and the range
// checks both devices use to prove the engine's copies: the device side of a
// copy lies inside one allocation, the host side inside none.
// Not thread-safe: the owning device holds its lock around every call.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <string_view>

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

}  // namespace strider
