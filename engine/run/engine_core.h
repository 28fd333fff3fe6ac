// EngineCore: the Engine's (engine/run/engine.h) state and executors, for the
// engine's own files only (engine_core.cpp: construction and the step;
// device_pass.cpp, device_ops.cpp, device_buffers.cpp: the device executor;
// updater.cpp, host_update.cpp, host_grads.cpp: the host executor;
// block_state.cpp: the state between steps). The Engine's API
// (engine.h, declared there once) is implemented on it in engine.cpp,
// engine_core.cpp and block_state.cpp.
//
// The configuration is only declared here: the executors, which include this
// header and not engine/config/engine_config.h (the build refuses it), read
// the program and the placement, where the passes recorded every decision;
// what they take from the configuration beyond those (how to compute,
// AdamW's hyper-parameters) are members of their own.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/config/compute_options.h"
#include "engine/config/loss_scaling.h"
#include "engine/model/batch_mask.h"
#include "engine/model/model_spec.h"
#include "engine/placement/placement.h"
#include "engine/program/step_program.h"
#include "engine/program/timeline.h"
#include "engine/run/block_runner.h"
#include "engine/run/host_executor.h"
#include "engine/run/step_report.h"
#include "gpu/blocks/objective.h"
#include "gpu/device/cache_unit_pool.h"
#include "host/cpu_adam.h"
#include "host/param_store.h"
#include "host/pinned_arena.h"
#include "host/state_format.h"

namespace strider {

struct EngineConfig;  // engine/config/engine_config.h
class Collectives;    // engine/run/collectives.h
struct RankInfo;

// Engine::step's objective inputs against the objective (`name`: its
// setting's text) and the batch's labels ([batch, seq]): BatchRefused naming
// what is missing, extra or not finite (objective_step.cpp).
void check_objective_inputs(const ObjectiveSettings& o, const ObjectiveInputs* in, const int64_t* labels,
                            int64_t batch, int64_t seq, std::string_view name);

class EngineCore {
  // The Engine (engine/run/engine.h) is the API: its functions work on this
  // state directly (engine_core.cpp, block_state.cpp), with no second
  // declaration of them here.
  friend class Engine;

 public:
  EngineCore(ModelSpec spec, EngineConfig config, std::vector<std::unique_ptr<Device>> devices);
  ~EngineCore();
  EngineCore(const EngineCore&) = delete;
  EngineCore& operator=(const EngineCore&) = delete;

 private:
  using Range = ElemRange;
  struct Loaded {
    const CacheUnit* unit;
    std::unique_ptr<Event> ready;
    const std::vector<UnitRun>* layout;  // its pieces' ranges in the unit (StepProgram::layouts)
    size_t grad_base = 0;                // where its gradient area starts in the unit (Sharding::grad_base)
  };

  // One micro-batch's device buffers on one device, allocated once (the
  // Seat's; a pool's device has those of the blocks it runs).
  struct MicroBatch {
    at::Tensor ids, labels;                 // its rows of the batch ([micro_batch, seq]; labels flat)
    // Its rows' documents this batch (EngineConfig::packed_documents): ids a
    // view of the Seat's positions, or undefined when every row is 0..seq-1.
    BatchPositions positions;
    at::Tensor position_rows;               // that view, allocated once
    std::vector<at::Tensor> act;            // per set: block inputs (set b - 1 is block b's; undefined
                                            // where another device of the pool holds it), or the
                                            // 2-set ring with host checkpoints
    at::Tensor grad_out;                    // the gradient flowing backward
    // Layers cut into sub-layer pieces (EngineConfig::mlp_pieces): what one
    // keeps between its pieces' visits (BlockRunner's CutBuffers), shared
    // by the layers, which the device runs one at a time (the MLP's input
    // is made again by a recompute visit before the slices' backward); with
    // experts, the routing and d(loss)/d(score) of its tokens too.
    at::Tensor cut_x1, cut_h2, cut_sum, cut_top, cut_scores, cut_dscores;
    // A device that runs the head's shards: the streamed head's pass 1
    // running max, sum and target logit (`head`: rows of `head_state`, fp32
    // [3, tokens]) and then log-sum-exp (fp32 [tokens]), and d(loss)/d(normed
    // hidden) summed over the shards of pass 2 (fp32 [tokens, hidden]).
    HeadState head;
    at::Tensor head_state, head_lse, grad_h;
    at::Tensor logits;                      // kept logits of the device's shards (EngineConfig::keep_logits), else undefined
    at::Tensor loss_sum, valid_tokens;      // its entries of the head's Seat::head_stats
    at::Tensor valid;                       // its rows of Seat::token_valid, flat
    // An objective past SFT: its per-token coefficients for pass 2 (fp32
    // [tokens]), row 1 of lse_coef, whose row 0 is head_lse; else undefined.
    at::Tensor coef, lse_coef;
  };
  struct SavedIn {
    int64_t block = -1, m = -1;
    int slot = 0;
    std::unique_ptr<Event> ready;
  };
  // One device of the pool (docs/pool.md, "How the pool runs") and what
  // lives on it: its cache units, its block runner, the buffers of the
  // blocks it runs, its kept-activation slots, and the events its own
  // streams record. Every visit of a block runs on the block's device
  // (Placement::block_device, head_device).
  struct Seat {
    std::unique_ptr<Device> device;
    at::Device aten = at::kCPU;
    std::unique_ptr<CacheUnitPool> pool;
    std::unique_ptr<BlockRunner> runner;
    std::vector<DeviceBuffer> buffers;       // beyond the pool, allocated once
    at::Tensor ids, labels;                  // the batch: [batch, seq] (every device)
    at::Tensor positions;                    // its positions, with packed documents (else undefined)
    at::Tensor head_stats;                   // a head device: per micro-batch loss sum and valid tokens ([2, M] f64)
    // With the load-balancing loss: each micro-batch's routing statistics
    // over its sparse layers (gpu/blocks/moe.h, MoeStep; fp32 [M, 2, experts]).
    at::Tensor moe_stats;
    at::Tensor token_valid;  // and the batch's attention mask, fp32 [batch * seq] (a batch with padding)
    // The device of the head's last shard, with an objective past SFT: the
    // step's per-row inputs (fp32, objective_in_elems) and its figures
    // (float64 [kObjectiveStats]).
    at::Tensor objective_in, objective_stats;
    std::vector<MicroBatch> mb;
    std::vector<std::unique_ptr<Event>> ring_free;  // per ring set: its last reader is done
    // Kept activations: two device slots (flat, compute dtype) that forward
    // fills and copies out of and backward copies into; per slot, its last
    // reader (a D2H out, a backward) is done. H2Ds issued ahead wait in
    // saved_in, in order.
    std::vector<at::Tensor> saved_dev;
    std::vector<std::unique_ptr<Event>> saved_free;
    int64_t saved_uses = 0;                  // device slot uses so far: the next is uses % 2
    std::deque<SavedIn> saved_in;
    std::unique_ptr<Event> data_ready;       // the batch is on this device
    std::vector<std::unique_ptr<Event>> handed[kHandKinds];  // per Hand, per micro-batch: its latest kHandOut is on the host
    double origin_us = 0;                    // its span clock's origin on Timeline::now_us()'s
    // stream_after's events, per stream it marks, made once: a wait takes
    // the latest record when it is issued, so one event serves every use.
    std::unique_ptr<Event> mark[kNumStreams];
  };
  Seat& seat(const StepOp& op) { return seats_[size_t(op.device)]; }

  // The device executor: a program's device operations, in order, each
  // through one table (run_device_op, device_ops.cpp).
  struct PassCursor {
    const StepProgram* program = nullptr;  // the pass's
    int saved_slot = -1;                   // the latest kept forward's device slot...
    std::unique_ptr<Event> saved_done;     // ...and its forward done, for its kSaveOut
    const std::byte* send = nullptr;       // the visit's gradients in the transfer dtype (kGradsToSend)
  };
  void run_pass(const StepProgram& program, int64_t fault_op = -1);  // fault_op: inject_device_fault's
  void run_device_op(const StepOp& op, PassCursor& at);
  // Its longer handlers: the host checkpoints' copies and a pool's hand-offs.
  void op_checkpoint_out(const StepOp& op, Seat& st);
  void op_checkpoint_in(const StepOp& op, Seat& st);
  void op_hand_out(const StepOp& op, Seat& st);
  void op_hand_in(const StepOp& op, Seat& st);
  void first_copy_in(Seat& st, int64_t b, bool ring);
  void forward_op(const StepOp& op, PassCursor& at);
  void head_op(const StepOp& op);          // kHeadLse, kHeadGrad, kHeadNormBackward
  void objective_op(const StepOp& op);     // kObjective
  // The step's objective inputs (checked by step(), before any work) to its device.
  void upload_objective(const ObjectiveInputs& in);
  void backward_op(const StepOp& op);
  double op_flops(const StepOp& op) const;
  const CacheUnit& unit(const StepOp& op) const;  // its visit's unit
  // Stream `waiter`'s next work waits for what stream `done` has enqueued so far (on s's device).
  void stream_after(Seat& s, StreamId waiter, StreamId done);
  size_t visit_elems(const StepOp& op) const;     // the parameters its visit loaded
  // Where its visit's gradient area starts in the unit: unit element x has its accumulator at x - grad_base.
  size_t grad_base(const StepOp& op) const { return loaded_[size_t(op.visit)].grad_base; }
  void allocate_activations(int d);
  void upload_batch(const int64_t* ids, const int64_t* labels, const int64_t* positions, const int64_t* attention);
  // evaluate's and logprobs' pass over a batch: the head's pass-1 state complete on its devices.
  void eval_pass(const int64_t* ids, const int64_t* labels, const int64_t* positions, const int64_t* attention);
  // The eval pass runs the reference model (Engine::logprobs): the layers
  // without their LoRA adapters, or the kept starting weights
  // (BlockState::reference) loaded in the compute copy's place.
  bool reference_pass_ = false;
  // keep_reference: whether the reference copy holds the starting weights
  // yet (taken before the first step changes them, or loaded).
  bool reference_taken_ = false;
  void ensure_reference();
  // The load-balancing loss's share of a batch with padding: per micro-batch
  // its router rows (input tokens x sparse layers) and whether it has padding
  // (its MoeStep::valid); the micro-batches with an input token on every rank.
  void count_router_rows(const int64_t* attention);
  RouterRows router_rows_;  // with_inputs summed over the ranks
  std::vector<int64_t> visit_segments(const StepOp& v) const;
  // Acquire + H2D of its visit's pieces into loaded_[visit], laid out as `layout` says.
  void load_visit(const StepOp& load, const std::vector<UnitRun>& layout);
  // kReadCompute: the visit's compute copies on NVMe into load staging slot
  // op.slot, by the host executor (HostExecutor::read_compute).
  void read_compute(const StepOp& read);
  at::Tensor params_view(const Seat& s, const CacheUnit& u, size_t offset, size_t elems) const;
  at::Tensor grads_view(const Seat& s, const CacheUnit& u) const;
  at::Tensor rows_view(const at::Tensor& flat, size_t offset, const Piece& rows) const;  // [rows, hidden]
  at::Tensor act(const Seat& s, int64_t b, int64_t m) const;   // input of block b for micro-batch m, on s
  // Kept activations (EngineConfig::saved_blocks). Block b keeps them, its
  // host copy for micro-batch m, and the H2D of that copy into its device's
  // next slot (slots alternate; each use waits for the slot's last reader).
  bool keeps(int64_t b) const { return b > 0 && b < place_.head && place_.saved_index[size_t(b)] >= 0; }
  std::span<std::byte> saved_host(int64_t b, int64_t m) const;
  // Micro-batch m's kept logits of one LM-head shard's rows: [tokens, rows].
  at::Tensor kept_logits(const Seat& s, int64_t m, int64_t shard) const;
  void fetch_saved(Seat& s, int64_t b, int64_t m);
  // A pool's hand-offs (kHandOut, kHandIn): the tensor they move on device s.
  at::Tensor handed(const Seat& s, const StepOp& op) const;
  // Moves the device's finished spans into the timeline; returns the bytes
  // they copied each way.
  struct Moved { uint64_t h2d_bytes = 0, d2h_bytes = 0; };
  Moved collect_device_spans();
  void synchronize_devices(StreamId s);  // each device's stream s

  // The host executor (engine/run/host_executor.h): an Updater (updater.h),
  // whose table's handlers are below (host_update.cpp, host_grads.cpp), or a
  // SimUpdater beside a SimDevice.
  class Updater;
  std::unique_ptr<HostExecutor> host_;
  Updater* updater_ = nullptr;  // host_ when it is the Updater (its handlers' way to it)
  // What a pass's host operations compute for the ones after them.
  struct PassFigures {
    std::vector<double> sumsq;              // per piece: its gradients' sum of squares
    std::vector<std::vector<double>> parts; // per piece: that, range by range (the norm adds these)
    std::vector<std::string> bad_tensor;    // per piece: its first non-finite gradient tensor, or ""
    int64_t fault_piece = -1;               // inject_nonfinite_gradient's piece in this pass
    double grad_scale = 1.0;                // 1 / loss scale times the clipping coefficient, once the norm is known
  };
  // The handlers of the Updater's table (run_host_op, updater.cpp) longer than a line.
  void op_check_loss(UpdateJob& job);
  void op_check_grad(const StepOp& op, UpdateJob& job, const PassFigures& fig);
  void op_sum_squares(const StepOp& op, PassFigures& fig);
  void op_spill(const StepOp& op, const UpdateJob& job);
  void op_norm(const StepOp& op, UpdateJob& job, PassFigures& fig);
  // Everything below is per piece (engine/placement/pieces.h): gradients land, are
  // staged, checked and updated piece by piece.
  // Host staging of piece p's fp32 gradients: its block's own buffer, or its ring slot.
  std::span<std::byte> grad_host(int64_t p);
  // The D2H of piece p's gradients from `src` (a unit, in the transfer
  // dtype), once its staging is free; records grads_ready_[p] and tells the updater.
  void copy_grads_out(int64_t p, const StepOp& visit, const std::byte* src);
  // The first `elems` gradients of unit u in the transfer dtype: the fp32
  // accumulators themselves, or (bf16) rounded on the compute stream into the
  // unit's parameter area, which the visit no longer reads.
  const std::byte* grads_to_send(Seat& s, const CacheUnit& u, size_t elems, int64_t block);
  void release_ring_slot(int64_t p);  // the slot's gradients are consumed
  // AdamW on piece p (this rank's elements of it), its state in RAM or read
  // into a staging slot by kReadState.
  void update_piece(const UpdateJob& job, int64_t p, double grad_scale);
  // Issues the write-back of piece p's updated NVMe-tier state.
  void write_state_back(int64_t p, int64_t step);
  // A skipped step: piece p's gradients are consumed without an update (its staging is freed).
  void skip_piece(int64_t p);
  // The name of the first tensor of piece p whose values (fp32, in the
  // piece's coordinates) are not finite.
  std::string first_non_finite(int64_t p, const float* values) const;
  // Among piece p's gradients `in` (the piece's coordinates): the
  // first non-finite's tensor, "(padding)", or "" when all are finite.
  std::string first_non_finite_grad(int64_t p, const std::byte* grads, Range in) const;
  void start_state_read(int64_t p, int slot);
  bool on_nvme(int64_t p) const { return place_.at(p).on_nvme; }
  bool spills_grads(int64_t p) const { return place_.at(p).spills_grads; }
  const Piece& piece(int64_t p) const { return place_.piece(p); }
  Device& device(int d = 0) { return *seats_.at(size_t(d)).device; }
  const Device& device(int d = 0) const { return *seats_.at(size_t(d)).device; }
  // The devices price their work and run none (SimDevices): the engine maps
  // no memory and holds no state, and its host executor is a SimUpdater.
  bool priced() const { return device().kind() == DeviceKind::kSim; }
  // The training program updates piece p (a frozen one it never does): its loads wait for that.
  bool updates(int64_t p) const { return program_.updated[size_t(p)] >= 0; }
  int64_t num_pieces() const { return place_.num_pieces(); }

  ModelSpec spec_;
  std::unique_ptr<const EngineConfig> config_;  // construction's and the step's; no executor's
  const ComputeOptions compute_;  // how the devices compute (EngineConfig::compute)
  const AdamHyper adam_hyper_;    // AdamW's hyper-parameters (EngineConfig::adam), before the schedule
  const ObjectiveSettings objective_;  // what the step minimises (EngineConfig::objective, resolved)
  const Placement place_;  // what lives where (engine/placement/placement.h), after check_config
  std::vector<Seat> seats_;  // the pool; one for a single device
  StepProgram program_, eval_program_;  // a training pass, an evaluation pass
  void compile_programs(int world);
  bool takes_positions_ = false;  // takes_positions(program_), once per compile: the batch intake asks every step
  std::unique_ptr<PinnedArena> arena_;
  std::unique_ptr<PinnedArena> shared_arena_;  // the shared compute copy (EngineConfig::shared_compute_file)
  // This rank wrote its slices of a shared compute copy (write_state): the
  // others' must be there before any of it is read (a barrier first).
  bool compute_pending_ = false;
  void settle_compute();
  std::unique_ptr<ParamStore> store_;
  std::unique_ptr<NvmeStore> nvme_;
  std::unique_ptr<CpuAdam> adam_;
  Timeline timeline_;

  // Pinned host staging.
  std::span<int64_t> ids_host_, labels_host_, positions_host_;  // positions: with packed documents
  std::span<float> valid_host_;  // the attention mask, with the load-balancing loss
  std::span<float> objective_host_;          // an objective's per-row inputs (objective_in_elems)
  std::span<double> objective_stats_host_;   // and its figures, copied out with the loss figures
  std::span<float> tied_grad_host_;         // the head's gradient of a tied embedding
  std::vector<std::span<std::byte>> grad_ring_;  // fp32 gradient slots shared by the ring blocks
  std::vector<int64_t> ring_uses_;          // per slot: D2Hs issued into it (main thread)
  struct NvmeStaging {
    std::span<std::byte> master, m, v;
    std::span<std::byte> grad;       // spilled gradients read back (clipping only)
    std::span<std::byte> compute;    // a compute copy on NVMe: read with q8's state (its master's high half), written back
    std::vector<NvmeTicket> writes;  // the last write-back from this slot
    std::vector<NvmeTicket> reads;   // the state being read into it
    int64_t reading = -1;            // whose state `reads` bring
    int64_t holding = -1;            // whose state it holds (updated, not yet written back)
    int64_t written = -1;            // whose state `writes` carry
    double read_begin_us = 0;
  };
  std::vector<NvmeStaging> nvme_staging_;   // 2 slots: one being updated, one read ahead
  int next_read_slot_ = 0;                  // the slot the next kReadState reads into
  NvmeStaging& idle_staging();
  void open_nvme_tier();                    // construction: the NVMe store, its staging, fresh extents
  std::vector<ComputeSlot> compute_slots_;  // load staging of compute copies on NVMe (issuing thread)
  bool compute_on_nvme(int64_t p) const { return place_.at(p).compute_on_nvme; }

  // Pinned host buffers per micro-batch: its host checkpoints (per block,
  // its input copied out), kept activations (per kept layer), and a pool's
  // hand-off buffers (per Hand: what passes between devices).
  std::vector<std::vector<std::span<std::byte>>> host_ckpt_, saved_host_;
  std::vector<std::span<std::byte>> hand_host_[kHandKinds];
  std::vector<std::unique_ptr<Event>> saved_out_;  // per kept block: its copies out are on the host
  std::vector<std::unique_ptr<Event>> tied_grad_ready_;  // per vocabulary shard (tied): the head's share is on the host

  // Per-step state shared with closures (they run in stream order).
  int64_t batch_valid_ = 0;                 // labels of the batch that count
  LossScaleState scaler_;                   // fp16's loss scale (EngineConfig::loss_scaling), between steps
  double pass_scale_ = 1.0;                 // what this pass's loss gradient is multiplied by (the issuing thread's)
  // This step's objective batch beyond its tensors (upload_objective): rows, the inputs given, the rank's share.
  ObjectiveBatch objective_batch_;
  // Per micro-batch loss sum and valid tokens ([2, M] float64), summed on the
  // device and copied out once per pass: no host read inside the head's ops.
  std::span<double> head_stats_host_;
  std::unique_ptr<Event> head_stats_ready_;
  std::vector<Loaded> loaded_;
  std::vector<std::unique_ptr<Event>> grads_ready_;  // per piece: its D2H is done
  std::vector<NvmeTicket> grad_spill_;      // per piece: the write of its spilled gradients (updater thread)
  int64_t steps_ = 0;      // optimizer steps taken (skipped steps do not count)
  int64_t passes_ = 0;     // training passes run
  int64_t fault_block_ = -1;  // inject_nonfinite_gradient: the next training pass's
  std::optional<std::pair<StepOpKind, int64_t>> device_fault_;  // inject_device_fault: the next training pass's
  std::shared_ptr<UpdateJob> open_job_;  // the training pass begun and not ended (a failure leaves it here)
  std::string failed_;  // settle_after_failure: why the engine takes no more work
  int64_t take_device_fault();  // the training program's op index inject_device_fault named (-1: none), once
  void check_usable(const char* what) const {
    STRIDER_CHECK(failed_.empty(), "{}: the engine failed earlier ({}) and takes no more work", what, failed_);
  }

  // Data parallel (set_collectives): the main thread's channel and the updater's.
  std::unique_ptr<Collectives> dist_, dist_update_;
  std::vector<float> dist_scratch_;  // bf16 gradients summed in fp32 (the largest piece)
  // Piece p's gradients summed over the ranks: whole, or (slice) this rank's slice of them (updater thread).
  void sum_grads_over_ranks(int64_t p, bool slice);
  // Sharded state (EngineConfig::state_shards > 1): each piece's slices are
  // in its PiecePlace (engine/placement/placement.h).
  bool sharded() const { return place_.block_slices[0].size() > 2; }
  std::vector<size_t> slice_bytes_;  // a piece's slices scaled to bytes (updater thread)
  // Piece p's elements (the piece's coordinates) whose state this engine keeps.
  Range owned(int64_t p) const { return place_.at(p).owned; }
  // Block b's whole state of one kind into `out`, which holds this rank's
  // slice: the others' slices from their ranks (a collective).
  void gather_state(int64_t b, std::span<float> out);
  // The other ranks' updated compute copies of piece p's slices, or (shared)
  // a barrier: every rank has written its slice of the shared copy (updater thread).
  void gather_compute(int64_t p, bool shared);
  // The pass's loss over every rank (the mean over its valid tokens, plus the
  // load-balancing loss where it is on), and the valid tokens' count (waits
  // for the loss figures' D2H).
  // `objective`: a training pass of an objective past SFT, whose figure is its loss.
  std::pair<double, int64_t> pass_loss(bool objective);
  // That objective's figures under TRL's names, over every rank (after pass_loss).
  std::vector<std::pair<std::string, double>> objective_metrics();
  std::vector<std::pair<std::string, double>> objective_figures(const std::vector<double>& stats) const;  // summed
  // A mixture of experts' load-balancing term of the last pass: router_aux_loss_coef times its mean over every
  // rank's micro-batches (a collective; 0 without one).
  double router_aux_term();
  double local_aux() const;  // this rank's sum of it over its micro-batches
  // Layer block b's share of the load-balancing loss for micro-batch m on s:
  // its statistics to add to (forward) or its gradient (backward); empty
  // where b has no experts or the loss is off.
  MoeStep moe_step(const Seat& s, int64_t b, int64_t m, bool backward) const;

};

}  // namespace strider
