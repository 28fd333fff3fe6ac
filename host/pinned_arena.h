// PinnedArena: the page-locked host memory every transfer and every optimizer
// update works in. Allocated once at start-up (anonymous mmap, locked, huge
// pages where the kernel gives them), then carved into aligned sub-buffers;
// nothing is allocated during a training step.
//
// Two kinds of buffer: those a device copies to or from (the compute copy,
// gradients, batches, activations) are carved from the front, and those only
// the host touches (optimizer state, NVMe staging) from the back. So the copied
// buffers are one range, and the GPU pins only that.
//
// Registration hooks keep this folder free of CUDA and io_uring: gpu/ attaches a
// registrar that calls cudaHostRegister on the copied part, io/ one that
// registers the whole mapping as io_uring fixed buffers. The arena unregisters
// them (in reverse order) before it unmaps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace strider {

// Something that must know about the arena's memory (CUDA pinning, io_uring).
class MemoryRegistrar {
 public:
  virtual ~MemoryRegistrar() = default;
  // Registers [base, base + bytes); throws strider::Error when refused.
  virtual void register_memory(void* base, size_t bytes) = 0;
  // Undoes register_memory; never throws (called from destructors).
  virtual void unregister_memory(void* base, size_t bytes) noexcept = 0;
  // For messages: "cudaHostRegister", "io_uring fixed buffers".
  virtual std::string_view name() const = 0;
};

enum class LockPolicy {
  kRequire,  // mlock must succeed, else throw naming the memlock limit
  kPrefer,   // try mlock; run unlocked (locked() == false) when the OS refuses
  kNone,     // do not lock (tests, or a registrar that pins by itself)
};

struct ArenaOptions {
  LockPolicy lock = LockPolicy::kPrefer;
  bool huge_pages = true;   // madvise(MADV_HUGEPAGE) and 2 MiB rounding
  bool prefault = true;     // touch every page now, not during a step
  std::string name = "pinned arena";  // for messages
  // Address space only (simulation of a machine larger than this one):
  // MAP_NORESERVE, not locked, not prefaulted; the memory must never be touched.
  bool reserve_only = false;
  // Map this file shared (MAP_SHARED) instead of anonymous memory: processes
  // that map the same file share the memory (a machine's data-parallel ranks
  // share one compute copy this way; use a tmpfs path such as /dev/shm/...).
  // Created if missing and given `capacity_bytes` of backing store now (a
  // tmpfs too small fails here, naming the file, not with SIGBUS later); new
  // pages read zero. Never huge pages; prefaulted by reading, not writing (the
  // other processes' data stays).
  std::string shared_file;
};

// Who touches a carved buffer.
enum class ArenaUse {
  kCopied,    // a device copies to or from it (carved from the front)
  kHostOnly,  // only the host (carved from the back)
};

// What a registrar registers.
enum class ArenaPart {
  kWhole,   // the whole mapping
  kCopied,  // the kCopied buffers, page-rounded; none may be carved afterwards
};

class PinnedArena {
 public:
  // Maps `capacity_bytes` (rounded up to the page or huge-page size). Throws
  // strider::Error naming the size and the reason when the OS refuses.
  explicit PinnedArena(size_t capacity_bytes, ArenaOptions options = {});
  ~PinnedArena();
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  // `bytes` aligned to `align` (a power of two, at most 4096 unless a multiple
  // of it): the next ones at the front for kCopied, at the back for kHostOnly.
  // Throws naming `what`, the request and what is left.
  std::span<std::byte> carve(size_t bytes, size_t align, std::string_view what, ArenaUse use = ArenaUse::kCopied);
  template <class T>
  std::span<T> carve_as(size_t elems, std::string_view what, size_t align = 256, ArenaUse use = ArenaUse::kCopied) {
    auto raw = carve(elems * sizeof(T), align, what, use);
    return {reinterpret_cast<T*>(raw.data()), elems};
  }

  // Registers `part` with `r` now and unregisters it at destruction. A refusal
  // throws naming the arena, the bytes, the memlock limit and what to do.
  void attach(std::shared_ptr<MemoryRegistrar> r, ArenaPart part = ArenaPart::kWhole);

  std::byte* data() const { return base_; }
  size_t capacity_bytes() const { return capacity_; }
  size_t used_bytes() const { return front_ + (capacity_ - back_); }
  size_t free_bytes() const { return back_ - front_; }
  // The kCopied buffers: [data(), data() + copied_bytes()).
  size_t copied_bytes() const { return front_; }
  bool locked() const { return locked_; }
  bool huge_pages() const { return huge_; }
  // Does [p, p + bytes) lie inside this arena?
  bool contains(const void* p, size_t bytes) const;

 private:
  std::byte* base_ = nullptr;
  size_t capacity_ = 0;
  size_t page_ = 0;
  size_t front_ = 0;     // kCopied buffers end here
  size_t back_ = 0;      // kHostOnly buffers start here
  bool copied_registered_ = false;  // an ArenaPart::kCopied registrar holds [0, front_)
  bool locked_ = false;
  bool huge_ = false;
  std::string name_;
  struct Registration {
    std::shared_ptr<MemoryRegistrar> registrar;
    size_t bytes;  // of the mapping's start
  };
  std::vector<Registration> registrars_;
  void map_private(const ArenaOptions& options);
  void map_shared(const std::string& path);
};

}  // namespace strider
