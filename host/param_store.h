// ParamStore: every block's training state in one PinnedArena, flat per block
// and per kind (DESIGN.md, "The data, and where it lives"):
//   master, m, v   fp32, host-resident unless the block's state lives on NVMe
//   compute        the copy the device computes with, the source of every
//                  H2D: bf16 (compute), or fp32 (compute_f32) for exactness runs
//   grad           staging for the block's gradients after D2H (bf16 or fp32)
// All kinds of a block share its ParamLayout's element offsets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "host/dtype.h"
#include "host/param_layout.h"
#include "host/pinned_arena.h"

namespace strider {

struct BlockSpec {
  ParamLayout layout;
  bool state_on_host = true;  // false: master/m/v live on NVMe (io/), no host spans
  bool grad_staging = true;   // false: the block's gradients are staged elsewhere (empty grad span)
};

struct StoreOptions {
  DType grad_dtype = DType::kBF16;     // kBF16 or kF32
  DType compute_dtype = DType::kBF16;  // kBF16 or kF32 (fp32 compute for exactness tests)
  bool zero = true;                    // false: leave the memory untouched (simulation)
};

// One block's views into the arena. Spans of a kind are empty when the kind
// does not live on the host.
struct BlockState {
  const ParamLayout* layout = nullptr;
  std::span<float> master, m, v;
  std::span<uint16_t> compute;       // bf16 bits (compute_dtype kBF16), else empty
  std::span<float> compute_f32;      // compute_dtype kF32, else empty
  std::span<std::byte> grad;         // grad_dtype elements, layout->total_elems() of them (or empty)
  DType grad_dtype = DType::kBF16;
  bool state_on_host = true;

  size_t elems() const { return layout->total_elems(); }
  // The compute copy's bytes, whatever its dtype (what an H2D sends).
  std::span<std::byte> compute_bytes() const {
    return compute.empty() ? std::as_writable_bytes(compute_f32) : std::as_writable_bytes(compute);
  }
};

class ParamStore {
 public:
  // Arena bytes the store will carve for these blocks (alignment included), so
  // the caller can size the arena (and the planner can refuse) before mapping.
  static size_t bytes_needed(const std::vector<BlockSpec>& blocks, const StoreOptions& options);

  // Carves every block's buffers from `arena` and zeroes them (m and v start at
  // zero; padding stays zero forever). Throws when the arena is too small.
  ParamStore(std::vector<BlockSpec> blocks, StoreOptions options, PinnedArena& arena);
  ParamStore(const ParamStore&) = delete;
  ParamStore& operator=(const ParamStore&) = delete;

  size_t num_blocks() const { return blocks_.size(); }
  BlockState& block(size_t i);
  const BlockState& block(size_t i) const;
  const ParamLayout& layout(size_t i) const { return specs_.at(i).layout; }
  const StoreOptions& options() const { return options_; }
  // Parameters (no padding) over all blocks.
  size_t param_elems() const;
  // The largest block's total_elems(): what one cache unit must hold.
  size_t max_block_elems() const;

  // One tensor's slice of a kind, by block and checkpoint name.
  std::span<float> master_of(size_t block, std::string_view tensor);
  std::span<uint16_t> compute_of(size_t block, std::string_view tensor);

  // Writes block b's compute copy (bf16 rounded, or fp32 copied) from its fp32
  // master, elements [begin, end) (default: all). For host-resident state.
  void refresh_compute(size_t b, size_t begin = 0, size_t end = SIZE_MAX);
  // Writes every host-resident block's compute copy from its master (after a load).
  void refresh_compute_from_master();

 private:
  std::vector<BlockSpec> specs_;
  StoreOptions options_;
  std::vector<BlockState> blocks_;
};

}  // namespace strider
