#include "io/nvme_store.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <thread>

#include "host/error.h"
#include "io/checksum.h"
#include "io/nvme_backend.h"
#include "io/nvme_request.h"
#include "io/posix_io_pool.h"
#include "io/uring_backend.h"

namespace strider {

using nvme_detail::Chunk;
using nvme_detail::Request;

namespace {

// EAGAIN and transfers that make no progress are retried this often before
// the request fails: enough for a congested queue, bounded so a wedged drive
// surfaces as an error instead of a spin.
constexpr uint32_t kMaxAttempts = 64;

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

std::string free_space_text(int fd) {
  struct statvfs st {};
  if (fstatvfs(fd, &st) != 0) return "unknown";
  return fmt::format("{} bytes", uint64_t{st.f_bavail} * st.f_frsize);
}

}  // namespace

namespace nvme_detail {

// Threads that hash checksum pieces (and finish the requests whose last piece
// they hash). Reads are verified, and writes hashed, in parallel and off the
// completion thread, which only reaps and resubmits.
class HashPool {
 public:
  using Run = std::function<void(Request*, uint32_t piece)>;
  HashPool(unsigned threads, Run run) : run_(std::move(run)) {
    try {
      for (unsigned i = 0; i < threads; ++i) threads_.emplace_back([this] { loop(); });
    } catch (...) {
      stop();
      throw;
    }
  }
  ~HashPool() { stop(); }
  HashPool(const HashPool&) = delete;
  HashPool& operator=(const HashPool&) = delete;

  void push(Request* r, uint32_t first, uint32_t count) {
    if (count == 0) return;
    {
      std::lock_guard lock(mutex_);
      for (uint32_t i = 0; i < count; ++i) queue_.emplace_back(r, first + i);
    }
    if (count == 1) cv_.notify_one();
    else cv_.notify_all();
  }

 private:
  void stop() noexcept {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }
  void loop() {
    for (;;) {
      std::pair<Request*, uint32_t> task;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and the store drained first
        task = queue_.front();
        queue_.pop_front();
      }
      run_(task.first, task.second);
    }
  }

  Run run_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::pair<Request*, uint32_t>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace nvme_detail

namespace {

std::string errno_advice(int err) {
  switch (err) {
    case ENOSPC: return " The filesystem is full: free space or add a drive (another file).";
    case EIO: return " The drive reported an I/O error: check dmesg and the drive's health.";
    case EINVAL: return " The filesystem may not support O_DIRECT at 4 KiB granularity.";
    default: return "";
  }
}

}  // namespace

std::string_view extent_kind_name(ExtentKind kind) {
  switch (kind) {
    case ExtentKind::kMaster: return "master";
    case ExtentKind::kAdamM: return "adam_m";
    case ExtentKind::kAdamV: return "adam_v";
    case ExtentKind::kGrad: return "grad";
    case ExtentKind::kCompute: return "compute";
  }
  return "unknown";
}

NvmeStore::NvmeStore(std::vector<std::string> paths, std::vector<ExtentSpec> specs,
                     NvmeStoreOptions options)
    : paths_(std::move(paths)), options_(std::move(options)) {
  STRIDER_CHECK(!paths_.empty(), "NvmeStore: no backing files given; pass one path per drive");
  STRIDER_CHECK(options_.chunk_bytes >= kNvmeAlign && options_.chunk_bytes % kNvmeAlign == 0 &&
                    options_.chunk_bytes <= (size_t{1} << 30),
                "NvmeStore: chunk_bytes {} must be a multiple of {} between {} and 1 GiB",
                options_.chunk_bytes, kNvmeAlign, kNvmeAlign);
  STRIDER_CHECK(options_.queue_depth >= 1 && options_.queue_depth <= 4096,
                "NvmeStore: queue_depth {} must be between 1 and 4096", options_.queue_depth);
  STRIDER_CHECK(options_.hash_threads <= 64, "NvmeStore: hash_threads {} must be at most 64 "
                "(0 picks one fewer than the hardware's threads, 1 to 4)", options_.hash_threads);

  // Layout: each extent goes whole to the least-filled file, so with several
  // drives the master/m/v of one block land on different drives.
  std::vector<uint64_t> used(paths_.size(), 0);
  extents_.reserve(specs.size());
  for (const ExtentSpec& s : specs) {
    STRIDER_CHECK(s.bytes > 0, "NvmeStore: extent {} of block {} has 0 bytes",
                  extent_kind_name(s.kind), s.block);
    const auto key = std::make_pair(s.block, s.kind);
    STRIDER_CHECK(!index_.contains(key), "NvmeStore: extent {} of block {} is listed twice",
                  extent_kind_name(s.kind), s.block);
    size_t f = 0;
    for (size_t i = 1; i < used.size(); ++i)
      if (used[i] < used[f]) f = i;
    Extent e;
    e.index = static_cast<uint32_t>(extents_.size());
    e.block = s.block;
    e.kind = s.kind;
    e.bytes = s.bytes;
    e.io_bytes = round_up(s.bytes, kNvmeAlign);
    e.file = static_cast<uint32_t>(f);
    e.offset = used[f];
    used[f] += e.io_bytes;
    index_.emplace(key, e.index);
    extents_.push_back(e);
  }
  slots_ = std::make_unique<Slot[]>(extents_.size());

  // Open (and preallocate) the files. On a throw below, the destructor does
  // not run: close what is open here.
  struct FdGuard {
    std::vector<int>& fds;
    bool armed = true;
    ~FdGuard() {
      if (armed)
        for (int fd : fds) close(fd);
    }
  } guard{fds_};
  for (size_t i = 0; i < paths_.size(); ++i) {
    const std::string& path = paths_[i];
    int flags = O_RDWR | O_DIRECT | O_CLOEXEC;
    if (!options_.open_existing) flags |= O_CREAT | O_TRUNC;
    int fd = open(path.c_str(), flags, 0644);
    if (fd < 0) {
      int err = errno;
      throw Error(fmt::format("NvmeStore: cannot open {} (O_DIRECT{}): {}.{}", path,
                              options_.open_existing ? ", existing" : ", create",
                              errno_text(err), errno_advice(err)));
    }
    fds_.push_back(fd);
    const uint64_t want = std::max<uint64_t>(used[i], kNvmeAlign);
    if (options_.open_existing) {
      off_t size = lseek(fd, 0, SEEK_END);
      STRIDER_CHECK(size >= 0 && static_cast<uint64_t>(size) >= want,
                    "NvmeStore: {} holds {} bytes but the extents need {}; it is not the file "
                    "this store wrote (open_existing)", path, size, want);
    } else if (options_.preallocate) {
      int rc = fallocate(fd, 0, 0, static_cast<off_t>(want));
      if (rc != 0 && errno == EOPNOTSUPP) rc = ftruncate(fd, static_cast<off_t>(want));
      if (rc != 0) {
        int err = errno;
        throw Error(fmt::format("NvmeStore: cannot preallocate {} bytes ({:.2f} GiB) for {}: "
                                "{}; {} free there.{}", want, want / double(1ull << 30), path,
                                errno_text(err), free_space_text(fd), errno_advice(err)));
      }
    } else {
      STRIDER_SYSCALL(ftruncate(fd, static_cast<off_t>(want)));
    }
  }

  if (options_.open_existing) {
    load_sidecar();
  } else {
    unlink(sidecar_path().c_str());  // describes data that O_TRUNC just dropped
  }

  unsigned hash_threads = options_.hash_threads;
  // One core left to the completion thread: on 2 cores, two hash threads
  // delayed its reaping enough that 1 MiB reads at depth 8 ran at 0.82 of
  // fio's rate, against 0.99-1.01 with one (bench_nvme --depths 8).
  if (hash_threads == 0) hash_threads = std::clamp(std::thread::hardware_concurrency(), 2u, 5u) - 1;
  hash_pool_ = std::make_unique<nvme_detail::HashPool>(
      hash_threads, [this](Request* r, uint32_t piece) { hash_piece(r, piece); });

  auto on_done = [this](Chunk* c, int res) { on_chunk_done(c, res); };
  if (options_.backend != NvmeBackend::kPosix) {
    try {
      auto uring = std::make_shared<nvme_detail::UringBackend>(fds_, options_.queue_depth, on_done);
      uring->start();
      backend_ = std::move(uring);
      using_uring_ = true;
    } catch (const nvme_detail::UringUnavailable& u) {
      if (options_.backend == NvmeBackend::kUring)
        throw Error("NvmeStore: io_uring is not available (" + u.what +
                    "); use the kAuto or kPosix backend");
      fallback_reason_ = "io_uring refused: " + u.what;
    }
  } else {
    fallback_reason_ = "pread/pwrite forced by options";
  }
  if (!backend_) backend_ = std::make_shared<nvme_detail::PosixIoPool>(fds_, options_.queue_depth, on_done);
  guard.armed = false;
}

NvmeStore::~NvmeStore() {
  {
    std::unique_lock lock(drain_mutex_);
    drain_cv_.wait(lock, [&] { return outstanding_ == 0; });
  }
  backend_.reset();    // joins its threads
  hash_pool_.reset();  // idle now: every request has finished
  for (int fd : fds_) close(fd);
}

const Extent& NvmeStore::extent(int64_t block, ExtentKind kind) const {
  auto it = index_.find({block, kind});
  STRIDER_CHECK(it != index_.end(), "NvmeStore: no extent {} for block {}",
                extent_kind_name(kind), block);
  return extents_[it->second];
}

std::string NvmeStore::where(const Extent& e) const {
  return fmt::format("{} of block {} ({} bytes at {} offset {})", extent_kind_name(e.kind),
                     e.block, e.bytes, paths_[e.file], e.offset);
}

NvmeTicket NvmeStore::read(const Extent& e, std::span<std::byte> dst, NvmeCallback done) {
  return start(e, dst.data(), dst.size(), false, std::move(done));
}

NvmeTicket NvmeStore::write(const Extent& e, std::span<const std::byte> src, NvmeCallback done) {
  return start(e, const_cast<std::byte*>(src.data()), src.size(), true, std::move(done));
}

NvmeTicket NvmeStore::start(const Extent& e, std::byte* buf, size_t len, bool write,
                            NvmeCallback done) {
  const char* op = write ? "write" : "read";
  STRIDER_CHECK(e.index < extents_.size() && extents_[e.index].block == e.block &&
                    extents_[e.index].kind == e.kind,
                "NvmeStore::{}: extent {} of block {} does not belong to this store", op,
                extent_kind_name(e.kind), e.block);
  const Extent& ext = extents_[e.index];
  STRIDER_CHECK(reinterpret_cast<uintptr_t>(buf) % kNvmeAlign == 0 && len == ext.io_bytes,
                "NvmeStore::{} of {}: the buffer at {} of {} bytes must be {}-byte aligned and "
                "exactly {} bytes long (the extent's {} bytes rounded up to {}), as O_DIRECT "
                "requires; carve it from the pinned arena with that size and alignment",
                op, where(ext), static_cast<const void*>(buf), len, kNvmeAlign, ext.io_bytes,
                ext.bytes, kNvmeAlign);

  auto r = std::make_shared<Request>();
  r->extent = &ext;
  r->write = write;
  r->buffer = buf;
  r->callback = std::move(done);
  {
    std::lock_guard lock(meta_mutex_);
    Slot& s = slots_[ext.index];
    if (write) {
      STRIDER_CHECK(s.state != Slot::kWriting,
                    "NvmeStore::write of {}: another write to it is in flight; wait for it "
                    "first", where(ext));
      s.state = Slot::kWriting;
    } else {
      STRIDER_CHECK(s.state == Slot::kValid,
                    "NvmeStore::read of {}: it holds no valid data ({}); write it first",
                    where(ext), Slot::state_name(s.state));
      r->checksum = s.checksum;
    }
  }

  const size_t chunk = options_.chunk_bytes;
  const size_t n = (len + chunk - 1) / chunk;
  const size_t pieces = checksum_piece_count(ext.bytes);
  r->piece_hashes.assign(pieces, 0);
  if (!write) r->piece_waits = std::make_unique<std::atomic<uint32_t>[]>(pieces);
  r->chunks.resize(n);
  std::vector<Chunk*> ptrs(n);
  for (size_t i = 0; i < n; ++i) {
    Chunk& c = r->chunks[i];
    c.request = r.get();
    c.file = static_cast<int>(ext.file);
    c.offset = ext.offset + i * chunk;
    c.buffer = buf + i * chunk;
    c.bytes = static_cast<uint32_t>(std::min(chunk, len - i * chunk));
    c.write = write;
    ptrs[i] = &c;
    if (!write) {
      const auto [first, count] = pieces_of(c);
      for (size_t p = first; p < first + count; ++p)
        r->piece_waits[p].fetch_add(1, std::memory_order_relaxed);
    }
  }
  r->remaining.store(n + pieces, std::memory_order_relaxed);
  r->self = r;
  {
    std::lock_guard lock(drain_mutex_);
    ++outstanding_;
  }
  Request* raw = r.get();  // the ticket keeps it alive even if it finishes before the push
  NvmeTicket ticket(std::move(r));
  backend_->submit(ptrs);
  // A write's buffer is fixed while in flight: hash it alongside the I/O.
  if (write) queue_pieces(raw, 0, pieces);
  return ticket;
}

void NvmeStore::on_chunk_done(Chunk* c, int res) {
  Request* r = c->request;
  const uint32_t want = c->bytes - c->done_bytes;
  const uint64_t off = c->offset + c->done_bytes;
  if (options_.fault_hook) {
    try {
      res = options_.fault_hook({c->write, paths_[static_cast<size_t>(c->file)], off, want,
                                 c->attempts}, res);
    } catch (...) {
      res = -EIO;  // a throwing hook must not kill the completion thread
    }
  }
  const char* op = c->write ? "write" : "read";
  std::string error;
  if (res == -EAGAIN || res == -EINTR) {
    if (++c->attempts < kMaxAttempts) return backend_->resubmit(c);
    error = fmt::format("still {} after {} attempts", errno_text(-res), kMaxAttempts);
  } else if (res < 0) {
    error = errno_text(-res) + "." + errno_advice(-res);
  } else if (res == 0) {
    error = fmt::format("0 of {} bytes transferred (past the end of the file?)", want);
  } else if (static_cast<uint32_t>(res) < want) {
    // Short transfer: resubmit the remainder. O_DIRECT needs 4 KiB alignment,
    // so restart at the last aligned boundary (repeating at most 4 KiB - 1).
    const uint32_t done = (c->done_bytes + static_cast<uint32_t>(res)) / kNvmeAlign * kNvmeAlign;
    if (done > c->done_bytes || ++c->attempts < kMaxAttempts) {
      c->done_bytes = done;
      return backend_->resubmit(c);
    }
    error = fmt::format("short {}s of {} bytes made no progress after {} attempts", op, res,
                        kMaxAttempts);
  }
  if (!error.empty()) {
    if (r->error_text.empty())
      r->error_text = fmt::format("NvmeStore: {} of {} bytes at {} offset {} ({}) failed: {}",
                                  op, want, paths_[static_cast<size_t>(c->file)], off,
                                  where(*r->extent), error);
    r->failed.store(true, std::memory_order_release);
  } else {
    c->finished = true;
  }
  if (!c->write) {
    // Queue each piece this chunk completes (failed or not: every piece must
    // be accounted for before the request finishes; a failed one skips hashing).
    const auto [first, count] = pieces_of(*c);
    for (size_t p = first; p < first + count; ++p)
      if (r->piece_waits[p].fetch_sub(1, std::memory_order_acq_rel) == 1) queue_pieces(r, p, 1);
  }
  if (r->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) finish(r);
}

std::pair<size_t, size_t> NvmeStore::pieces_of(const Chunk& c) {
  const Request& r = *c.request;
  const size_t start = static_cast<size_t>(c.buffer - r.buffer);
  const size_t end = std::min<size_t>(start + c.bytes, r.extent->bytes);
  if (start >= end) return {0, 0};  // the padding past `bytes` is not checksummed
  const size_t first = start / kChecksumPieceBytes;
  return {first, (end - 1) / kChecksumPieceBytes + 1 - first};
}

void NvmeStore::queue_pieces(Request* r, size_t first, size_t count) noexcept {
  try {
    hash_pool_->push(r, static_cast<uint32_t>(first), static_cast<uint32_t>(count));
  } catch (...) {
    // No memory for the queue: hash here rather than lose the pieces (a lost
    // piece would leave the request unfinished forever).
    for (size_t p = first; p < first + count; ++p) hash_piece(r, static_cast<uint32_t>(p));
  }
}

void NvmeStore::hash_piece(Request* r, uint32_t piece) noexcept {
  if (!r->failed.load(std::memory_order_acquire)) {
    const size_t at = size_t{piece} * kChecksumPieceBytes;
    const size_t len = std::min(kChecksumPieceBytes, r->extent->bytes - at);
    r->piece_hashes[piece] = checksum64({r->buffer + at, len});
  }
  if (r->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) finish(r);
}

void NvmeStore::finish(Request* r) noexcept {
  std::shared_ptr<Request> keep = std::move(r->self);  // the last owner may be us
  const Extent& e = *r->extent;
  std::exception_ptr error;
  if (!r->error_text.empty()) {
    error = std::make_exception_ptr(Error(r->error_text));
  } else if (r->write) {
    r->checksum = combine_piece_checksums(r->piece_hashes);
  } else {
    const uint64_t got = combine_piece_checksums(r->piece_hashes);
    if (got != r->checksum) {
      error = std::make_exception_ptr(Error(fmt::format(
          "NvmeStore: checksum mismatch reading {}: expected xxh3 {:016x}, read {:016x}. The "
          "extent is torn or corrupted on disk; do not train on it (restore from a "
          "checkpoint)", where(e), r->checksum, got)));
    }
  }
  if (r->write) {
    std::lock_guard lock(meta_mutex_);
    Slot& s = slots_[e.index];
    s.state = error ? Slot::kFailed : Slot::kValid;
    s.checksum = r->checksum;
  }
  if (r->callback) {
    // Callbacks run on the completion thread or a hash thread: one at a time.
    std::lock_guard callback_lock(callback_mutex_);
    try {
      r->callback(error);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  {
    std::lock_guard lock(r->mutex);
    r->error = error;
    r->done = true;
  }
  r->cv.notify_all();
  std::lock_guard lock(drain_mutex_);
  --outstanding_;
  drain_cv_.notify_all();
}

void NvmeStore::wait(const NvmeTicket& t) {
  STRIDER_CHECK(t.valid(), "NvmeStore::wait: empty ticket");
  Request& r = *t.req_;
  std::unique_lock lock(r.mutex);
  r.cv.wait(lock, [&] { return r.done; });
  if (r.error) std::rethrow_exception(r.error);
}

bool NvmeStore::ready(const NvmeTicket& t) const {
  STRIDER_CHECK(t.valid(), "NvmeStore::ready: empty ticket");
  std::lock_guard lock(t.req_->mutex);
  return t.req_->done;
}

void NvmeStore::sync() {
  std::lock_guard lock(sync_mutex_);
  for (size_t i = 0; i < fds_.size(); ++i) {
    if (fsync(fds_[i]) != 0) {
      int err = errno;
      throw Error(fmt::format("NvmeStore::sync: fsync of {} failed: {}.{}", paths_[i],
                              errno_text(err), errno_advice(err)));
    }
  }
  write_sidecar();
}

std::shared_ptr<MemoryRegistrar> NvmeStore::registrar() { return backend_->registrar(); }
size_t NvmeStore::fixed_buffer_bytes() const { return backend_->fixed_buffer_bytes(); }

std::string NvmeStore::backend_description() const {
  std::string d = backend_->description();
  if (!fallback_reason_.empty()) d += "; " + fallback_reason_;
  return d;
}

std::string NvmeStore::sidecar_path() const { return paths_.front() + ".strider-meta.json"; }

}  // namespace strider
