// The seam between NvmeStore and the code that moves bytes: a backend runs
// chunk-sized positional reads/writes with a bounded number in flight and hands
// each attempt's result to one completion thread. Two implementations:
// UringBackend (io_uring, registered files and buffers) and PosixIoPool
// (pread/pwrite on a thread pool, for kernels or sandboxes without io_uring).
// Internal to io/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "host/pinned_arena.h"

namespace strider::nvme_detail {

struct Request;

// One chunk of a request. The backend runs the *remaining* part of it,
// [offset + done_bytes, offset + bytes), from buffer + done_bytes.
struct Chunk {
  Request* request = nullptr;
  int file = 0;              // index into the backend's file descriptors
  uint64_t offset = 0;       // file offset of the chunk's first byte (4 KiB aligned)
  std::byte* buffer = nullptr;
  uint32_t bytes = 0;
  uint32_t done_bytes = 0;   // advanced by the store on short transfers
  uint32_t attempts = 0;     // retries so far (EAGAIN, short transfers)
  bool write = false;
  bool finished = false;     // transferred in full (set by the store)
};

// Called on the completion thread with the result of one attempt: bytes moved,
// or -errno. It may call IoBackend::resubmit for the same chunk.
using ChunkDone = std::function<void(Chunk*, int res)>;

class IoBackend {
 public:
  virtual ~IoBackend() = default;  // stops the threads; nothing may be in flight
  // Queues chunks (FIFO); at most the queue depth run at once. Thread-safe.
  virtual void submit(std::span<Chunk* const> chunks) = 0;
  // Re-queues a chunk ahead of the others (called from the completion thread).
  virtual void resubmit(Chunk* chunk) = 0;
  // "io_uring (fixed files, ...)" or "pread/pwrite thread pool (...)".
  virtual std::string description() const = 0;
  // Registers memory as fixed buffers where the backend has them (no-op otherwise).
  virtual std::shared_ptr<MemoryRegistrar> registrar() = 0;
  // Bytes currently registered as fixed buffers.
  virtual size_t fixed_buffer_bytes() const = 0;
};

// Thrown by UringBackend's constructor when the kernel refuses io_uring
// (ENOSYS, EPERM, ...): the store then falls back to PosixIoPool.
struct UringUnavailable {
  int err;
  std::string what;
};

}  // namespace strider::nvme_detail
