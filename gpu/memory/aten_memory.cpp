// The counting CPU allocator: see aten_memory.h.
#include "gpu/memory/aten_memory.h"

#include <c10/core/Allocator.h>     // c10::Allocator, DataPtr
#include <c10/core/CPUAllocator.h>  // GetCPUAllocator, SetCPUAllocator

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>

#include "host/error.h"

namespace strider {
namespace {

// Above c10's default (0), so a plain SetCPUAllocator(x) elsewhere does not
// silently take counting away; anyone who means to still can.
constexpr uint8_t kPriority = 1;
constexpr size_t kShards = 64;      // the table of live allocations, split to spread the locks
constexpr size_t kMaxWatches = 64;  // ops watched at once (one per CpuDevice computing)

class CountingCpuAllocator;
std::atomic<CountingCpuAllocator*> g_counter{nullptr};

void delete_counted(void* data);

// Every DataPtr handed out keeps data == context (as c10's own does), so
// Allocator::raw_allocate works: ideep allocates through it and frees through
// raw_deallocate -> raw_deleter(), whatever the CPU allocator is at that
// time. The size and the wrapped allocator's own context and deleter live in
// a table keyed by the data pointer instead.
class CountingCpuAllocator final : public c10::Allocator, public WorkMeter {
 public:
  explicit CountingCpuAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return inner_->allocate(0);  // no memory (c10 returns a null pointer)
    const int64_t bytes = static_cast<int64_t>(n);
    const int64_t live = live_.fetch_add(bytes) + bytes;
    if (active_watches_.load(std::memory_order_acquire) > 0) charge_watches(bytes, live);
    raise_peak(live);
    c10::DataPtr inner;
    try {
      inner = inner_->allocate(n);
    } catch (...) {
      live_.fetch_sub(bytes);
      throw;
    }
    void* data = inner.get();
    const Entry e{bytes, inner.get_context(), inner.get_deleter()};
    inner.release_context();  // ours now: delete_counted frees it through e
    {
      Shard& s = shard(data);
      std::lock_guard lk(s.mu);
      s.live[data] = e;
    }
    allocations_.fetch_add(1);
    return {data, data, &delete_counted, inner.device()};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_counted; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Frees `data`: ours (counted), or one the wrapped allocator made before we
  // were installed and someone frees through raw_deallocate now.
  void free(void* data) noexcept {
    if (data == nullptr) return;
    Entry e{};
    bool found = false;
    {
      Shard& s = shard(data);
      std::lock_guard lk(s.mu);
      auto it = s.live.find(data);
      if (it != s.live.end()) {
        e = it->second;
        s.live.erase(it);
        found = true;
      }
    }
    if (found) {
      live_.fetch_sub(e.bytes);
      if (e.deleter != nullptr) e.deleter(e.context);
    } else if (c10::DeleterFnPtr d = inner_->raw_deleter()) {
      d(data);
    }
  }

  // ---- WorkMeter ----
  int begin(const OpTag& tag, uint64_t limit_bytes) override {
    std::lock_guard lk(watch_mu_);
    for (size_t i = 0; i < kMaxWatches; ++i) {
      Watch& w = watches_[i];
      if (w.active) continue;
      w = Watch{true, tag.name, tag.block, live_.load(), 0, static_cast<int64_t>(limit_bytes)};
      active_watches_.fetch_add(1, std::memory_order_release);
      return static_cast<int>(i);
    }
    throw Error(fmt::format("ATen working memory: {} ops are being watched already; op '{}' (block {}) cannot be "
                            "measured (one compute stream per device runs one op at a time: are {} devices "
                            "computing at once?)",
                            kMaxWatches, tag.name, tag.block, kMaxWatches));
  }

  uint64_t end(int handle) noexcept override {
    std::lock_guard lk(watch_mu_);
    Watch& w = watches_[static_cast<size_t>(handle)];
    const int64_t peak = w.peak;
    w.active = false;
    active_watches_.fetch_sub(1, std::memory_order_release);
    return static_cast<uint64_t>(peak);
  }

  const char* what() const override { return "ATen's CPU allocator (gpu/memory/aten_memory.h)"; }

  AtenCpuCounts counts() const {
    return {static_cast<uint64_t>(live_.load()), static_cast<uint64_t>(peak_.load()), allocations_.load()};
  }
  void reset_peak() { peak_.store(live_.load()); }

 private:
  struct Entry {
    int64_t bytes = 0;
    void* context = nullptr;              // the wrapped allocator's
    c10::DeleterFnPtr deleter = nullptr;  // the wrapped allocator's
  };
  struct Shard {
    std::mutex mu;
    std::unordered_map<void*, Entry> live;
  };
  struct Watch {
    bool active = false;
    const char* name = "";
    int32_t block = -1;
    int64_t base = 0;   // live bytes when the op began
    int64_t peak = 0;   // most bytes above base seen at an allocation
    int64_t limit = 0;  // 0: none
  };

  Shard& shard(const void* p) {
    // Allocations are at least 16-byte aligned: mix the higher bits.
    const uint64_t x = reinterpret_cast<uintptr_t>(p) >> 4;
    return shards_[(x * 0x9E3779B97F4A7C15ull) >> 58];  // top 6 bits: 0..63
  }

  // Counts `bytes` (already in `live`) against every watched op; refuses the
  // allocation (undoing it, throwing) if that takes one past its limit.
  void charge_watches(int64_t bytes, int64_t live) {
    std::string refusal;
    {
      std::lock_guard lk(watch_mu_);
      for (const Watch& w : watches_) {
        if (!w.active || w.limit == 0 || live - w.base <= w.limit) continue;
        refusal = fmt::format(
            "ATen working-memory limit: op '{}' (block {}) asked ATen's CPU allocator for {} bytes while it held "
            "{} bytes more than when it began: {} bytes, over the limit of {} bytes "
            "(DeviceOptions::work_limit_bytes); raise the limit, or shrink the micro-batch or the sequence",
            w.name, w.block, bytes, std::max<int64_t>(0, live - bytes - w.base), live - w.base, w.limit);
        break;
      }
      if (refusal.empty())
        for (Watch& w : watches_)
          if (w.active) w.peak = std::max(w.peak, live - w.base);
    }
    if (!refusal.empty()) {
      live_.fetch_sub(bytes);
      throw Error(refusal);
    }
  }

  void raise_peak(int64_t live) {
    int64_t p = peak_.load();
    while (live > p && !peak_.compare_exchange_weak(p, live)) {
    }
  }

  c10::Allocator* const inner_;
  std::atomic<int64_t> live_{0}, peak_{0};
  std::atomic<uint64_t> allocations_{0};
  std::array<Shard, kShards> shards_;
  std::mutex watch_mu_;
  std::array<Watch, kMaxWatches> watches_{};  // guarded by watch_mu_
  std::atomic<int> active_watches_{0};        // skips watch_mu_ while nothing is watched
};

static_assert(kShards == 64, "shard() picks the top 6 bits");

void delete_counted(void* data) { g_counter.load()->free(data); }

}  // namespace

void install_aten_cpu_counter() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Never deleted: tensors it allocated are freed through it until the
    // process exits (static destructors included).
    auto* counter = new CountingCpuAllocator(c10::GetCPUAllocator());
    g_counter.store(counter);
    c10::SetCPUAllocator(counter, kPriority);
    if (c10::GetCPUAllocator() == counter) register_work_meter(counter);
  });
  STRIDER_CHECK(aten_cpu_counter_installed(),
                "ATen's CPU allocator could not be replaced by strider's counting one (another allocator of "
                "priority > {} is installed): ATen's working memory cannot be measured or limited on the CPU "
                "device",
                kPriority);
}

bool aten_cpu_counter_installed() {
  CountingCpuAllocator* c = g_counter.load();
  return c != nullptr && c10::GetCPUAllocator() == c;
}

AtenCpuCounts aten_cpu_counts() {
  CountingCpuAllocator* c = g_counter.load();
  return c != nullptr ? c->counts() : AtenCpuCounts{};
}

void reset_aten_cpu_peak() {
  if (CountingCpuAllocator* c = g_counter.load()) c->reset_peak();
}

WorkMeter& aten_cpu_meter() {
  CountingCpuAllocator* c = g_counter.load();
  STRIDER_CHECK(c != nullptr, "aten_cpu_meter: call install_aten_cpu_counter() first");
  return *c;
}

}  // namespace strider
