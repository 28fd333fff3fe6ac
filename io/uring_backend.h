// UringBackend: the io_uring implementation of the NVMe backend. One ring; any
// thread submits (under a mutex that guards the submission queue), one
// completion thread reaps. The files are registered (IOSQE_FIXED_FILE) and
// memory attached through registrar() becomes fixed buffers (READ_FIXED /
// WRITE_FIXED), which saves the kernel a page pin per request. Internal to io/.
#pragma once

#include <liburing.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "io/nvme_backend.h"

namespace strider::nvme_detail {

class UringBackend final : public IoBackend, public std::enable_shared_from_this<UringBackend> {
 public:
  // Throws UringUnavailable when io_uring_queue_init is refused by the kernel,
  // strider::Error for other failures. Call start() once the object is owned by
  // a shared_ptr.
  UringBackend(std::vector<int> fds, unsigned queue_depth, ChunkDone on_done);
  ~UringBackend() override;
  UringBackend(const UringBackend&) = delete;
  UringBackend& operator=(const UringBackend&) = delete;

  void start();
  void submit(std::span<Chunk* const> chunks) override;
  void resubmit(Chunk* chunk) override;
  std::string description() const override;
  std::shared_ptr<MemoryRegistrar> registrar() override;
  size_t fixed_buffer_bytes() const override;

  // For the registrar: registers [base, base + bytes) in pieces of at most
  // 1 GiB (the kernel's limit per buffer); stops quietly at the first refusal
  // (memlock limit), leaving the rest plain. Returns the bytes registered.
  size_t register_memory(std::byte* base, size_t bytes);
  void unregister_memory(std::byte* base, size_t bytes) noexcept;

 private:
  struct Slot {
    std::byte* base = nullptr;
    size_t bytes = 0;
  };
  void completion_loop();
  void pump_locked();  // moves pending chunks into the ring; needs sq_mutex_
  void submit_locked();  // io_uring_submit, retried on EINTR; needs sq_mutex_
  int fixed_index_locked(const std::byte* p, size_t bytes) const;

  io_uring ring_{};
  std::vector<int> fds_;
  bool files_registered_ = false;
  bool buffers_sparse_ = false;  // a sparse table exists; slots fill on demand
  unsigned depth_;
  ChunkDone on_done_;

  mutable std::mutex sq_mutex_;  // ring submission side, pending_, slots_
  std::deque<Chunk*> pending_;
  unsigned in_flight_ = 0;
  std::vector<Slot> slots_;
  std::atomic<size_t> fixed_bytes_{0};
  std::thread completion_thread_;
};

}  // namespace strider::nvme_detail
