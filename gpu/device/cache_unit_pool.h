// CacheUnitPool: the K cache units of the sliding window, carved from ONE device
// allocation made at construction (no allocation during a step).
//
// A unit holds one block: its bf16 parameters, `capacity_elems` long (the
// largest block's ParamLayout::total_elems()), then its fp32 gradient
// accumulators, `grad_capacity_elems` long (as many, unless some of what a
// unit holds is frozen and has none: a LoRA base). Reuse is ordered by events, not by the host
// waiting: release() records, on the streams that used the unit, the point
// after their work so far; the next acquire() makes the writing stream wait for
// those points. So a unit is overwritten only after the compute that read it
// and the copy that drained its gradients are done. One host thread drives a
// pool (the engine's); it is not locked.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "gpu/device/device.h"

namespace strider {

class ParamLayout;  // host/param_layout.h

// One unit's memory, on the device.
struct CacheUnit {
  int index = -1;
  std::byte* base = nullptr;     // start of the unit (256-byte aligned)
  size_t bytes = 0;              // the whole unit
  void* params_bf16 = nullptr;   // capacity_elems parameters at base: bf16, or fp32 when
                                 // param_elem_bytes is 4 (fp32 exactness runs)
  float* grads_fp32 = nullptr;   // grad_capacity_elems fp32 values after the parameters
  size_t capacity_elems = 0;
  size_t grad_capacity_elems = 0;
  size_t param_elem_bytes = 2;
  // A quantized LoRA base's bytes land here and are dequantized into the
  // parameters at the visit (host/base_format.h); staging_bytes long, after
  // the gradients (nullptr when 0).
  std::byte* staging = nullptr;
  size_t staging_bytes = 0;
};

struct CacheUnitPoolOptions {
  std::string what = "cache units";  // for messages
  size_t param_elem_bytes = 2;       // 2: bf16 parameters; 4: fp32
  size_t grad_capacity_elems = SIZE_MAX;  // fp32 gradients per unit; SIZE_MAX: capacity_elems
  size_t staging_bytes = 0;               // per unit: a quantized base's bytes before dequantization
  // Tests only: acquire() skips the wait on this stream's release event, to
  // prove that the ring test catches a missing wait. -1: skip nothing.
  int test_skip_release_wait = -1;
};

class CacheUnitPool {
 public:
  static constexpr size_t kAlignBytes = 256;

  // Bytes of one unit holding `capacity_elems` parameters,
  // `grad_capacity_elems` gradients (SIZE_MAX: as many) and `staging_bytes`.
  static size_t unit_bytes_for(size_t capacity_elems, size_t param_elem_bytes = 2,
                               size_t grad_capacity_elems = SIZE_MAX, size_t staging_bytes = 0);

  // K units of `capacity_elems` each, in one device allocation. Throws (from
  // the device) naming the budget when it does not fit; K must be >= 1.
  CacheUnitPool(Device& device, size_t num_units, size_t capacity_elems, CacheUnitPoolOptions options = {});
  // K units sized for the largest block's layout.
  CacheUnitPool(Device& device, size_t num_units, const ParamLayout& largest_block,
                CacheUnitPoolOptions options = {});
  // Waits for the work that released units were recorded after, then frees the
  // allocation. Synchronize the device first if held units still have work queued.
  ~CacheUnitPool();
  CacheUnitPool(const CacheUnitPool&) = delete;
  CacheUnitPool& operator=(const CacheUnitPool&) = delete;

  // Takes the free unit released longest ago and makes `writer` wait until the
  // streams that last used it are past it. Host-side and non-blocking; throws
  // when all K units are held (the caller acquired more than its window).
  const CacheUnit& acquire(StreamId writer);
  // Gives `unit` back: its next writer will wait for all work enqueued so far on `users`.
  void release(const CacheUnit& unit, std::initializer_list<StreamId> users);

  size_t num_units() const { return units_.size(); }
  size_t free_units() const { return free_.size(); }
  size_t unit_bytes() const { return unit_bytes_; }
  size_t capacity_elems() const { return capacity_elems_; }
  // The pool's device allocation (all units).
  size_t device_bytes() const { return buffer_.bytes(); }
  const CacheUnit& unit(int index) const { return units_.at(static_cast<size_t>(index)); }
  Device& device() const { return device_; }

 private:
  struct Slot {
    std::unique_ptr<Event> released[kNumStreams];  // recorded on each user stream at release
    uint32_t used_mask = 0;                        // which of them the last release recorded
    bool held = false;
  };

  Device& device_;
  CacheUnitPoolOptions options_;
  size_t capacity_elems_ = 0;
  size_t unit_bytes_ = 0;
  DeviceBuffer buffer_;
  std::vector<CacheUnit> units_;
  std::vector<Slot> slots_;
  std::deque<int> free_;  // FIFO: the unit released longest ago is reused first
};

}  // namespace strider
