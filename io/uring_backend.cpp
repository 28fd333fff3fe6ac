#include "io/uring_backend.h"

#include <cerrno>
#include <cstring>

#include "host/error.h"

namespace strider::nvme_detail {
namespace {

constexpr uint64_t kStopTag = 0;              // user_data of the NOP that ends the loop
constexpr unsigned kBufferSlots = 1024;       // up to 1 TiB of fixed buffers
constexpr size_t kMaxFixedBuffer = size_t{1} << 30;  // kernel limit per buffer

class UringRegistrar final : public MemoryRegistrar {
 public:
  explicit UringRegistrar(std::weak_ptr<UringBackend> backend) : backend_(std::move(backend)) {}
  void register_memory(void* base, size_t bytes) override {
    // Never refuses: what the kernel will not pin stays plain (slower, correct).
    if (auto b = backend_.lock()) b->register_memory(static_cast<std::byte*>(base), bytes);
  }
  void unregister_memory(void* base, size_t bytes) noexcept override {
    if (auto b = backend_.lock()) b->unregister_memory(static_cast<std::byte*>(base), bytes);
  }
  std::string_view name() const override { return "io_uring fixed buffers"; }

 private:
  std::weak_ptr<UringBackend> backend_;  // the arena may outlive the store
};

}  // namespace

UringBackend::UringBackend(std::vector<int> fds, unsigned queue_depth, ChunkDone on_done)
    : fds_(std::move(fds)), depth_(queue_depth), on_done_(std::move(on_done)) {
  // One spare entry for the stop NOP; the CQ is twice the SQ, so it cannot overflow.
  unsigned entries = 1;
  while (entries < depth_ + 1) entries <<= 1;
  int rc = io_uring_queue_init(entries, &ring_, 0);
  if (rc < 0) {
    if (rc == -ENOSYS || rc == -EPERM || rc == -EACCES || rc == -ENOMEM)
      throw UringUnavailable{-rc, "io_uring_queue_init(" + std::to_string(entries) +
                                      "): " + errno_text(-rc)};
    throw Error(fmt::format("io_uring_queue_init({}) failed: {}", entries, errno_text(-rc)));
  }
  files_registered_ =
      io_uring_register_files(&ring_, fds_.data(), static_cast<unsigned>(fds_.size())) == 0;
  buffers_sparse_ = io_uring_register_buffers_sparse(&ring_, kBufferSlots) == 0;
  if (buffers_sparse_) slots_.resize(kBufferSlots);
}

void UringBackend::start() {
  completion_thread_ = std::thread([this] { completion_loop(); });
}

UringBackend::~UringBackend() {
  if (completion_thread_.joinable()) {
    {
      std::lock_guard lock(sq_mutex_);
      // The store drains before destroying us, so the ring has room for the NOP.
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe != nullptr) {
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data64(sqe, kStopTag);
        while (io_uring_submit(&ring_) == -EINTR) {
        }
      }
    }
    completion_thread_.join();
  }
  io_uring_queue_exit(&ring_);
}

void UringBackend::submit(std::span<Chunk* const> chunks) {
  std::lock_guard lock(sq_mutex_);
  pending_.insert(pending_.end(), chunks.begin(), chunks.end());
  pump_locked();
}

void UringBackend::resubmit(Chunk* chunk) {
  std::lock_guard lock(sq_mutex_);
  pending_.push_front(chunk);
  pump_locked();
}

int UringBackend::fixed_index_locked(const std::byte* p, size_t bytes) const {
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.bytes != 0 && p >= s.base && bytes <= s.bytes &&
        static_cast<size_t>(p - s.base) <= s.bytes - bytes)
      return static_cast<int>(i);
  }
  return -1;
}

void UringBackend::pump_locked() {
  bool queued = false;
  while (in_flight_ < depth_ && !pending_.empty()) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) break;  // SQ full until the next submit
    Chunk* c = pending_.front();
    pending_.pop_front();
    std::byte* buf = c->buffer + c->done_bytes;
    const unsigned len = c->bytes - c->done_bytes;
    const uint64_t off = c->offset + c->done_bytes;
    const int fd = files_registered_ ? c->file : fds_[static_cast<size_t>(c->file)];
    const int fixed = fixed_bytes_.load(std::memory_order_relaxed) ? fixed_index_locked(buf, len) : -1;
    if (c->write) {
      if (fixed >= 0) io_uring_prep_write_fixed(sqe, fd, buf, len, off, fixed);
      else io_uring_prep_write(sqe, fd, buf, len, off);
    } else {
      if (fixed >= 0) io_uring_prep_read_fixed(sqe, fd, buf, len, off, fixed);
      else io_uring_prep_read(sqe, fd, buf, len, off);
    }
    if (files_registered_) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, c);
    ++in_flight_;
    // One chunk per submit, as fio submits: the kernel plugs a batch of
    // three or more and merges adjacent chunks of an extent into requests of
    // max_sectors_kb, which leaves the drive fewer requests in flight than
    // the queue depth (measured on this project's VM: a store's 2048 chunks of
    // 1 MiB in extents of 256 MiB went to the drive as 546 requests, and read
    // at 0.82-0.93 of fio's rate; one per submit, 0.98-1.05).
    submit_locked();
    queued = true;
  }
  if (!queued) return;
  submit_locked();  // what an earlier -EAGAIN left in the ring
}

void UringBackend::submit_locked() {
  int rc;
  do {
    rc = io_uring_submit(&ring_);
  } while (rc == -EINTR);
  // -EAGAIN/-EBUSY: the SQEs stay in the ring and go with the next submit,
  // which the completion thread makes after reaping.
}

void UringBackend::completion_loop() {
  constexpr unsigned kBatch = 64;
  io_uring_cqe* cqes[kBatch];
  std::pair<Chunk*, int> done[kBatch];
  for (;;) {
    io_uring_cqe* first = nullptr;
    int rc = io_uring_wait_cqe(&ring_, &first);
    if (rc == -EINTR || rc == -EAGAIN) continue;
    if (rc < 0) {
      // Should not happen with a valid ring; nothing sane to do but retry.
      continue;
    }
    const unsigned n = io_uring_peek_batch_cqe(&ring_, cqes, kBatch);
    bool stop = false;
    unsigned m = 0;
    for (unsigned i = 0; i < n; ++i) {
      if (io_uring_cqe_get_data64(cqes[i]) == kStopTag) {
        stop = true;
        continue;
      }
      done[m++] = {static_cast<Chunk*>(io_uring_cqe_get_data(cqes[i])), cqes[i]->res};
    }
    io_uring_cq_advance(&ring_, n);
    {
      // Refill the slots just freed before running the completions, so the
      // drive is not idle while they run (retries go to the front anyway).
      std::lock_guard lock(sq_mutex_);
      in_flight_ -= m;
      pump_locked();
    }
    for (unsigned i = 0; i < m; ++i) on_done_(done[i].first, done[i].second);
    if (stop) return;
  }
}

size_t UringBackend::register_memory(std::byte* base, size_t bytes) {
  if (!buffers_sparse_) return 0;
  std::lock_guard lock(sq_mutex_);
  size_t done = 0;
  size_t slot = 0;
  while (done < bytes) {
    while (slot < slots_.size() && slots_[slot].bytes != 0) ++slot;
    if (slot == slots_.size()) break;
    const size_t piece = std::min(kMaxFixedBuffer, bytes - done);
    iovec iov{base + done, piece};
    __u64 tag = 0;
    if (io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(slot), &iov, &tag, 1) != 1)
      break;  // memlock limit or no memory: the rest stays plain
    slots_[slot] = {base + done, piece};
    done += piece;
  }
  fixed_bytes_ += done;
  return done;
}

void UringBackend::unregister_memory(std::byte* base, size_t bytes) noexcept {
  std::lock_guard lock(sq_mutex_);
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (s.bytes == 0 || s.base < base || s.base >= base + bytes) continue;
    iovec iov{nullptr, 0};  // an empty slot (sparse)
    __u64 tag = 0;
    io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(i), &iov, &tag, 1);
    fixed_bytes_ -= s.bytes;
    s = {};
  }
}

std::string UringBackend::description() const {
  return fmt::format("io_uring (queue depth {}, {} files, {}, {})", depth_, fds_.size(),
                     files_registered_ ? "fixed files" : "plain files",
                     buffers_sparse_ ? "fixed-buffer table" : "no fixed buffers");
}

std::shared_ptr<MemoryRegistrar> UringBackend::registrar() {
  return std::make_shared<UringRegistrar>(weak_from_this());
}

size_t UringBackend::fixed_buffer_bytes() const { return fixed_bytes_.load(); }

}  // namespace strider::nvme_detail
