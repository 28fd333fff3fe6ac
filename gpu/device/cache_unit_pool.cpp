#include "gpu/device/cache_unit_pool.h"

#include <algorithm>

#include "host/error.h"
#include "host/param_layout.h"

namespace strider {
namespace {
size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }
constexpr size_t kGradBytes = 4;   // fp32 accumulators
}  // namespace

size_t CacheUnitPool::unit_bytes_for(size_t capacity_elems, size_t param_elem_bytes, size_t grad_capacity_elems,
                                     size_t staging_bytes) {
  return round_up(capacity_elems * param_elem_bytes, kAlignBytes) +
         round_up(std::min(grad_capacity_elems, capacity_elems) * kGradBytes, kAlignBytes) +
         round_up(staging_bytes, kAlignBytes);
}

CacheUnitPool::CacheUnitPool(Device& device, size_t num_units, const ParamLayout& largest_block,
                             CacheUnitPoolOptions options)
    : CacheUnitPool(device, num_units, largest_block.total_elems(), std::move(options)) {}

CacheUnitPool::CacheUnitPool(Device& device, size_t num_units, size_t capacity_elems, CacheUnitPoolOptions options)
    : device_(device), options_(std::move(options)), capacity_elems_(capacity_elems) {
  STRIDER_CHECK(num_units >= 1, "{}: need at least 1 unit, got {}", options_.what, num_units);
  STRIDER_CHECK(capacity_elems >= 1, "{}: unit capacity must be >= 1 element, got {}", options_.what,
                capacity_elems);
  STRIDER_CHECK(options_.param_elem_bytes == 2 || options_.param_elem_bytes == 4,
                "{}: parameters are 2 (bf16) or 4 (fp32) bytes, not {}", options_.what,
                options_.param_elem_bytes);
  const size_t grad_elems = std::min(options_.grad_capacity_elems, capacity_elems);
  unit_bytes_ = unit_bytes_for(capacity_elems, options_.param_elem_bytes, grad_elems, options_.staging_bytes);
  // One allocation for all units: no fragmentation, and the budget check is one number.
  buffer_ = device_.allocate(unit_bytes_ * num_units,
                             fmt::format("{} ({} x {} bytes)", options_.what, num_units, unit_bytes_));
  const size_t grad_offset = round_up(capacity_elems * options_.param_elem_bytes, kAlignBytes);
  units_.resize(num_units);
  slots_.resize(num_units);
  for (size_t i = 0; i < num_units; ++i) {
    CacheUnit& u = units_[i];
    u.index = static_cast<int>(i);
    u.base = buffer_.data() + i * unit_bytes_;
    u.bytes = unit_bytes_;
    u.params_bf16 = u.base;
    u.grads_fp32 = reinterpret_cast<float*>(u.base + grad_offset);
    u.capacity_elems = capacity_elems;
    u.grad_capacity_elems = grad_elems;
    u.param_elem_bytes = options_.param_elem_bytes;
    if (options_.staging_bytes > 0) {
      u.staging = reinterpret_cast<std::byte*>(u.grads_fp32) + round_up(grad_elems * kGradBytes, kAlignBytes);
      u.staging_bytes = options_.staging_bytes;
    }
    for (auto& e : slots_[i].released) e = device_.make_event();
    free_.push_back(static_cast<int>(i));
  }
}

CacheUnitPool::~CacheUnitPool() {
  for (Slot& slot : slots_) {
    for (int s = 0; s < kNumStreams; ++s) {
      if ((slot.used_mask & (1u << s)) == 0) continue;
      try {
        slot.released[s]->synchronize();
      } catch (...) {
        // A failed device reports at its own synchronize(); a destructor must not throw.
      }
    }
  }
}

const CacheUnit& CacheUnitPool::acquire(StreamId writer) {
  STRIDER_CHECK(!free_.empty(),
                "{}: all {} units are held; release one before acquiring (the window is K = {})",
                options_.what, units_.size(), units_.size());
  const int index = free_.front();
  free_.pop_front();
  Slot& slot = slots_[static_cast<size_t>(index)];
  for (int s = 0; s < kNumStreams; ++s) {
    if ((slot.used_mask & (1u << s)) == 0) continue;
    if (s == static_cast<int>(writer)) continue;  // same stream: program order already holds
    if (s == options_.test_skip_release_wait) continue;
    device_.wait(writer, *slot.released[s]);
  }
  slot.held = true;
  return units_[static_cast<size_t>(index)];
}

void CacheUnitPool::release(const CacheUnit& unit, std::initializer_list<StreamId> users) {
  STRIDER_CHECK(unit.index >= 0 && static_cast<size_t>(unit.index) < units_.size() &&
                    &units_[static_cast<size_t>(unit.index)] == &unit,
                "{}: release of a unit that is not from this pool", options_.what);
  Slot& slot = slots_[static_cast<size_t>(unit.index)];
  STRIDER_CHECK(slot.held, "{}: unit {} released twice", options_.what, unit.index);
  slot.used_mask = 0;
  for (StreamId s : users) {
    device_.record(*slot.released[static_cast<int>(s)], s);
    slot.used_mask |= 1u << static_cast<int>(s);
  }
  slot.held = false;
  free_.push_back(unit.index);
}

}  // namespace strider
