// NvmeStore: the NVMe tier of the optimizer state. Each (block, kind) — fp32
// master weights, Adam m, Adam v — owns one 4 KiB-aligned extent in one of the
// backing files (one file per drive; extents are spread over the files so a
// block's master/m/v come from different drives when there are several). Files
// are preallocated (fallocate) and opened O_DIRECT: the page cache would only
// double the copy and evict the pinned arena's neighbours.
//
// I/O is asynchronous: read()/write() split the extent into chunks (default
// 1 MiB), queue them with at most `queue_depth` in flight (io_uring, or a
// pread/pwrite pool where io_uring is refused) and return a Ticket at once.
// Short transfers are resubmitted for the remainder, -EAGAIN is retried, hard
// errors (ENOSPC, EIO) come back from wait() as strider::Error naming the file
// and offset. Every extent carries a checksum (XXH3-64 over the XXH3-64s of its
// 1 MiB pieces, see extent_checksum64) computed on write and checked on read,
// hashed piece by piece on a small pool of hash threads as the I/O proceeds,
// so a torn or corrupted extent is reported, never trained on;
// sync() makes data and checksums durable (fsync, then an atomically replaced
// sidecar file "<first file>.strider-meta.json").
//
// Threads: read/write/wait/ready/sync may be called from any thread. The
// completion thread only reaps and resubmits; completion callbacks run on it or
// on a hash thread (whichever finishes the request), one at a time: keep them
// short (submit the next stage, notify a task arena) and hand heavy
// work (AdamW) to another thread, since a slow callback delays every other
// ticket's completion. A callback may call read()/write(), but must not wait()
// on a ticket (its own never becomes ready before it returns). The destructor
// waits for every in-flight request and never throws.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "host/pinned_arena.h"

namespace strider {

namespace nvme_detail {
struct Request;
class IoBackend;
struct Chunk;
class HashPool;
}  // namespace nvme_detail

// O_DIRECT granularity for buffer addresses, lengths and file offsets.
inline constexpr size_t kNvmeAlign = 4096;

// kGrad: a block's fp32 gradients, spilled while an exact global-norm clip
// waits for every block's gradients (the engine's NVMe tier keeps no
// per-block gradient buffer in RAM). kCompute: the copy the device computes
// with, for blocks whose compute copy lives on NVMe too (read ahead of each
// load, written back with the state).
enum class ExtentKind : uint8_t { kMaster, kAdamM, kAdamV, kGrad, kCompute };
std::string_view extent_kind_name(ExtentKind kind);  // "master", "adam_m", "adam_v", "grad", "compute"

// What the caller asks for: `bytes` of state for (block, kind).
struct ExtentSpec {
  int64_t block = 0;
  ExtentKind kind = ExtentKind::kMaster;
  size_t bytes = 0;
};

// Where it lives. Buffers for read/write are io_bytes long (bytes rounded up
// to 4 KiB) and 4 KiB aligned; only the first `bytes` are checksummed.
struct Extent {
  uint32_t index = 0;  // position in extents()
  int64_t block = 0;
  ExtentKind kind = ExtentKind::kMaster;
  size_t bytes = 0;
  size_t io_bytes = 0;
  uint32_t file = 0;    // index into NvmeStore::paths()
  uint64_t offset = 0;  // byte offset in that file, 4 KiB aligned
};

enum class NvmeBackend {
  kAuto,   // io_uring; pread/pwrite pool when the kernel refuses io_uring
  kUring,  // io_uring or throw
  kPosix,  // pread/pwrite pool (tests of the fallback; debugging)
};

// What a fault hook sees: one attempt of one chunk. Tests only.
struct NvmeFaultPoint {
  bool write = false;
  std::string_view path;
  uint64_t offset = 0;  // file offset of this attempt
  uint32_t bytes = 0;   // bytes this attempt asked for
  uint32_t attempt = 0; // 0 for the first try
};

struct NvmeStoreOptions {
  size_t chunk_bytes = size_t{1} << 20;  // request split size; a multiple of 4 KiB
  unsigned queue_depth = 32;             // chunks in flight at most
  NvmeBackend backend = NvmeBackend::kAuto;
  // fallocate the files (so ENOSPC shows up at construction, not mid-step).
  // false leaves them sparse: tests of write-time ENOSPC only.
  bool preallocate = true;
  // Reopen files and checksums written by an earlier store with the same
  // extents (the sidecar must exist and match); false starts empty.
  bool open_existing = false;
  // Threads hashing checksum pieces; 0: one fewer than the hardware's threads, 1 to 4.
  unsigned hash_threads = 0;
  // Fault injection for the tests of the retry paths: called with each
  // completed attempt and its real result (bytes or -errno); returns the result
  // the store should act on (e.g. -EAGAIN, -EIO, or fewer bytes). Runs on the
  // completion thread. Empty in production.
  std::function<int(const NvmeFaultPoint&, int res)> fault_hook;
};

// Completion callback: `error` is null on success, else what wait() throws.
using NvmeCallback = std::function<void(std::exception_ptr error)>;

// A handle on one read or write. Cheap to copy; keeps the request's status.
class NvmeTicket {
 public:
  NvmeTicket() = default;
  bool valid() const { return req_ != nullptr; }

 private:
  friend class NvmeStore;
  explicit NvmeTicket(std::shared_ptr<nvme_detail::Request> r) : req_(std::move(r)) {}
  std::shared_ptr<nvme_detail::Request> req_;
};

class NvmeStore {
 public:
  // Creates (or, with open_existing, reopens) `paths` and lays out `extents`
  // over them. Throws strider::Error naming the file and the size on any
  // refusal (no space, no O_DIRECT on that filesystem, duplicate extents).
  NvmeStore(std::vector<std::string> paths, std::vector<ExtentSpec> extents,
            NvmeStoreOptions options = {});
  ~NvmeStore();  // waits for in-flight I/O; never throws
  NvmeStore(const NvmeStore&) = delete;
  NvmeStore& operator=(const NvmeStore&) = delete;

  // The extent of (block, kind); throws when there is none.
  const Extent& extent(int64_t block, ExtentKind kind) const;
  const std::vector<Extent>& extents() const { return extents_; }
  const std::vector<std::string>& paths() const { return paths_; }

  // Starts reading `e` into `dst` (4 KiB aligned, e.io_bytes long). Throws at
  // once for a bad span or an extent that holds no valid data (never written,
  // a write in flight or failed). I/O and checksum errors come from wait().
  NvmeTicket read(const Extent& e, std::span<std::byte> dst, NvmeCallback done = {});
  // Starts writing `src` (4 KiB aligned, e.io_bytes long) to `e`. The buffer
  // must stay unchanged until the ticket is ready.
  NvmeTicket write(const Extent& e, std::span<const std::byte> src, NvmeCallback done = {});

  // Blocks until the ticket is done (callback included); throws its error.
  void wait(const NvmeTicket& t);
  bool ready(const NvmeTicket& t) const;

  // Makes every completed write durable: fsync of each file, then the
  // checksum table written to the sidecar atomically (write, fsync, rename).
  // Writes still in flight are not covered (they reload as invalid).
  void sync();

  // A registrar that turns a PinnedArena into io_uring fixed buffers
  // (arena.attach(store.registrar())). It never refuses: memory the kernel will
  // not pin (memlock limit) stays plain. No-op on the pread/pwrite backend.
  std::shared_ptr<MemoryRegistrar> registrar();
  size_t fixed_buffer_bytes() const;

  bool using_uring() const { return using_uring_; }
  std::string backend_description() const;  // also says why io_uring was not used
  const NvmeStoreOptions& options() const { return options_; }
  std::string sidecar_path() const;

 private:
  struct Slot;  // per-extent checksum state
  NvmeTicket start(const Extent& e, std::byte* buf, size_t len, bool write, NvmeCallback done);
  void on_chunk_done(nvme_detail::Chunk* c, int res);
  void hash_piece(nvme_detail::Request* r, uint32_t piece) noexcept;
  void queue_pieces(nvme_detail::Request* r, size_t first, size_t count) noexcept;
  // [first piece, count) of the checksum pieces chunk `c` overlaps.
  static std::pair<size_t, size_t> pieces_of(const nvme_detail::Chunk& c);
  void finish(nvme_detail::Request* r) noexcept;
  std::string where(const Extent& e) const;
  void load_sidecar();
  void write_sidecar();

  std::vector<std::string> paths_;
  std::vector<int> fds_;
  std::vector<Extent> extents_;
  std::map<std::pair<int64_t, ExtentKind>, uint32_t> index_;
  NvmeStoreOptions options_;
  std::unique_ptr<Slot[]> slots_;
  mutable std::mutex meta_mutex_;  // slots_
  std::mutex sync_mutex_;          // one sync() at a time

  std::mutex drain_mutex_;
  std::condition_variable drain_cv_;
  size_t outstanding_ = 0;

  std::mutex callback_mutex_;  // completion callbacks run one at a time
  std::unique_ptr<nvme_detail::HashPool> hash_pool_;  // before backend_: outlives it

  bool using_uring_ = false;
  std::string fallback_reason_;
  std::shared_ptr<nvme_detail::IoBackend> backend_;
};

}  // namespace strider
