// Engine: the sliding-window training step of docs/design.md ("One training step").
//
// The device holds K cache units, a window over the model's pieces; the host
// holds every block's bf16 (or fp32) compute copy and, in RAM or on NVMe, its
// fp32 master/m/v. A piece (engine/placement/pieces.h) is a layer, a vocabulary shard
// of the embedding or the LM head, or the head's final norm: the embedding and
// the LM head are cut so that no unit is larger than a layer. A step of M
// micro-batches runs a program (engine/program/step_program.h, compiled from the
// placement): its device operations are a sequence of visits
//   forward: embedding shards, layers; head: pass 1 (log-sum-exp) over every
//   LM-head shard, then pass 2 (gradients) over every shard (one visit when
//   there is one shard); backward: layers, embedding shards, in reverse
// each loaded into a unit K-2 visits ahead (run_pass issues them in order).
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

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/config/engine_config.h"
#include "engine/model/model_spec.h"
#include "engine/placement/pieces.h"
#include "engine/program/step_program.h"
#include "engine/program/timeline.h"
#include "engine/run/step_report.h"
#include "gpu/blocks/objective.h"  // ObjectiveInputs
#include "gpu/device/device.h"
#include "host/dtype.h"
#include "host/error.h"
#include "io/nvme_store.h"      // ExtentKind

namespace strider {


class Collectives;  // engine/run/collectives.h
struct RankInfo;
class EngineCore;   // engine/run/engine_core.h

class Engine {
 public:
  Engine(ModelSpec spec, EngineConfig config, std::unique_ptr<Device> device);
  // A pool of devices (gpu/device/device.h, make_devices), all of one kind: block
  // b's visits run on devices[b % N] (docs/pool.md, "How the pool runs");
  // config.devices is set to N. One host optimizer and one copy of the state
  // serve them all; the result is one device's bits.
  Engine(ModelSpec spec, EngineConfig config, std::vector<std::unique_ptr<Device>> devices);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Parameters. Call before the first step (or between steps; they wait for
  // pending updates). `name` is a checkpoint tensor name.
  void init_params(uint64_t seed);  // initial_values (engine/model/model_spec.h) of every tensor, zero moments
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
  // Engine lives. This is what a wrapped model's parameters alias. A block
  // whose frozen base is held quantized (EngineConfig::base_format) has a
  // compute copy of its elements from compute_begin(block) on only: the span
  // starts there.
  std::span<std::byte> compute_copy(int64_t block);
  size_t compute_begin(int64_t block) const;
  // EngineConfig::keep_reference: block b's frozen copy of the starting
  // weights, laid out as its compute copy (the reference model a reference
  // pass streams; a checkpoint saves and loads it). Taken from the compute
  // copy at the first step, reference pass or save that needs it; a load
  // writes it. Refused when the engine keeps none.
  bool keeps_reference() const;
  std::span<std::byte> reference_copy(int64_t block);
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
  // `positions` ([batch, seq] int64, or null: 0..seq-1 in every row): rows
  // that pack documents, each document's positions counting from 0 where it
  // starts (transformers' packed position_ids); a token attends only within
  // its document. Needs EngineConfig::packed_documents unless every row is
  // 0..seq-1. A micro-batch whose rows are all 0..seq-1 computes as without.
  // `attention_mask` ([batch, seq] int64 of 0 and 1, or null: no padding):
  // transformers' attention mask, right padding only (a row's 0s follow its
  // 1s), labels -100 on padding. Attention is causal, so the padding changes
  // no real token; it leaves the padded tokens out of the load-balancing loss
  // (docs/moe.md, "How the engine runs them"), as transformers does.
  // `objective`: the per-row inputs of an objective past SFT
  // (EngineConfig::objective; gpu/blocks/objective.h's ObjectiveInputs), required by dpo and
  // grpo, refused by sft.
  StepReport step(const int64_t* ids, const int64_t* labels, const int64_t* positions = nullptr,
                  const int64_t* attention_mask = nullptr, const ObjectiveInputs* objective = nullptr);
  // Loss over a batch with the same window and no update (mean over valid tokens).
  double evaluate(const int64_t* ids, const int64_t* labels, const int64_t* positions = nullptr,
                  const int64_t* attention_mask = nullptr);
  // Each token's log-probability of its label under the current weights, by
  // evaluate's pass (no gradient, no update): log p(labels[t] | the row's
  // ids up to t), fp32, batch x seq values in row order, 0 where the label is
  // -100. Their sum over a row's labels is minus its summed loss. Arguments
  // as step()'s (data parallel: every rank calls it, each with its rows, as
  // evaluate); a batch with no label gives zeros. `reference`: under the
  // reference model, which for LoRA is the frozen base (the layers run
  // without their adapters, as PEFT's disable_adapter()), refused with
  // modules trained in full (their starting values are gone); in full
  // training the starting weights' frozen copy (keep_reference) streams in
  // the compute copy's place, refused where none is kept.
  std::vector<float> logprobs(const int64_t* ids, const int64_t* labels, const int64_t* positions = nullptr,
                              const int64_t* attention_mask = nullptr, bool reference = false);
  // A simulated engine (a SimDevice): the seconds one pass without a
  // gradient over a batch takes on its machine (logprobs' and evaluate's
  // pass; `reference`: the reference model's, whose loads wait for no
  // update), from its devices' virtual clocks. Call it before the first step
  // for the pass alone: after steps it waits for their last updates.
  double priced_forward_pass(bool reference);
  // An objective past SFT's loss over a batch with no update (evaluate's
  // pass, then the objective's map): the loss as step() would report it, and
  // its figures under TRL's names. Inputs as step()'s; data parallel: every
  // rank calls it with its rows, and the figures are the global batch's.
  ObjectiveEval evaluate_objective(const int64_t* ids, const int64_t* labels, const int64_t* positions = nullptr,
                                   const int64_t* attention_mask = nullptr, const ObjectiveInputs* objective = nullptr);
  // Waits for every pending update.
  void finish_updates();
  // On a SimDevice the engine runs its unchanged schedule on virtual clocks:
  // no memory is touched, losses are NaN, the optimizer and NVMe lanes are
  // priced from the device's CostModel, and step_s is virtual time.
  bool simulated() const;

  const ModelSpec& spec() const;
  const EngineConfig& config() const;
  const Sharding& sharding() const;
  // The training pass's program (engine/program/step_program.h): what step() runs.
  const StepProgram& program() const;
  Device& device(int d = 0);  // the pool's device d (0: the only one, or the first)
  int devices() const;
  Timeline& timeline();
  int64_t steps_done() const;
  // For resuming: the optimizer steps already taken (AdamW's bias corrections
  // and the learning-rate schedule continue from here). Between steps only.
  void set_steps_done(int64_t steps);
  // The fp16 compute dtype's loss scale (EngineConfig::loss_scaling) and its
  // run of good steps, as a checkpoint keeps them; set it between steps, to
  // resume. Other dtypes have none (set_loss_scale throws).
  LossScaleState loss_scale() const;
  void set_loss_scale(LossScaleState s);
  // Data parallel: this engine is one of `ranks`' ranks, each stepping on its
  // own micro-batches of one global batch. The ranks agree on the batch's valid
  // tokens before the pass (every rank's loss is scaled by the global count),
  // sum each piece's gradients as they land (so every rank updates the same
  // state to the same bits), and reduce the loss. Before the first step, on
  // every rank (it opens the updater's channel: a collective). Without it the
  // engine is its own world of one.
  void set_collectives(std::unique_ptr<Collectives> ranks);
  const RankInfo& ranks() const;
  size_t arena_bytes() const;  // the pinned arena
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

  // After a call that threw mid-work (a device, an NVMe read, an update
  // failed): brings the engine to rest (the failed pass's host work given up,
  // every earlier update done, the devices idle) and refuses further steps,
  // evaluations and log-probabilities. Returns "" when the state is whole, that
  // of steps_done() (no update of the failed pass was applied): reading it
  // (read_state, a checkpoint's save) still works. Else why it is not: the
  // failed pass had updated some pieces (without clipping updates overlap the
  // backward), an earlier update failed, or a data-parallel rank's part is unknown.
  // `error`: what the caller caught, not repeated when it is the update's own.
  std::string settle_after_failure(std::string_view error = {});
  // Fault injection, for that path's tests: issuing the next training pass's
  // first `kind` operation of block `block` throws, as a failed kernel
  // launch or copy would. Refused when the program has no such operation.
  void inject_device_fault(StepOpKind kind, int64_t block);

 private:
  std::unique_ptr<EngineCore> core_;  // engine/run/engine_core.h: the state and the executors
};

}  // namespace strider
