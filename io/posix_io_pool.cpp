#include "io/posix_io_pool.h"

#include <unistd.h>

#include <cerrno>

#include "host/error.h"

namespace strider::nvme_detail {
namespace {

class NullRegistrar final : public MemoryRegistrar {
 public:
  void register_memory(void*, size_t) override {}
  void unregister_memory(void*, size_t) noexcept override {}
  std::string_view name() const override { return "io_uring fixed buffers (none: pread/pwrite)"; }
};

}  // namespace

PosixIoPool::PosixIoPool(std::vector<int> fds, unsigned queue_depth, ChunkDone on_done)
    : fds_(std::move(fds)), on_done_(std::move(on_done)) {
  try {
    completion_thread_ = std::thread([this] { completion_loop(); });
    for (unsigned i = 0; i < queue_depth; ++i) workers_.emplace_back([this] { worker_loop(); });
  } catch (const std::system_error& e) {
    stop();  // joins what started
    throw Error(fmt::format("pread/pwrite pool: cannot start {} threads: {}", queue_depth + 1,
                            e.what()));
  }
}

PosixIoPool::~PosixIoPool() { stop(); }

void PosixIoPool::stop() noexcept {
  {
    std::lock_guard lock(work_mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_)
    if (t.joinable()) t.join();
  workers_.clear();
  {
    std::lock_guard lock(done_mutex_);
    done_stopping_ = true;
  }
  done_cv_.notify_all();
  if (completion_thread_.joinable()) completion_thread_.join();
}

void PosixIoPool::submit(std::span<Chunk* const> chunks) {
  {
    std::lock_guard lock(work_mutex_);
    work_.insert(work_.end(), chunks.begin(), chunks.end());
  }
  work_cv_.notify_all();
}

void PosixIoPool::resubmit(Chunk* chunk) {
  {
    std::lock_guard lock(work_mutex_);
    work_.push_front(chunk);
  }
  work_cv_.notify_one();
}

void PosixIoPool::worker_loop() {
  for (;;) {
    Chunk* c;
    {
      std::unique_lock lock(work_mutex_);
      work_cv_.wait(lock, [&] { return stopping_ || !work_.empty(); });
      if (work_.empty()) return;  // stopping, and the store drained first
      c = work_.front();
      work_.pop_front();
    }
    // One syscall per attempt: a short transfer is reported as such and the
    // store resubmits the remainder, exactly as with io_uring.
    std::byte* buf = c->buffer + c->done_bytes;
    const size_t len = c->bytes - c->done_bytes;
    const off_t off = static_cast<off_t>(c->offset + c->done_bytes);
    const int fd = fds_[static_cast<size_t>(c->file)];
    ssize_t n = c->write ? pwrite(fd, buf, len, off) : pread(fd, buf, len, off);
    const int res = n < 0 ? -errno : static_cast<int>(n);
    {
      std::lock_guard lock(done_mutex_);
      done_.emplace_back(c, res);
    }
    done_cv_.notify_one();
  }
}

void PosixIoPool::completion_loop() {
  for (;;) {
    std::pair<Chunk*, int> item;
    {
      std::unique_lock lock(done_mutex_);
      done_cv_.wait(lock, [&] { return done_stopping_ || !done_.empty(); });
      if (done_.empty()) return;
      item = done_.front();
      done_.pop_front();
    }
    on_done_(item.first, item.second);
  }
}

std::string PosixIoPool::description() const {
  return fmt::format("pread/pwrite thread pool ({} threads, {} files)", workers_.size(),
                     fds_.size());
}

std::shared_ptr<MemoryRegistrar> PosixIoPool::registrar() {
  return std::make_shared<NullRegistrar>();
}

}  // namespace strider::nvme_detail
