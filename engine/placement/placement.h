// Placement: what lives where, for one model and one engine configuration.
//
// One function of (ModelSpec, EngineConfig), computed before anything is
// allocated: the pieces (engine/placement/pieces.h), which of them keep their state on
// NVMe and in which extents, the slice of each block this rank keeps (data
// parallel with sharded state), the gradient ring's slots, the host store's
// blocks, every staging and device buffer's size, and the footprint those add
// up to. The Engine allocates from it and the Plan searches with it, so the
// plan's numbers are the engine's numbers by construction.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <c10/core/ScalarType.h>  // at::ScalarType

#include "engine/model/model_spec.h"
#include "engine/placement/pieces.h"
#include "host/param_store.h"  // BlockSpec, StoreOptions
#include "io/nvme_store.h"     // ExtentSpec

namespace strider {

struct EngineConfig;  // engine/config/engine_config.h: what place() reads

// The host format's kind of an NVMe extent of state (not kGrad).
inline StateKind state_kind(ExtentKind k) {
  return k == ExtentKind::kMaster ? StateKind::kMaster : k == ExtentKind::kAdamM ? StateKind::kAdamM : StateKind::kAdamV;
}

// What an Engine allocates: the same figures it sizes its buffers by.
struct EngineFootprint {
  uint64_t unit_elems = 0;          // parameters one cache unit holds (the largest visit's)
  uint64_t unit_grad_elems = 0;     // gradients one unit holds (what trains of the largest visit: Sharding::unit_grad_elems)
  int64_t vocab_shards = 1;         // embedding / LM-head shards (engine/placement/pieces.h)
  int64_t shard_rows = 0;           // vocabulary rows per shard
  int64_t head_chunk = 0;           // LM-head rows per logits chunk (Sharding::chunk: less than --vocab-chunk where a shard is)
  uint64_t unit_bytes = 0;          // one unit: parameters + fp32 gradients (of what trains: Sharding::unit_grad_elems)
  uint64_t pool_bytes = 0;          // K units
  uint64_t activation_bytes = 0;    // checkpoints (or the ring), output gradients, the batch, saved-activation slots
  int64_t saved_layers = 0;         // layers whose activations are kept (EngineConfig::saved_blocks)
  uint64_t saved_bytes_per_layer = 0;  // host bytes one such layer keeps, all micro-batches of a step
  uint64_t saved_host_bytes = 0;    // host bytes of all kept activations (part of host_bytes)
  uint64_t checkpoint_host_bytes = 0;  // host bytes of the block inputs kept for the backward (checkpoints_on_host)
  uint64_t logits_bytes = 0;        // device bytes of the kept logits (part of activation_bytes; a pool: the largest device's)
  uint64_t device_bytes = 0;        // pool + activations: every device allocation (a pool: its largest device's)
  uint64_t hand_off_bytes = 0;      // a pool: pinned host buffers the devices hand block outputs and
                                    // output gradients over (part of host_bytes)
  uint64_t host_bytes = 0;          // the pinned arena
  uint64_t optimizer_host_bytes = 0;  // of state_host_bytes, the RAM tier's master, m and v (sharded: this rank's slices)
  uint64_t shared_host_bytes = 0;   // the compute copy in shared memory (EngineConfig::shared_compute_file;
                                    // not in host_bytes: the machine's ranks hold it once)
  uint64_t state_host_bytes = 0;    // of it, the training state: the store (format, compute copy, gradient
                                    // staging), the tied gradient's, the NVMe staging and the gradient ring
  uint64_t nvme_bytes = 0;          // NVMe-tier state files
  // What the GPU page-locks (cudaHostRegister): what it copies to or from, the
  // arena less the optimizer state and the NVMe staging, plus the shared
  // compute copy. At most this; alignment slack aside, this.
  uint64_t registered_host_bytes = 0;
};

// A stretch of a piece's owned elements that AdamW updates alike: `n`
// elements at `at` from the owned elements' start (the piece's coordinates),
// at `block` in the block, decayed or not. Runs are cut where the piece's
// ranges end and where the weight decay changes (q8: on whole groups).
struct UpdateRun {
  size_t at = 0, block = 0, n = 0;
  bool decay = true;
};

// Where one piece's state and gradients live.
struct PiecePlace {
  bool on_nvme = false;        // its master, m and v live on NVMe (its block's do, and this rank keeps some)
  bool compute_on_nvme = false;  // its compute copy lives on NVMe too (EngineConfig::nvme_compute_blocks)
  size_t compute_staging_at = 0; // then: its compute copy's place in a load staging slot (bytes, 4 KiB aligned)
  int ring_slot = -1;          // the gradient ring slot it lands in, or -1: its block's own staging
  bool spills_grads = false;   // in the ring with clipping: its gradients wait for the norm on NVMe
  // The elements whose state this rank keeps, in the piece's coordinates
  // (engine/placement/pieces.h): the piece's part of this rank's slice of the block.
  ElemRange owned;
  std::vector<size_t> slices;  // the ranks' slice bounds cut to the piece, in the piece's coordinates
  // The owned elements range by range (the sums of squares' parts), and as
  // AdamW updates them. Shared, not copied: a slice of an MLP has a range per
  // row of down_proj (PlacementMemo).
  struct Runs {
    std::vector<PieceRun> owned;
    std::vector<UpdateRun> update;
  };
  std::shared_ptr<const Runs> run_lists;
  const std::vector<PieceRun>& owned_runs() const { return run_lists->owned; }
  const std::vector<UpdateRun>& runs() const { return run_lists->update; }
  size_t staging_at = 0;       // its gradients' place in its block's own staging (the block's pieces back to back)
};

struct Placement {
  int64_t blocks = 0, head = 0;         // the model's blocks; the head's index (the last)
  // The batch it is placed for: M micro-batches of micro_batch rows of seq tokens.
  int64_t micro_batch = 1, seq = 0, micro_batches = 1;
  int64_t batch() const { return micro_batch * micro_batches; }
  std::vector<ParamLayout> layouts;     // per block
  std::shared_ptr<const Sharding> sharding;  // shared, not copied (PlacementMemo)
  const Sharding& shards() const { return *sharding; }
  std::vector<PiecePlace> pieces;       // per piece
  // Pieces in the order their gradients leave the device: the LM-head
  // shards (untied; the head's norm just before the last, which computes
  // it), then backward's pieces (layers, then embedding shards, in reverse).
  std::vector<int64_t> landing;
  std::vector<bool> nvme_block;         // per block: its state lives on NVMe
  std::vector<bool> nvme_compute;       // per block: its compute copy lives on NVMe too
  std::vector<std::vector<size_t>> block_slices;  // per block: the ranks' slice bounds (rank_slices)
  std::vector<int64_t> saved_index;     // per block: its index among the layers that keep activations, or -1
  // The host store: its blocks and their format.
  std::vector<BlockSpec> store_blocks;
  StoreOptions store;
  std::vector<ExtentSpec> extents;      // NVMe: master, m, v (and spilled gradients) per NVMe-tier piece
  size_t compute_bytes = 2;             // per element of the compute copy: 2 (bf16) or 4 (fp32)
  size_t grad_bytes = 2;                // per element of gradients on the host: 2 (bf16) or 4 (fp32)
  size_t ring_slot_bytes = 0;           // one gradient ring slot (0: no piece lands in the ring)
  size_t nvme_slot_bytes = 0;           // one NVMe staging buffer (of master, m, v, spilled gradients)
  // Compute copies on NVMe: one update staging slot's buffer for a piece's
  // compute copy (nvme_compute_slot_bytes; each of the 2 slots has one), and
  // one load staging slot (a layer's pieces' compute copies, each 4 KiB
  // aligned), of which there are kComputeLoadSlots; 0: none on NVMe.
  size_t nvme_compute_slot_bytes = 0;
  size_t compute_load_slot_bytes = 0;
  size_t act_bytes = 0;                 // one micro-batch's hidden states [micro_batch, seq, hidden]
  // A pool's hand-off of a block's input (or output gradient) for one
  // micro-batch: act_bytes, then, with the load-balancing loss, the
  // micro-batch's routing statistics so far (fp32 [2, experts], at
  // hand_stats_at), so that every layer adds its own into one running sum in
  // layer order, as on one device, and each backward reads the whole sum.
  size_t hand_block_bytes = 0, hand_stats_at = 0, hand_stats_bytes = 0;
  size_t saved_bytes = 0;               // one micro-batch's kept activations of one layer
  // The largest quantized base's bytes (EngineConfig::base_format): each
  // cache unit's staging for them (0: none).
  size_t base_staging_bytes = 0;
  EngineFootprint footprint;

  int devices = 1;                      // the pool's devices (EngineConfig::devices)
  // The pool's device that runs block b's visits (forward and backward):
  // round robin over the blocks, so consecutive blocks run on consecutive
  // devices and a block's backward finds its forward's checkpoints and kept
  // activations where they were made.
  int block_device(int64_t b) const { return int(b % devices); }
  // The device that runs the head's visits of vocabulary shard s (both
  // passes): the round robin goes on over the shards, so a head of several
  // shards is spread over the pool instead of being one device's long turn.
  // The last shard's device computes the loss and the final norm's backward.
  int head_device(int64_t s) const { return int((head + s) % devices); }
  int last_head_device() const { return head_device(shards().shards - 1); }
  // Device d runs a visit of the head.
  bool runs_head(int d) const {
    for (int64_t s = 0; s < std::min<int64_t>(shards().shards, devices); ++s)
      if (head_device(s) == d) return true;
    return false;
  }
  // Vocabulary shard s's rows.
  int64_t shard_rows(int64_t s) const {
    const Piece& p = piece(shards().lm_piece[size_t(s)]);
    return p.row_end - p.row_begin;
  }
  // The vocabulary rows of the head's shards that device d runs: the columns
  // of its kept logits, its shards' in shard order (head_column: where
  // shard s's start there). A pool's device keeps its own shards' logits only.
  int64_t head_rows(int d) const {
    int64_t n = 0;
    for (int64_t s = 0; s < shards().shards; ++s)
      if (head_device(s) == d) n += shard_rows(s);
    return n;
  }
  int64_t head_column(int64_t s) const {
    int64_t at = 0;
    for (int64_t t = 0; t < s; ++t)
      if (head_device(t) == head_device(s)) at += shard_rows(t);
    return at;
  }
  // Shard s is the first of the head's shards on its device (it takes the head's input there).
  bool first_head_shard_on_device(int64_t s) const { return s < devices; }
  // The device that sends piece p's gradients: its block's, or the head's
  // shard's (the final norm's: the last shard's).
  int piece_device(int64_t p) const {
    const int64_t b = piece(p).block;
    if (b < head) return block_device(b);
    if (p == shards().norm_piece) return last_head_device();
    for (int64_t s = 0; s < shards().shards; ++s)
      if (shards().lm_piece[size_t(s)] == p) return head_device(s);
    return block_device(b);
  }
  // The block inputs' buffers on a device: with host checkpoints a ring of
  // two sets (block b's in set b % 2, copied out after the forward and back
  // before the backward), else one per block (block b's in set b - 1).
  bool input_ring = false;
  int64_t input_sets() const { return input_ring ? 2 : head; }
  int64_t input_set(int64_t b) const { return input_ring ? b % 2 : b - 1; }
  // Device d holds block b's input checkpoints (no host checkpoints): it
  // runs block b (which reads them; the head: any of its shards) or block
  // b - 1 (which writes them).
  bool holds_input(int d, int64_t b) const {
    return (b == head ? runs_head(d) : block_device(b) == d) || block_device(b - 1) == d;
  }
  // The head's per-token state, log-sum-exp and hidden gradient cross
  // between devices (its shards run on more than one).
  bool head_spread() const { return devices > 1 && shards().shards > 1; }
  // Device d runs a decoder layer that keeps its activations (it holds the two kept-activation slots).
  bool runs_kept_layer(int d) const {
    for (int64_t b = 1; b < head; ++b)
      if (saved_index[size_t(b)] >= 0 && block_device(b) == d) return true;
    return false;
  }

  // Block b is a layer cut into sub-layer pieces (EngineConfig::mlp_pieces);
  // how many of those device d runs (it holds their buffers, engine_core.h).
  bool cut(int64_t b) const { return b > 0 && b < head && piece(shards().first_of(b)).sub_layer; }
  int64_t cut_layers(int d) const {
    int64_t n = 0;
    for (int64_t b = 1; b < head; ++b) n += cut(b) && block_device(b) == d;
    return n;
  }

  // The first block in forward order with a trained piece: the backward
  // stops there, since no block before it needs a gradient (LoRA over a
  // frozen embedding: the embedding has no backward visit).
  int64_t first_trained_block() const {
    for (int64_t p = 0; p < num_pieces(); ++p)
      if (!piece(p).frozen) return piece(p).block;
    return head;
  }

  int64_t num_pieces() const { return int64_t(pieces.size()); }
  const Piece& piece(int64_t p) const { return shards().pieces[size_t(p)]; }
  const PiecePlace& at(int64_t p) const { return pieces[size_t(p)]; }
};

// Alignment of every host carve and NVMe staging buffer: O_DIRECT needs 4 KiB.
inline constexpr size_t kHostAlign = 4096;
// Load staging slots of compute copies read from NVMe: a visit's read is
// issued one load ahead of its own, so one slot is being read into, one is
// being copied to the device, and one is free for the read after.
inline constexpr int kComputeLoadSlots = 3;

// Throws, naming the field, where an engine could not run the configuration
// on the model (seq past its positions, a window under 2, q8 without bf16, ...).
void check_config(const ModelSpec& spec, const EngineConfig& config);
// Throws, naming the field, where the configuration cannot be placed (an
// NVMe or kept-activation block out of range or listed twice, no ring slot).
Placement place(const ModelSpec& spec, const EngineConfig& config);
// While one lives on this thread, place() takes the sharding, the layouts and
// the pieces' runs from an earlier call with the same model and cut instead
// of making them again. A plan places hundreds of trial configurations that
// differ only in the window, the batch, or which blocks go to NVMe, and a
// layer cut into MLP slices has a range per row of down_proj (16384 a slice
// in Llama-3.1-405B): made afresh, each placement of such a model took a
// tenth of a second or more, and a plan minutes. Scopes nest (the outermost
// keeps the memo); what it keeps goes with it.
class PlacementMemo {
 public:
  PlacementMemo();
  ~PlacementMemo();
  PlacementMemo(const PlacementMemo&) = delete;
  PlacementMemo& operator=(const PlacementMemo&) = delete;
  struct State;

 private:
  std::unique_ptr<State> own_;  // null where an outer scope holds the memo
};
inline EngineFootprint footprint(const ModelSpec& spec, const EngineConfig& config) {
  return place(spec, config).footprint;
}
// Data parallel on one machine (PlanLimits::shared_compute): the bytes of the
// compute copy its ranks share, held once outside their arenas.
uint64_t shared_compute_bytes(const ModelSpec& spec, at::ScalarType dtype);

}  // namespace strider
