// Engine: the sliding-window training step of DESIGN.md ("One training step").
//
// The device holds K cache units, a window over the model's pieces; the host
// holds every block's bf16 (or fp32) compute copy and, in RAM or on NVMe, its
// fp32 master/m/v. A piece (engine/shards.h) is a layer, a vocabulary shard
// of the embedding or the LM head, or the head's final norm: the embedding and
// the LM head are cut so that no unit is larger than a layer. A step of M
// micro-batches runs a program (engine/step_program.h, compiled from the
// placement): its device operations are a sequence of visits
//   forward: embedding shards, layers; head: pass 1 (log-sum-exp) over every
//   LM-head shard, then pass 2 (gradients) over every shard (one visit when
//   there is one shard); backward: layers, embedding shards, in reverse
// each loaded into a unit K-1 visits ahead (run_pass issues them in order).
// Backward visits accumulate fp32 gradients in the unit over all
// micro-batches and copy them out once, in the compute dtype (bf16 by
// default; fp32 on request). Its host operations run on the updater thread
// (run_host_op): per piece as its gradients land, their checks, CPU AdamW
// (reading/writing NVMe-tier state through the NvmeStore), or, with
// global-norm clipping, every update after the norm and in forward order,
// overlapped with the next step's forward. The next H2D of a piece waits for
// exactly that piece's update.
//
// Gradients land in host staging: a ring of `grad_ring` slots, reused once
// its previous gradients are consumed by their piece's update. With exact
// clipping every gradient must outlive the global norm, so there a block
// whose state lives in RAM keeps a buffer of its own, and an NVMe-tier block
// (which keeps only its compute copy in RAM) goes through the ring with its
// gradients spilled to their extent on NVMe, read back with its state for
// the update.
//
// The same code runs on CpuDevice (tests, with chaos) and CudaDevice; results
// are bit-identical to ResidentModel + AdamW whatever K, the tiers, the
// vocabulary shards or where checkpoints live.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/block_runner.h"
#include "engine/engine_config.h"
#include "engine/model_spec.h"
#include "engine/placement.h"
#include "engine/shards.h"
#include "engine/step_program.h"
#include "engine/timeline.h"
#include "gpu/cache_unit_pool.h"
#include "gpu/device.h"
#include "host/cpu_adam.h"
#include "host/state_format.h"
#include "host/param_store.h"
#include "host/pinned_arena.h"
#include "io/nvme_store.h"

namespace strider {

class Collectives;  // engine/collectives.h
struct RankInfo;
class SimUpdater;   // engine/sim_updater.h

struct StepReport {
  int64_t step = 0;            // 1 for the first update
  double loss = 0;             // mean over the batch's valid tokens
  int64_t tokens = 0;          // batch * seq
  int64_t valid_tokens = 0;
  double grad_norm = 0;        // before clipping
  double lr = 0;
  double step_s = 0;
  double tokens_per_s = 0;
  StepStats stats;             // per-lane busy time, overlap efficiency
  size_t peak_device_bytes = 0;
  // What the step's device work moved and needed. The bytes sum the spans of
  // the step's copies (so they need DeviceOptions::record_spans): H2D the
  // parameters of each visit, the batch, host checkpoints coming back, a tied
  // embedding's gradient; D2H gradients, checkpoints going out, the loss
  // figures. The working memory is Device::work_peak_bytes over the step: the
  // most ATen held inside any one compute op (0 where not measured).
  uint64_t h2d_bytes = 0;
  uint64_t d2h_bytes = 0;
  uint64_t work_peak_bytes = 0;
  // The numerics guard: a step whose loss, gradient norm (with clipping) or
  // first-updated block's gradient (without) is not finite changes nothing:
  // no block is updated, steps_done() does not advance (nor AdamW's count or
  // the schedule), and the report says why. The batch is consumed.
  bool skipped = false;
  std::string skip_reason;     // "loss is nan", "gradient norm is inf", ...
  // The batch had no target token (every label -100; over every rank's rows
  // in data parallel): nothing was computed, nothing changed, and the step is
  // skipped without being a fault (a sparse chat data set has such batches).
  bool no_targets = false;
  int64_t nonfinite_block = -1;  // the first block (in forward order) with a non-finite gradient, or -1
  std::string nonfinite_tensor;  // that block's first non-finite gradient tensor
};

class Engine {
 public:
  Engine(ModelSpec spec, EngineConfig config, std::unique_ptr<Device> device);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Parameters. Call before the first step (or between steps; they wait for
  // pending updates). `name` is a checkpoint tensor name.
  void init_params(uint64_t seed);  // N(0, 0.02) weights, ones for norms, zero biases
  void set_param(const std::string& name, std::span<const float> values);
  std::vector<float> param(const std::string& name);
  // A block's fp32 state (master, Adam m or v; total_elems long), from RAM or
  // NVMe, and back. Writing the master also rewrites the compute copy.
  void read_state(int64_t block, ExtentKind kind, std::span<float> out);
  void write_state(int64_t block, ExtentKind kind, std::span<const float> in);
  // Block b's compute copy in the pinned host arena: the bytes every H2D of
  // the block sends (bf16 bits, or fp32 with an fp32 compute dtype), laid out
  // by spec().layout(b) (each tensor contiguous at its slot's offset). The
  // updater rewrites it from the master after each update, so read it between
  // steps after finish_updates(); a write to it lasts only until the block's
  // next update (set_param / write_state change the master). Valid while the
  // Engine lives. This is what a wrapped model's parameters alias.
  std::span<std::byte> compute_copy(int64_t block);
  // Block b's weights as a model file in `file_dtype` should hold them
  // (total_elems floats): for a bf16 file with a bf16 compute copy, the
  // compute copy's values (what the model computes with; the q8 format rounds
  // its master to it ties-up, not ties-to-even), else the master.
  void model_weights(int64_t block, DType file_dtype, std::span<float> out);

  // One optimizer step over `ids` / `labels`, [batch, seq] int64 each (labels
  // aligned with ids, -100 where no loss counts). Returns when the loss and the
  // gradient norm are known; the updates may still be running (the next step
  // waits for each block's update just before it needs the block).
  // A non-finite loss or gradient skips the step (StepReport::skipped) before
  // any update. Without clipping, updates overlap backward: a non-finite
  // gradient found after other blocks were updated throws (the step is partly
  // applied; the engine refuses further work, so nothing of it can be saved).
  StepReport step(const int64_t* ids, const int64_t* labels);
  // Loss over a batch with the same window and no update (mean over valid tokens).
  double evaluate(const int64_t* ids, const int64_t* labels);
  // Waits for every pending update.
  void finish_updates();
  // On a SimDevice the engine runs its unchanged schedule on virtual clocks:
  // no memory is touched, losses are NaN, the optimizer and NVMe lanes are
  // priced from the device's CostModel, and step_s is virtual time.
  bool simulated() const { return sim_updater_ != nullptr; }

  const ModelSpec& spec() const { return spec_; }
  const EngineConfig& config() const { return config_; }
  const Sharding& sharding() const { return place_.shards; }
  // The training pass's program (engine/step_program.h): what step() runs.
  const StepProgram& program() const { return program_; }
  Device& device() { return *device_; }
  Timeline& timeline() { return timeline_; }
  int64_t steps_done() const { return steps_; }
  // For resuming: the optimizer steps already taken (AdamW's bias corrections
  // and the learning-rate schedule continue from here). Between steps only.
  void set_steps_done(int64_t steps);
  // Data parallel: this engine is one of `ranks`' ranks, each stepping on its
  // own micro-batches of one global batch. The ranks agree on the batch's valid
  // tokens before the pass (every rank's loss is scaled by the global count),
  // sum each piece's gradients as they land (so every rank updates the same
  // state to the same bits), and reduce the loss. Before the first step, on
  // every rank (it opens the updater's channel: a collective). Without it the
  // engine is its own world of one.
  void set_collectives(std::unique_ptr<Collectives> ranks);
  const RankInfo& ranks() const;
  size_t arena_bytes() const { return arena_->capacity_bytes(); }
  // Of the pinned memory, what the device registered (the parts it copies).
  size_t registered_host_bytes() const;
  // The first parameter (block order, then layout order) whose fp32 master
  // holds a NaN or an infinity, or "" when all are finite. Reads every
  // block's master (from NVMe too): a diagnosis, not for inside a loop.
  std::string first_non_finite_param();
  // Fault injection, for the numerics guard's tests: block b's gradients in
  // the next training pass land with a NaN in the first element of the
  // block's first piece to land (the head's norm when it has one vocabulary
  // shard), as a bad transfer or kernel would leave them.
  void inject_nonfinite_gradient(int64_t b);

 private:
  using Range = ElemRange;
  struct Loaded {
    const CacheUnit* unit;
    std::unique_ptr<Event> ready;
    std::vector<UnitRun> layout;  // its pieces' ranges in the unit (Sharding::unit_layout)
  };

  // The device executor: a program's device operations, in order, each
  // through one table (run_device_op, engine_visit.cpp).
  struct PassCursor {
    int saved_slot = -1;                   // the latest kept forward's device slot...
    std::unique_ptr<Event> saved_done;     // ...and its forward done, for its kSaveOut
    const std::byte* send = nullptr;       // the visit's gradients in the transfer dtype (kGradsToSend)
  };
  void run_pass(const StepProgram& program);
  void run_device_op(const StepOp& op, PassCursor& at);
  void forward_op(const StepOp& op, PassCursor& at);
  void head_op(const StepOp& op);          // kHeadLse, kHeadGrad, kHeadNormBackward
  void backward_op(const StepOp& op);
  double op_flops(const StepOp& op) const;
  const CacheUnit& unit(const StepOp& op) const;  // its visit's unit
  // Stream `waiter`'s next work waits for what stream `done` has enqueued so far.
  void stream_after(StreamId waiter, StreamId done);
  size_t visit_elems(const StepOp& op) const;     // the parameters its visit loaded
  void allocate_activations();
  void upload_batch(const int64_t* ids, const int64_t* labels);
  std::vector<int64_t> visit_segments(const StepOp& v) const;
  void load_visit(const StepOp& load);          // acquire + H2D of its visit's pieces into loaded_[visit]
  at::Tensor params_view(const CacheUnit& u, size_t offset, size_t elems) const;
  at::Tensor grads_view(const CacheUnit& u) const;
  at::Tensor rows_view(const at::Tensor& flat, size_t offset, const Piece& rows) const;  // [rows, hidden]
  at::Tensor act(int64_t b, int64_t m) const;   // input of block b for micro-batch m
  // Kept activations (EngineConfig::saved_blocks). Block b keeps them, its
  // host copy for micro-batch m, and the H2D of that copy into the next
  // device slot (slots alternate; each use waits for the slot's last reader).
  bool keeps(int64_t b) const { return b > 0 && b < place_.head && place_.saved_index[size_t(b)] >= 0; }
  std::span<std::byte> saved_host(int64_t b, int64_t m) const;
  // Micro-batch m's kept logits of one LM-head shard's rows: [tokens, rows].
  at::Tensor kept_logits(int64_t m, const Piece& rows) const;
  void fetch_saved(int64_t b, int64_t m);
  void wait_updated(int64_t p);                 // piece p's update of the previous pass is done
  // Moves the device's finished spans into the timeline; returns the bytes
  // they copied each way.
  struct Moved { uint64_t h2d_bytes = 0, d2h_bytes = 0; };
  Moved collect_device_spans();

  // The updater (optimizer and NVMe lanes), engine_update.cpp: the host
  // executor of the program.
  struct UpdateJob {
    int64_t step = 0;  // 1-based: the AdamW step count
    int64_t pass = 0;  // 1-based: the training pass whose gradients it consumes
    double lr = 0;
    // Set by the updater before the norm is published (read after it).
    bool skipped = false;
    std::string skip_reason;
    int64_t nonfinite_block = -1;
    std::string nonfinite_tensor;
  };
  // What a pass's host operations compute for the ones after them.
  struct PassFigures {
    std::vector<double> sumsq;              // per piece: its gradients' sum of squares
    std::vector<std::vector<double>> parts; // per piece: that, range by range (the norm adds these)
    std::vector<std::string> bad_tensor;    // per piece: its first non-finite gradient tensor, or ""
    int64_t fault_piece = -1;               // inject_nonfinite_gradient's piece in this pass
    double grad_scale = 1.0;                // the clipping coefficient, once the norm is known
  };
  void updater_main();
  void run_host_op(const StepOp& op, UpdateJob& job, PassFigures& fig);
  // Everything below is per piece (engine/shards.h): gradients land, are
  // staged, checked and updated piece by piece.
  // Host staging of piece p's fp32 gradients: its block's own buffer, or its ring slot.
  std::span<std::byte> grad_host(int64_t p);
  // The D2H of piece p's gradients from `src` (a unit, in the transfer
  // dtype), once its staging is free; records grads_ready_[p] and tells the updater.
  void copy_grads_out(int64_t p, const StepOp& visit, const std::byte* src);
  // The first `elems` gradients of unit u in the transfer dtype: the fp32
  // accumulators themselves, or (bf16) rounded on the compute stream into the
  // unit's parameter area, which the visit no longer reads.
  const std::byte* grads_to_send(const CacheUnit& u, size_t elems, int64_t block);
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
  int64_t num_pieces() const { return place_.num_pieces(); }

  ModelSpec spec_;
  EngineConfig config_;
  const Placement place_;  // what lives where (engine/placement.h), after check_config
  std::unique_ptr<Device> device_;
  StepProgram program_, eval_program_;  // a training pass, an evaluation pass
  void compile_programs(int world);
  std::unique_ptr<SimUpdater> sim_updater_;  // on a SimDevice: the host operations on virtual clocks
  at::Device aten_device_;
  std::unique_ptr<PinnedArena> arena_;
  std::unique_ptr<PinnedArena> shared_arena_;  // the shared compute copy (EngineConfig::shared_compute_file)
  // This rank wrote its slices of a shared compute copy (write_state): the
  // others' must be there before any of it is read (a barrier first).
  bool compute_pending_ = false;
  void settle_compute();
  std::unique_ptr<ParamStore> store_;
  std::unique_ptr<NvmeStore> nvme_;
  std::unique_ptr<CacheUnitPool> pool_;
  std::unique_ptr<BlockRunner> runner_;
  std::unique_ptr<CpuAdam> adam_;
  Timeline timeline_;
  double device_origin_us_ = 0;

  // Pinned host staging.
  std::span<int64_t> ids_host_, labels_host_;
  std::span<float> tied_grad_host_;         // the head's gradient of a tied embedding
  std::vector<std::span<std::byte>> grad_ring_;  // fp32 gradient slots shared by the ring blocks
  std::vector<int64_t> ring_uses_;          // per slot: D2Hs issued into it (main thread)
  struct NvmeStaging {
    std::span<std::byte> master, m, v;
    std::span<std::byte> grad;       // spilled gradients read back (clipping only)
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

  // Device memory beyond the pool, allocated once.
  std::vector<DeviceBuffer> device_buffers_;
  at::Tensor ids_dev_, labels_dev_;         // [batch, seq]
  // One micro-batch's buffers, allocated once (device tensors, and host
  // spans in the pinned arena).
  struct MicroBatch {
    at::Tensor ids, labels;                 // its rows of the batch ([micro_batch, seq]; labels flat)
    std::vector<at::Tensor> act;            // per set: its block inputs on the device (set b - 1 is
                                            // block b's), or the 2-set ring with host checkpoints
    at::Tensor grad_out;                    // the gradient flowing backward
    // The streamed head: pass 1's running max, sum, target logit and then
    // log-sum-exp (fp32 [tokens] each), and d(loss)/d(normed hidden) summed
    // over the shards of pass 2 (fp32 [tokens, hidden]).
    HeadState head;
    at::Tensor head_lse, grad_h;
    at::Tensor logits;                      // kept logits (EngineConfig::keep_logits), else undefined
    at::Tensor loss_sum, valid_tokens;      // its entries of head_stats_dev_
    std::vector<std::span<std::byte>> host_ckpt;   // per block: its input copied out (host checkpoints)
    std::vector<std::span<std::byte>> saved_host;  // per kept layer: its kept activations on the host
  };
  std::vector<MicroBatch> mb_;
  std::vector<std::unique_ptr<Event>> ring_free_;  // per ring set: its last reader is done
  // Kept activations (their host copies are MicroBatch::saved_host): two
  // device slots (flat, compute dtype) that forward fills and copies out of
  // and backward copies into; per slot, its last reader (a D2H out, a
  // backward) is done; per kept block, its copies out are on the host. H2Ds
  // issued ahead wait in saved_in_, in order.
  std::vector<at::Tensor> saved_dev_;
  std::vector<std::unique_ptr<Event>> saved_free_, saved_out_;
  int64_t saved_uses_ = 0;                  // device slot uses so far: the next is uses % 2
  struct SavedIn {
    int64_t block = -1, m = -1;
    int slot = 0;
    std::unique_ptr<Event> ready;
  };
  std::deque<SavedIn> saved_in_;
  std::unique_ptr<Event> data_ready_, tied_grad_ready_;

  // Per-step state shared with closures (they run in stream order).
  int64_t batch_valid_ = 0;                 // labels of the batch that count
  // Per micro-batch loss sum and valid tokens ([2, M] float64), summed on the
  // device and copied out once per pass: no host read inside the head's ops.
  at::Tensor head_stats_dev_;
  std::span<double> head_stats_host_;
  std::unique_ptr<Event> head_stats_ready_;
  std::vector<Loaded> loaded_;
  std::vector<std::unique_ptr<Event>> grads_ready_;  // per piece: its D2H is done
  int64_t steps_ = 0;      // optimizer steps taken (skipped steps do not count)
  int64_t passes_ = 0;     // training passes run: the updater's and the waits' sequence number
  int64_t fault_block_ = -1, fault_pass_ = 0;  // inject_nonfinite_gradient

  // Data parallel (set_collectives): the main thread's channel and the updater's.
  std::unique_ptr<Collectives> dist_, dist_update_;
  std::vector<float> dist_scratch_;  // bf16 gradients summed in fp32 (the largest piece)
  // Piece p's gradients summed over the ranks: whole, or (slice) this rank's slice of them (updater thread).
  void sum_grads_over_ranks(int64_t p, bool slice);
  // Sharded state (EngineConfig::state_shards > 1): each piece's slices are
  // in its PiecePlace (engine/placement.h).
  bool sharded() const { return config_.state_shards > 1; }
  std::vector<size_t> slice_bytes_;  // a piece's slices scaled to bytes (updater thread)
  // Piece p's elements (the piece's coordinates) whose state this engine keeps.
  Range owned(int64_t p) const { return place_.at(p).owned; }
  // Block b's whole state of one kind into `out`, which holds this rank's
  // slice: the others' slices from their ranks (a collective).
  void gather_state(int64_t b, std::span<float> out);
  // The other ranks' updated compute copies of piece p's slices, or (shared)
  // a barrier: every rank has written its slice of the shared copy (updater thread).
  void gather_compute(int64_t p, bool shared);
  // The pass's loss summed over its valid tokens, and their count, over every
  // rank (waits for the loss figures' D2H).
  std::pair<double, int64_t> pass_loss();

  // Updater thread.
  std::thread updater_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<UpdateJob>> jobs_;
  std::vector<int64_t> updated_;            // per piece: the last pass whose gradients were consumed
  std::vector<int64_t> grads_recorded_;     // per piece: the pass whose gradient D2H is enqueued
  std::vector<int64_t> ring_released_;      // per ring slot: gradients consumed from it
  std::vector<NvmeTicket> grad_spill_;      // per piece: the write of its spilled gradients
  std::exception_ptr updater_error_;
  bool stopping_ = false;
  double last_norm_ = -1;                   // set by the updater per pass
  int64_t norm_pass_ = 0;

};

}  // namespace strider
