// The state of one NvmeStore read or write, shared by its ticket and by the
// store while in flight, and the per-extent checksum slot. Internal to io/.
#pragma once

#include <atomic>
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
  // The checksum is the XXH3 of the XXH3s of each kChecksumPieceBytes piece
  // (extent_checksum64): pieces are hashed independently on the store's hash
  // threads (a write's as soon as it is submitted, a read's as soon as the
  // chunks covering it are in), so neither the completion thread nor a single
  // core bounds the throughput.
  std::vector<uint64_t> piece_hashes;
  // Read only: chunks still to complete per piece; the one taking it to 0
  // queues the piece for hashing.
  std::unique_ptr<std::atomic<uint32_t>[]> piece_waits;
  NvmeCallback callback;
  std::vector<Chunk> chunks;
  // Chunks not yet done + pieces not yet hashed; whoever takes it to 0 (the
  // completion thread or a hash thread) finishes the request.
  std::atomic<size_t> remaining{0};
  // Set (after error_text) by the completion thread on a chunk error: pieces
  // still queued skip hashing.
  std::atomic<bool> failed{false};
  std::string error_text;  // the first chunk error; written on the completion thread only
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
