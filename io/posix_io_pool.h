// PosixIoPool: the fallback NVMe backend for kernels or sandboxes that refuse
// io_uring (ENOSYS, EPERM under seccomp). `queue_depth` worker threads each run
// one pread/pwrite at a time, so the depth bound is the same as with io_uring;
// results go through one completion thread, like io_uring's CQ. Internal to io/.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "io/nvme_backend.h"

namespace strider::nvme_detail {

class PosixIoPool final : public IoBackend {
 public:
  PosixIoPool(std::vector<int> fds, unsigned queue_depth, ChunkDone on_done);
  ~PosixIoPool() override;
  PosixIoPool(const PosixIoPool&) = delete;
  PosixIoPool& operator=(const PosixIoPool&) = delete;

  void submit(std::span<Chunk* const> chunks) override;
  void resubmit(Chunk* chunk) override;
  std::string description() const override;
  std::shared_ptr<MemoryRegistrar> registrar() override;
  size_t fixed_buffer_bytes() const override { return 0; }

 private:
  void stop() noexcept;  // joins every thread; idempotent
  void worker_loop();
  void completion_loop();

  std::vector<int> fds_;
  ChunkDone on_done_;

  std::mutex work_mutex_;
  std::condition_variable work_cv_;
  std::deque<Chunk*> work_;
  bool stopping_ = false;

  std::mutex done_mutex_;
  std::condition_variable done_cv_;
  std::deque<std::pair<Chunk*, int>> done_;
  bool done_stopping_ = false;

  std::vector<std::thread> workers_;
  std::thread completion_thread_;
};

}  // namespace strider::nvme_detail
