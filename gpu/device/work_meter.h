// WorkMeter: how the CPU device learns the working memory of the op it runs
// (what ATen allocates inside it) without including torch. gpu/memory/aten_memory.cpp
// implements it over a counting c10 CPU allocator and registers it here;
// CpuDevice takes the registered meter when it is made. Plain C++.
#pragma once

#include <cstdint>

#include "gpu/device/device.h"

namespace strider {

class WorkMeter {
 public:
  virtual ~WorkMeter() = default;
  // Starts watching one op: what is allocated from now on, above the level
  // counted now, is the op's working memory. With limit_bytes > 0 an
  // allocation that would take it past the limit throws strider::Error naming
  // `tag` (name, block), the request and the limit: the op fails, inside.
  // `tag.name` must outlive the watch. Returns a handle for end().
  virtual int begin(const OpTag& tag, uint64_t limit_bytes) = 0;
  // Stops watching; returns the op's peak bytes above its starting level.
  virtual uint64_t end(int handle) noexcept = 0;
  // What it counts, for messages ("ATen's CPU allocator").
  virtual const char* what() const = 0;
};

// Watches one op for its scope (end() even when the op throws).
class WorkWatch {
 public:
  WorkWatch(WorkMeter* meter, const OpTag& tag, uint64_t limit_bytes)
      : meter_(meter), handle_(meter != nullptr ? meter->begin(tag, limit_bytes) : -1) {}
  ~WorkWatch() { finish(); }
  WorkWatch(const WorkWatch&) = delete;
  WorkWatch& operator=(const WorkWatch&) = delete;
  // The op's working memory so far; stops watching (0 without a meter).
  uint64_t finish() noexcept {
    const uint64_t bytes = handle_ >= 0 ? meter_->end(handle_) : 0;
    handle_ = -1;
    return bytes;
  }

 private:
  WorkMeter* meter_;
  int handle_;
};

// The process's meter: set once by whoever can count (install_aten_cpu_counter
// in gpu/memory/aten_memory.h), read by each CpuDevice when it is made; nullptr if none.
void register_work_meter(WorkMeter* meter);
WorkMeter* registered_work_meter();

}  // namespace strider
