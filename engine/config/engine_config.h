// EngineConfig: how one Engine runs a step (shapes, dtypes, window, tiers,
// the optimizer, data parallel's share). Placement (engine/placement/placement.h) says
// what follows from it for a model: what lives where and what is allocated.
#pragma once

// The executors (device_pass.cpp, device_ops.cpp, host_update.cpp, ...:
// engine/CMakeLists.txt names them) read the program and the placement, never
// this: every feature decision is a pass's (engine/program/passes.h).
#ifdef STRIDER_EXECUTOR
#error "an executor includes engine/config/engine_config.h: read the step program or the placement instead"
#endif

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/config/compute_options.h"
#include "engine/config/loss_scaling.h"
#include "engine/config/lr_schedule.h"
#include "engine/config/objective_config.h"
#include "host/base_format.h"
#include "host/cpu_adam.h"         // AdamHyper
#include "host/pinned_arena.h"     // LockPolicy
#include "host/state_format.h"
#include "io/nvme_store.h"         // NvmeBackend, ExtentKind

namespace strider {

struct EngineConfig {
  int64_t seq = 128;
  int64_t micro_batch = 1;     // sequences per micro-batch
  int64_t accumulation = 1;    // micro-batches per optimizer step (M)
  ComputeOptions compute;      // dtype and LM-head vocabulary chunk
  int64_t window = 2;          // K cache units on the device
  bool checkpoints_on_host = false;  // block inputs copied out to pinned host memory
  AdamHyper adam;
  LrSchedule schedule;
  // false: weight decay spares norms and biases (transformers' Trainer's rule,
  // engine/model/model_spec.h weight_decays); true: it decays every tensor.
  bool decay_norms_and_biases = false;
  double clip_norm = 0;        // > 0: exact global-norm clipping
  int optimizer_threads = 0;   // 0: all hardware threads
  // How master, m and v are stored (host/state_format.h): fp32 (exact), or
  // q8 (3.06 bytes per parameter; needs the bf16 compute dtype).
  StateFormat optimizer_state = StateFormat::kFp32;
  // Where pieces must start for that format (make_sharding's align_elems).
  int64_t shard_align() const { return optimizer_state == StateFormat::kQ8 ? int64_t(kQ8GroupElems) : 1; }
  std::string nvme_dir;        // where NVMe-tier state lives (needed if nvme_blocks is not empty)
  std::vector<int64_t> nvme_blocks;  // blocks whose fp32 master/m/v live on NVMe
  // Decoder layers among nvme_blocks whose compute copy lives on NVMe too:
  // read into pinned staging ahead of each load that needs it (forward and
  // backward), written back with the state after each update.
  std::vector<int64_t> nvme_compute_blocks;
  int64_t grad_ring = 3;       // gradient staging slots shared by ring blocks (>= 1; see above)
  // Vocabulary rows per embedding / LM-head shard (engine/placement/pieces.h); 0: the
  // most whole LM-head chunks whose visit fits in the largest layer's unit.
  int64_t vocab_shard_rows = 0;
  // Each decoder layer cut into pieces by tensor name (engine/placement/pieces.h,
  // layer_piece_ranges): "input_layernorm+post_attention_layernorm,self_attn+mlp"
  // makes two pieces, the norms (two ranges of the block) and the
  // projections (two more). Each piece has its own gradient copy, ring slot,
  // checks, AdamW job and NVMe extents; the layer's visit still loads them
  // all, in the block's layout. Placement, not maths: the same bits as one
  // piece per layer (clipping aside: the norm adds its parts per range). Empty:
  // one piece per layer.
  std::string layer_pieces;
  // A mixture-of-experts layer's experts in pieces of this many
  // (engine/placement/pieces.h, expert_piece_ranges), taken out of the pieces
  // layer_pieces makes; its attention and router stay there. Placement, as
  // layer_pieces is. 0: the experts stay in the layer's pieces.
  int64_t expert_pieces = 0;
  // Every decoder layer cut into sub-layer pieces (engine/placement/pieces.h,
  // mlp_slice_ranges; gpu/blocks/layer_cut.h): its attention half and this many
  // slices of its MLP along the intermediate dimension, each a visit of its
  // own, so that a cache unit holds the largest piece, not a layer. Maths,
  // not only placement: the slices' partial outputs are summed in fp32, so
  // the bits are a cut layer's (the same for every placement), within fp32
  // rounding of the whole layer's. 0: whole layers.
  int64_t mlp_pieces = 0;
  // LoRA adapters over a frozen base (engine/model/lora.h, LoraSpec::parse's
  // text); empty: every parameter trains. The Engine gives it to its
  // ModelSpec (ModelSpec::with_lora), whose layouts then hold the adapters.
  std::string lora;
  // How a LoRA base's frozen weight matrices are held on the host and sent
  // to the device (host/base_format.h): the compute dtype, or int8 or NF4,
  // quantized once at load and dequantized on the device at each visit.
  BaseFormat base_format = BaseFormat::kCompute;
  // Gradients are summed in fp32 on the device over the micro-batches, then
  // cross to the host in the compute dtype: bf16, 2 bytes per parameter. fp32
  // keeps them exact (the exactness tests; an fp32 compute dtype always does).
  // fp16 sends bf16 too: its scaled gradients' sums could overflow fp16's
  // range where the fp32 accumulators did not, and bf16 has fp32's range.
  bool fp32_grad_transfer = false;
  LossScaling loss_scaling;    // used by the fp16 compute dtype only
  bool loss_scaled() const { return compute.dtype == at::kHalf; }
  // Every gradient is checked before any update (the norm gates them):
  // clipping needs the global norm, and loss scaling must know that no
  // scaled gradient overflowed. Else updates overlap backward.
  bool gated_updates() const { return clip_norm > 0 || loss_scaled(); }
  // Decoder-layer blocks (1..layers) whose backward does not recompute their
  // forward's matmuls: forward keeps their outputs (gpu/blocks/blocks.h's
  // LayerSaved: q, k, v, the attention core's output and log-sum-exp, x1,
  // gate, up) and copies them out to pinned host
  // memory on the d2h stream; they come back on the h2d stream, prefetched,
  // before the layer's backward. Every other layer recomputes its forward
  // from its checkpoint. The two are bit-identical (the same ops in the same
  // order); the plan chooses (engine/plan/plan.h, PlanLimits::activations).
  std::vector<int64_t> saved_blocks;
  // The head's pass 1 keeps every micro-batch's logits on the device
  // ([micro_batch * seq, vocab] each, the compute dtype) for pass 2, which
  // then computes two of the three logits GEMMs instead of three: the same
  // bits, at batch x seq x vocab x 2 bytes of device memory.
  bool keep_logits = false;
  // Rows may pack several documents, each attending only to itself with its
  // positions counting from its start (Engine::step's `positions`, as packed
  // position_ids in transformers): a micro-batch whose positions are not
  // 0..seq-1 in every row masks its attention per row, at batch x seq x seq
  // bytes of the compute dtype in the working-memory model. false: every row
  // is one sequence (a step given packed positions is refused).
  bool packed_documents = false;
  // What the step minimises (engine/config/objective_config.h): cross-entropy
  // (sft), or an objective over the step's per-token log-probabilities
  // (gpu/blocks/objective.h: DPO, SimPO, ORPO, GRPO as TRL defines them).
  ObjectiveConfig objective;
  // Full fine-tuning: a frozen copy of the starting compute copy in RAM
  // (host/param_store.h, BlockState::reference), the reference model a
  // reference pass (Engine::logprobs) streams in its place; every checkpoint
  // holds it (engine/checkpoint/reference_copy.cpp). LoRA's reference is its
  // frozen base without it.
  bool keep_reference = false;
  at::ScalarType grad_dtype() const {
    return compute.dtype == at::kFloat || fp32_grad_transfer ? at::kFloat : at::kBFloat16;
  }
  NvmeBackend nvme_backend = NvmeBackend::kAuto;
  LockPolicy lock = LockPolicy::kPrefer;
  // Data parallel with sharded state (docs/design.md, "Growing past one GPU"):
  // this engine keeps the master, m and v of slice `state_shard` of
  // `state_shards` of every block (engine/placement/pieces.h, rank_slices), sums only
  // that slice of each gradient over the ranks (a reduce-scatter), updates it,
  // and gathers the other slices' updated compute copies from their ranks.
  // Placement, not maths: the same bits as every rank keeping all of it.
  // set_collectives must then give `state_shards` ranks, this one rank
  // `state_shard`. 1: the whole state here (one process, or replicated ranks).
  int state_shards = 1;
  int state_shard = 0;
  // Sharded state on one machine: the compute copy lives in this file's
  // shared mapping (host/pinned_arena.h; tmpfs, /dev/shm/...), mapped by
  // every rank of the machine, so it exists once. Each rank writes its own
  // slices there, and a piece's update ends when every rank has written its
  // slice (a barrier) instead of gathering them. Empty: a private copy each.
  std::string shared_compute_file;
  // Elements per rank slice are whole multiples of this (the q8 groups, at
  // least 64: slices start on 256-byte lines).
  int64_t slice_align() const { return std::max<int64_t>(shard_align(), 64); }

  // The devices of the pool one engine drives (docs/pool.md, "How the pool
  // runs"; set by the Engine from the devices it is given): block b's
  // visits, forward and backward, run on device b % devices (placement.h,
  // block_device). Placement, not maths: the same bits as one device.
  int devices = 1;

  int64_t batch() const { return micro_batch * accumulation; }
};

}  // namespace strider
