// ParamStore: every block's training state in one PinnedArena, flat per block
// and per kind (docs/design.md, "The data, and where it lives"):
//   master, m, v   in the run's StateFormat (host/state_format.h): fp32, or
//                  q8 (an 8-bit master extension, 8-bit m and v codes with
//                  their groups' scales); host-resident unless the block's
//                  state lives on NVMe
//   compute        the copy the device computes with, the source of every
//                  H2D: bf16 or fp16 (compute), or fp32 (compute_f32) for exactness runs
//   grad           staging for the block's gradients after D2H (bf16 or fp32)
//   reference      (StoreOptions::keep_reference) a frozen copy of the compute
//                  copy as training starts: the reference model of full
//                  fine-tuning's objectives, streamed in its place
// All kinds of a block share its ParamLayout's element offsets, less the
// state's slice start (BlockSpec::state_begin; 0 unless the state is sharded).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "host/base_format.h"
#include "host/dtype.h"
#include "host/param_layout.h"
#include "host/pinned_arena.h"
#include "host/state_format.h"

namespace strider {

struct BlockSpec {
  ParamLayout layout;
  bool state_on_host = true;  // false: master/m/v live on NVMe (io/), no host spans
  bool grad_staging = true;   // false: the block's gradients are staged elsewhere (empty grad span)
  // The elements [state_begin, state_end) whose master, m and v this store
  // keeps (data parallel with sharded state: this rank's slice; whole q8
  // groups). The compute copy and the gradient staging are always whole.
  size_t state_begin = 0, state_end = SIZE_MAX;
  // The gradient staging's elements (its trained pieces' back to back, when
  // some are frozen); SIZE_MAX: the block's.
  size_t grad_elems = SIZE_MAX;
  // A frozen base held in a quantized format (host/base_format.h): its
  // elements [0, base.elems) have no compute copy, only these base bytes.
  // Empty: the compute copy covers the whole block.
  BaseLayout base;
  // false: the compute copy lives on NVMe too (its state must): no compute
  // span; the engine reads it into staging ahead of each load.
  bool compute_on_host = true;
};

struct StoreOptions {
  DType grad_dtype = DType::kBF16;     // kBF16 or kF32
  DType compute_dtype = DType::kBF16;  // kBF16, kF16, or kF32 (fp32 compute for exactness tests)
  StateFormat format = StateFormat::kFp32;  // q8 needs the bf16 compute copy (its master's high half)
  bool zero = true;                    // false: leave the memory untouched (simulation)
  // A second compute copy per block, never updated: the starting weights
  // (BlockState::reference). Host-resident compute copies only.
  bool keep_reference = false;
};

// One block's views into the arena. Spans of a kind are empty when the kind
// does not live on the host.
struct BlockState {
  const ParamLayout* layout = nullptr;
  std::span<float> master, m, v;      // fp32 format, else empty; elements [state_begin, state_end) of the block
  // q8 format (host/adam_q8.h), else empty: the master's extension, the
  // moments' codes and their groups' scales.
  std::span<uint8_t> ext, m_codes, v_codes;
  std::span<float> m_scale, v_scale;
  StateFormat format = StateFormat::kFp32;
  // The compute copy of elements [compute_begin, elems()): element i at
  // compute[i - compute_begin]. compute_begin is 0 unless a quantized base
  // holds the block's first elements (base, base_layout).
  std::span<uint16_t> compute;       // bf16 or fp16 bits (compute_dtype kBF16 or kF16), else empty
  std::span<float> compute_f32;      // compute_dtype kF32, else empty
  DType compute_dtype = DType::kBF16;
  size_t compute_begin = 0;
  std::span<std::byte> base;         // a quantized base's bytes (BlockSpec::base), else empty
  const BaseLayout* base_layout = nullptr;
  std::span<std::byte> grad;         // grad_dtype elements, BlockSpec::grad_elems of them (or empty)
  DType grad_dtype = DType::kBF16;
  bool state_on_host = true;
  bool compute_on_host = true;       // false: no compute span (BlockSpec::compute_on_host)
  size_t state_begin = 0, state_end = 0;  // the state's slice of the block (BlockSpec)
  // StoreOptions::keep_reference: the compute copy's frozen twin, the same
  // elements and dtype (its bytes as compute_bytes() gives them), else empty.
  std::span<std::byte> reference;

  size_t elems() const { return layout->total_elems(); }
  size_t state_elems() const { return state_end - state_begin; }
  // The compute copy's bytes, whatever its dtype (what an H2D sends).
  std::span<std::byte> compute_bytes() const {
    return compute.empty() ? std::as_writable_bytes(compute_f32) : std::as_writable_bytes(compute);
  }
  // Block elements [begin, begin + n) of the compute copy, as bytes; throws
  // where they reach into a quantized base.
  std::span<std::byte> compute_range(size_t begin, size_t n) const;
  // The same elements of the reference (which must be kept).
  std::span<std::byte> reference_range(size_t begin, size_t n) const;
  // The bf16 compute copy from block element `at` on (the q8 master's high half).
  uint16_t* compute_at(size_t at) const { return compute.data() + (at - compute_begin); }
};

class ParamStore {
 public:
  // Arena bytes the store will carve for these blocks (alignment included), so
  // the caller can size the arena (and the planner can refuse) before mapping.
  static size_t bytes_needed(const std::vector<BlockSpec>& blocks, const StoreOptions& options);
  // Of those, the compute copies' (what a separate compute arena takes instead).
  static size_t compute_bytes_needed(const std::vector<BlockSpec>& blocks, const StoreOptions& options);
  // Of those, the reference copies (StoreOptions::keep_reference).
  static size_t reference_bytes_needed(const std::vector<BlockSpec>& blocks, const StoreOptions& options);
  // Of those, the host-resident master, m and v (their slices).
  static size_t state_bytes_needed(const std::vector<BlockSpec>& blocks, const StoreOptions& options);

  // Carves every block's buffers from `arena` and zeroes them (m and v start at
  // zero; padding stays zero forever). Throws when the arena is too small.
  // `compute_arena`: where the compute copies are carved instead (shared
  // memory that other processes map too: left as it is, never zeroed, since
  // they may have written their slices already; a new file reads zero).
  ParamStore(std::vector<BlockSpec> blocks, StoreOptions options, PinnedArena& arena,
             PinnedArena* compute_arena = nullptr);
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
  // master, elements [begin, end) (default: all). For host-resident fp32 state.
  void refresh_compute(size_t b, size_t begin = 0, size_t end = SIZE_MAX);
  // Writes every host-resident block's compute copy from its master (after a
  // load). A no-op in q8, where the compute copy is part of the master.
  // Blocks whose compute copy is on NVMe have none to write.
  void refresh_compute_from_master();
  // Copies every block's compute copy into its reference (keep_reference):
  // the reference model is then the weights as they are now.
  void take_reference();

  // A host-resident block's state of one kind as floats (state_elems() of
  // them: its slice), whatever the format, and back (q8: rounded to nearest;
  // writing the master rewrites the compute copy's slice).
  void read_kind(size_t b, StateKind kind, std::span<float> out) const;
  void write_kind(size_t b, StateKind kind, std::span<const float> in);

 private:
  std::vector<BlockSpec> specs_;
  StoreOptions options_;
  std::vector<BlockState> blocks_;
};

}  // namespace strider
