// The state of one NvmeStore read or write, shared by its ticket and by the
// store while in flight, and the per-extent checksum slot. Internal to io/.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "io/checksum.h"
#include "io/nvme_backend.h"
#include "io/nvme_store.h"

namespace strider::nvme_detail {

struct Request {
  const Extent* extent = nullptr;
  bool write = false;
  std::byte* buffer = nullptr;
  uint64_t checksum = 0;  // read: the one expected; write: set at the end
  // Hashed chunk by chunk, in order, as chunks complete: the completion thread
  // never stalls on a whole extent, so the queue keeps the drive busy.
  Checksum64Stream hash;
  size_t hashed_chunks = 0;
  NvmeCallback callback;
  std::vector<Chunk> chunks;
  // Touched only on the completion thread (one thread reaps every chunk).
  size_t remaining = 0;
  std::string error_text;  // the first chunk error
  std::shared_ptr<Request> self;  // keeps it alive while in flight

  std::mutex mutex;  // done, error
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
};

}  // namespace strider::nvme_detail

namespace strider {

struct NvmeStore::Slot {
  enum State : uint8_t { kEmpty, kValid, kWriting, kFailed };
  State state = kEmpty;
  uint64_t checksum = 0;
  static const char* state_name(State s) {
    switch (s) {
      case kEmpty: return "never written";
      case kValid: return "valid";
      case kWriting: return "a write is in flight";
      case kFailed: return "its last write failed";
    }
    return "unknown";
  }
};

}  // namespace strider
