// The step as a program (docs/step-program.md).
//
// One training pass is a list of operations, compiled from the Placement and
// the configuration before the first step: the device's (per visit of the
// sliding window: its H2D issued K-2 visits ahead, its compute per
// micro-batch, the copies of checkpoints, kept activations and gradients, its
// release) and the host's (per piece: its gradients landing, summed over the
// ranks, their sum of squares, parked on NVMe, the state read, AdamW, the
// state written back, the compute copy gathered, the next H2D released; the
// loss and norm checks). Features are passes that add, order or mark
// operations, each a function of its own (engine/program/passes.h, in the
// order compile_step runs them):
//   visits            forward, head, backward: the base program (a layer one
//                     visit, or one per sub-layer piece), each visit on its device
//   micro-batches     each visit's compute per micro-batch, its gradients out
//   tied              the head's share of a tied embedding's gradient out and in
//   host checkpoints  a layer's input out after the forward, in before the backward
//   devices           a pool: a block's input and output gradient, and the
//                     head's state, log-sum-exp and hidden gradient, handed
//                     to the next device
//   kept activations  what a kept layer's forward keeps out, and back one
//                     micro-batch ahead of its backward
//   kept logits       the head's pass 1 keeps the logits for pass 2
//   base format       a layer visit whose base is quantized starts by dequantizing it
//   prefetch          each visit's load K-2 visits ahead (a pool: just before it)
//                     (compute copies on NVMe: each read one load ahead of its own)
//   landing           each piece's gradients in landing order, and their sums of squares
//   clipping          with clipping (or loss scaling): the norm gates every
//                     update, which run in forward order after it; without:
//                     each update follows its gradients, the first piece
//                     checked before any update
//   ranks             sums over the ranks (a reduce-scatter when the state is
//                     sharded) and the compute copy's gather
//   nvme              spills under clipping, state read ahead and written back
//   previous step     what the next pass's loads and state reads wait for
// Two executors walk the same program: the engine's (the issuing thread for
// device operations, the updater thread for host ones) and the simulator
// (engine/run/sim_updater.h, with the SimDevice pricing the device's). Neither
// reads a feature flag of the configuration: a pass has put what they need
// into the operations. docs/step-program.md says where a new
// kind of operation goes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "engine/placement/placement.h"
#include "engine/program/timeline.h"  // Lane
#include "host/state_format.h"

namespace strider {

enum class StepOpKind : uint8_t {
  // Device operations (op_side), roughly in the order the issuing thread enqueues them. A
  // visit's operations hold its unit from its kLoad to its kRelease; the
  // first of them on the compute stream waits for the load.
  kReadCompute,        // nvme read: a visit's compute copies on NVMe into a load staging slot, one load ahead
  kLoad,               // h2d: a visit's pieces into a cache unit (after their previous pass's kUpdated)
  kDequantize,         // compute: a quantized base's bytes, landed with the load, into the unit's parameters
  kZeroGrads,          // compute: the unit's gradient accumulators zeroed
  kTiedGradIn,         // h2d: a tied embedding shard's gradient starts from the head's share
  kCheckpointIn,       // h2d: a layer's input for one micro-batch back from the host
  kForward,            // compute: a piece's forward for one micro-batch
  kSaveOut,            // d2h: what a kept layer's forward kept, for one micro-batch
  kCheckpointOut,      // d2h: the next block's input for one micro-batch out to the host
  kHandOut,            // d2h: a pool: a block's input (or output gradient) for one micro-batch, to the next device
  kHandIn,             // h2d: a pool: what kHandOut handed, on the device of the visit it is for
  kHeadLse,            // compute: the head's pass 1 (log-sum-exp) over one shard, one micro-batch
  kObjective,          // compute: an objective past SFT over every micro-batch's log-probabilities (the last shard's device)
  kLossOut,            // d2h: the pass's loss figures
  kHeadGrad,           // compute: the head's pass 2 (gradients) over one shard, one micro-batch
  kHeadNormBackward,   // compute: the final norm's backward for one micro-batch
  kFetchSaved,         // h2d: a kept layer's activations for one micro-batch, one ahead of its backward
  kBackward,           // compute: a piece's recompute + backward for one micro-batch
  kGradsToSend,        // compute: the visit's gradients in the transfer dtype
  kGradsOut,           // d2h: a piece's gradients to host staging
  kTiedGradOut,        // d2h: the head's share of a tied embedding's gradient (fp32)
  kRelease,            // the visit's unit free once its streams pass this point
  // Host operations (op_side), roughly in the order the updater thread runs them.
  kLand,        // a piece's gradients are in host staging (their D2H is done)
  kSumRanks,    // summed over the ranks (a reduce-scatter of this rank's slice when sharded)
  kSumSquares,  // its sum of squares (over the ranks' slices when sharded); a non-finite one named
  kSpill,       // parked on NVMe until the norm; frees its ring slot
  kCheckLoss,   // the pass's loss: a non-finite one skips the step
  kCheckGrad,   // a non-finite gradient skips the step (nothing updated yet) or stops the run
  kNorm,        // the global norm published; with clipping it gates the updates and sets their scale
  kReadState,   // master, m, v (and spilled gradients) from NVMe into a staging slot
  kAdamW,       // the update (skipped: the gradients consumed)
  kWriteState,  // the updated NVMe-tier state written back
  kGather,      // the other ranks' slices of the new compute copy (a barrier on a shared one)
  kUpdated,     // the piece's next H2D may go
};
inline constexpr int kOpKinds = int(StepOpKind::kUpdated) + 1;
const char* op_name(StepOpKind k);
std::optional<StepOpKind> op_kind_named(std::string_view name);  // op_name's inverse
// Which executor runs a kind: the issuing thread's device table
// (run_device_op; priced by the SimDevice from what its handler enqueues) or
// the updater's host table (run_host_op; priced by SimUpdater::run). The two
// lists below are the sides: op_side's switch over both names every kind
// once (a kind in neither, or in both, does not compile), and each
// executor's switch names its own kinds and the other side's list as
// refused, so a kind without its handler or its price does not compile
// either (the engine builds with -Werror=switch).
enum class OpSide : uint8_t { kDevice, kHost };
OpSide op_side(StepOpKind k);
#define STRIDER_DEVICE_OP_KINDS \
  case StepOpKind::kReadCompute: \
  case StepOpKind::kLoad: \
  case StepOpKind::kDequantize: \
  case StepOpKind::kZeroGrads: \
  case StepOpKind::kTiedGradIn: \
  case StepOpKind::kCheckpointIn: \
  case StepOpKind::kForward: \
  case StepOpKind::kSaveOut: \
  case StepOpKind::kCheckpointOut: \
  case StepOpKind::kHandOut: \
  case StepOpKind::kHandIn: \
  case StepOpKind::kHeadLse: \
  case StepOpKind::kObjective: \
  case StepOpKind::kLossOut: \
  case StepOpKind::kHeadGrad: \
  case StepOpKind::kHeadNormBackward: \
  case StepOpKind::kFetchSaved: \
  case StepOpKind::kBackward: \
  case StepOpKind::kGradsToSend: \
  case StepOpKind::kGradsOut: \
  case StepOpKind::kTiedGradOut: \
  case StepOpKind::kRelease
#define STRIDER_HOST_OP_KINDS \
  case StepOpKind::kLand: \
  case StepOpKind::kSumRanks: \
  case StepOpKind::kSumSquares: \
  case StepOpKind::kSpill: \
  case StepOpKind::kCheckLoss: \
  case StepOpKind::kCheckGrad: \
  case StepOpKind::kNorm: \
  case StepOpKind::kReadState: \
  case StepOpKind::kAdamW: \
  case StepOpKind::kWriteState: \
  case StepOpKind::kGather: \
  case StepOpKind::kUpdated

// What a pool's kHandOut and kHandIn carry, per micro-batch, each kind in
// its own host buffers: a block's input (or, `grads`, its output gradient);
// with the head's shards on several devices, the head's per-token state
// from one shard's pass 1 to the next's, the log-sum-exp from the last
// shard's pass 1 to the other shards' pass 2 (with an objective past SFT,
// and its per-token coefficients), and the hidden gradient from
// one shard's pass 2 to the next's.
enum class Hand : uint8_t { kBlock, kHeadState, kLse, kHeadGrad };
inline constexpr int kHandKinds = 4;

// What an operation carries beyond the fields every kind has: a payload per
// group of kinds (op_args), so that a field means one thing. Set by passes,
// read by the executors.
struct ComputeArgs {       // kForward, kBackward, kHeadLse, kHeadGrad
  bool keep = false;       // kForward: keeps what backward needs (kept activations); kBackward: uses it;
                           // the head's: pass 1 keeps the logits, pass 2 uses them
  bool recompute = false;  // kForward: a sub-layer attention half's again in backward, for the MLP's input
  bool wait_ring = false;  // kForward: its output's checkpoint ring set must have left (host checkpoints)
  bool packed = false;     // a layer's kForward, kBackward: its rows may pack documents, its attention
                           // masked per row (EngineConfig::packed_documents; the FLOPs of the whole square)
};
struct CopyArgs {                    // kCheckpointIn, kCheckpointOut, kSaveOut
  bool first = false, last = false;  // the first and last micro-batch's copy of the group
  int peer = -1;                     // kCheckpointIn: the device that made it, when another
};
struct HandArgs {            // kHandOut, kHandIn (a pool)
  Hand hand = Hand::kBlock;  // what it carries
  bool grads = false;        // the output gradient flowing backward (else a block's input)
  bool first = false;        // kHandIn: the visit's first (it waits for this device's compute so far)
  int peer = -1;             // kHandIn: the device that handed it over
  bool wait_ring = false;    // kHandIn, the visit's first of a block's input: its checkpoint ring set must have left
};
struct SlotArgs {  // kReadCompute, kLoad
  int slot = -1;   // the load staging slot of a compute copy read from NVMe (-1: none)
};
struct ReleaseArgs {  // kRelease
  bool d2h = false;   // the visit's gradients left on the d2h stream
};
struct SliceArgs {            // kSumRanks, kSumSquares, kAdamW, kGather
  bool over_slices = false;   // this rank holds a slice (sharded state)
  bool shared_copy = false;   // kGather, kAdamW: the machine's ranks share one compute copy
};
struct NormArgs {         // kNorm
  bool gate = false;      // a non-finite norm skips the step, and `clip` scales the updates
  double clip = 0;        // the clipping norm (0: none)
  bool unscale = false;   // the gradients carry the pass's loss scale: the norm and the updates divide it out
};
struct CheckArgs {              // kCheckGrad
  int64_t updated_before = 0;   // pieces the pass updated before this one
};
using OpArgs = std::variant<std::monostate, ComputeArgs, CopyArgs, HandArgs, SlotArgs, ReleaseArgs, SliceArgs,
                            NormArgs, CheckArgs>;
// A kind's payload, defaulted (std::monostate: none).
OpArgs op_args(StepOpKind k);

// Every payload's fields side by side, a kind's own set and the others at
// their defaults: what the program's text, JSON and the bit matrix print.
struct OpFields : ComputeArgs, SliceArgs, NormArgs, CheckArgs, ReleaseArgs, SlotArgs {
  bool first = false, last = false, grads = false;
  int peer = -1;
  Hand hand = Hand::kBlock;
};
struct StepOp;
OpFields fields(const StepOp& op);

struct StepOp {
  StepOpKind kind = StepOpKind::kForward;
  Lane lane = Lane::kCompute;
  int64_t piece = -1;          // the piece it works on (-1: none, or the head's visit)
  int64_t block = -1;          // the piece's block; kCheckpointIn/Out, kSaveOut, kFetchSaved: the layer
  int64_t visit = -1;          // device operations: their visit
  int64_t micro_batch = -1;    // device operations per micro-batch
  int64_t shard = -1;          // the head's operations: the vocabulary shard
  int device = 0;              // device operations: the pool's device they run on (Placement::block_device, head_device)
  bool first_of_visit = false; // a device operation: the visit's first after its load, which it waits for (Draft::finish)
  OpArgs args;                 // op_args(kind): StepOp::of sets it
  std::vector<int32_t> after;  // operations of the same pass it waits for (indices into StepProgram::ops)
  std::vector<int32_t> after_previous;  // operations of the previous pass it waits for

  // An operation of kind k on `lane`, its payload the kind's.
  static StepOp of(StepOpKind k, Lane lane, std::vector<int32_t> after = {}) {
    StepOp o;
    o.kind = k;
    o.lane = lane;
    o.args = op_args(k);
    o.after = std::move(after);
    return o;
  }
  // The payload, as its kind's (std::bad_variant_access: another kind's).
  template <class T> T& as() { return std::get<T>(args); }
  template <class T> const T& as() const { return std::get<T>(args); }
  // The issuing thread's (else the updater's).
  bool on_device() const { return op_side(kind) == OpSide::kDevice; }
};

struct StepProgram {
  std::vector<StepOp> ops;      // device and host operations; each executor walks its own in order
  int64_t visits = 0;           // the visits (a kLoad ... kRelease each)
  // Per visit: its pieces' ranges in its cache unit (Sharding::unit_layout).
  std::vector<std::vector<UnitRun>> layouts;
  std::vector<int32_t> landed;  // per piece: its kLand operation (-1: a frozen piece has none)
  std::vector<int32_t> updated; // per piece: its kUpdated operation (-1: frozen)
  int32_t norm = -1;            // the kNorm operation: the step's end for step()
};

// What the passes need beyond the placement.
struct ProgramInputs {
  int64_t window = 2;           // K: loads are issued K-2 visits ahead (engine/program/pass_prefetch.cpp)
  int64_t micro_batches = 1;    // M
  bool checkpoints_on_host = false;  // block inputs copied out after forward and back before backward
  bool keep_logits = false;     // the head's pass 1 keeps the logits for pass 2
  double clip_norm = 0;
  bool loss_scaled = false;     // fp16: the gradients carry a loss scale (the norm gates the updates, as clipping's does)
  bool packed_documents = false;  // rows may pack documents (a layer's attention masked per row)
  bool objective = false;       // an objective past SFT: a kObjective between the head's passes
  int world = 1;                // ranks stepping together (1: none)
  bool shared_compute = false;  // the machine's ranks share one compute copy
};

// The inputs an engine configuration gives, for `world` ranks.
ProgramInputs program_inputs(const EngineConfig& config, int world);

// What the executors read of a program beyond its operations, so that they
// read no configuration: whether its layers may see rows that pack documents
// (the batch's positions go to the devices), and whether device d keeps
// logits between the head's passes (it holds a buffer for them).
bool takes_positions(const StepProgram& program);
bool keeps_logits(const StepProgram& program, int device);

// The training pass and the evaluation pass (forward and pass 1 only; no host operations).
StepProgram compile_step(const Placement& place, const ProgramInputs& in);
StepProgram compile_eval(const Placement& place, const ProgramInputs& in);

// The bytes operations move, for both executors' spans: master, m and v of
// n elements in `format`; what AdamW reads and writes for them (fp32: master,
// m, v read and written; q8: the compute copy, the extension and both codes
// read and written, plus the groups' scales), gradients included.
uint64_t state_bytes(StateFormat format, size_t n);
uint64_t adam_bytes(StateFormat format, size_t n, size_t grad_bytes);
// What piece p's kReadState and kWriteState move, for n elements of state:
// the state, the spilled gradients read back, and a compute copy on NVMe
// (read only for q8, whose master it is part of; always written back).
uint64_t state_read_bytes(const Placement& place, StateFormat format, int64_t p, size_t n);
uint64_t state_write_bytes(const Placement& place, StateFormat format, int64_t p, size_t n);

// One line per operation: index, lane, operation, what, what it waits for.
std::string describe(const StepProgram& program, const ModelSpec& spec, const Placement& place);
nlohmann::json to_json(const StepProgram& program, const ModelSpec& spec, const Placement& place);

}  // namespace strider
