#include "gpu/device/device_ledger.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "host/error.h"

namespace strider {

DeviceLedger::DeviceLedger(std::string device, size_t budget_bytes)
    : device_(std::move(device)), budget_bytes_(budget_bytes) {}

void DeviceLedger::check_fits(size_t bytes, std::string_view what) const {
  if (allocated_bytes_ + bytes <= budget_bytes_) return;
  throw Error(fmt::format(
      "{}: allocating '{}' of {} bytes would exceed the device budget of {} bytes "
      "({} in use, {} free); raise the budget or shrink the request (fewer cache units)",
      device_, what, bytes, budget_bytes_, allocated_bytes_, budget_bytes_ - allocated_bytes_));
}

void DeviceLedger::add(const std::byte* base, size_t bytes) {
  live_.emplace(base, bytes);
  allocated_bytes_ += bytes;
  peak_bytes_ = std::max(peak_bytes_, allocated_bytes_);
  ++allocation_count_;
}

size_t DeviceLedger::remove(const std::byte* base) {
  auto it = live_.find(base);
  if (it == live_.end()) return 0;
  const size_t bytes = it->second;
  allocated_bytes_ -= bytes;
  live_.erase(it);
  return bytes;
}

// A GPU would fault (or silently corrupt) on a host pointer passed as a device
// one; here we can say so at the call.
void DeviceLedger::check_device_range(const void* p, size_t bytes, const char* op, const char* role) const {
  auto* b = static_cast<const std::byte*>(p);
  auto it = live_.upper_bound(b);
  bool inside = false;
  if (it != live_.begin()) {
    --it;
    inside = b >= it->first && b + bytes <= it->first + it->second;
  }
  STRIDER_CHECK(inside, "{}::{}: {} [{}, +{} bytes) is not inside one device allocation", device_, op, role, p,
                bytes);
}

// Allocations never overlap, so only the last one starting before the range's
// end can overlap it.
void DeviceLedger::check_host_range(const void* p, size_t bytes, const char* op, const char* role) const {
  auto* b = static_cast<const std::byte*>(p);
  auto it = live_.upper_bound(b + bytes);
  bool overlaps = false;
  if (it != live_.begin()) {
    --it;
    overlaps = b < it->first + it->second && it->first < b + bytes;
  }
  STRIDER_CHECK(!overlaps, "{}::{}: {} [{}, +{} bytes) is device memory, expected host memory", device_, op, role,
                p, bytes);
}

void HostRegistry::register_memory(void* base, size_t bytes) {
  std::lock_guard lk(mutex_);
  auto* b = static_cast<const std::byte*>(base);
  auto it = ranges_.upper_bound(b);
  const bool after_previous = it == ranges_.begin() || std::prev(it)->first + std::prev(it)->second <= b;
  const bool before_next = it == ranges_.end() || b + bytes <= it->first;
  // cudaHostRegister refuses memory that is already registered; so do we.
  STRIDER_CHECK(after_previous && before_next, "{}: [{}, +{} bytes) overlaps memory already registered", device_,
                base, bytes);
  ranges_.emplace(b, bytes);
}

void HostRegistry::unregister_memory(void* base, size_t) noexcept {
  std::lock_guard lk(mutex_);
  ranges_.erase(static_cast<const std::byte*>(base));
}

void HostRegistry::check(const void* p, size_t bytes, const char* op, const char* role) const {
  std::lock_guard lk(mutex_);
  if (ranges_.empty()) return;
  auto* b = static_cast<const std::byte*>(p);
  auto it = ranges_.upper_bound(b);
  const bool inside = it != ranges_.begin() && b + bytes <= std::prev(it)->first + std::prev(it)->second;
  STRIDER_CHECK(inside,
                "{}::{}: {} [{}, +{} bytes) is host memory the device did not register (a GPU would copy it "
                "unpinned and synchronously); carve it as ArenaUse::kCopied before the device's registrar is "
                "attached", device_, op, role, p, bytes);
}

}  // namespace strider
