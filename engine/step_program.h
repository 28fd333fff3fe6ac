// The step as a program (engine/README.md, "The step program").
//
// One training pass is a list of operations, compiled from the Placement and
// the configuration before the first step: the device's (each visit's H2D,
// issued K-1 visits ahead, and its compute; kept activations fetched ahead)
// and the host's (per piece: its gradients landing, summed over the ranks,
// their sum of squares, parked on NVMe, the state read, AdamW, the state
// written back, the compute copy gathered, the next H2D released; the loss and
// norm checks). Features are passes that add or order operations:
//   visits       forward, head, backward: the base program
//   prefetch     each visit's load K-1 visits ahead; kept activations fetched
//                one visit ahead of their layer's backward
//   landing      each piece's gradients in landing order, and their sums of squares
//   ranks        sums over the ranks (a reduce-scatter when the state is
//                sharded) and the compute copy's gather
//   clipping     with clipping: the norm gates every update, which run in
//                forward order after it; without: each update follows its
//                gradients, the first piece checked before any update
//   nvme         spills under clipping, state read ahead and written back
// Two executors walk the same program: the engine's (the issuing thread for
// device operations, the updater thread for host ones) and the simulator
// (engine/sim_updater.h) on virtual clocks. Neither reads a feature flag of
// the configuration: a pass has put what they need into the operations.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "engine/placement.h"
#include "engine/timeline.h"  // Lane
#include "host/state_format.h"

namespace strider {

enum class StepOpKind : uint8_t {
  // Device operations, in the order the issuing thread enqueues them.
  kLoad,        // h2d: a visit's pieces into a cache unit (after their previous pass's kUpdated)
  kForward,     // compute: a piece's forward over every micro-batch
  kHead,        // compute: the head's visit of one vocabulary shard (pass 1, pass 2, or both)
  kBackward,    // compute: a piece's recompute + backward over every micro-batch; its gradients out
  kFetchSaved,  // h2d: a layer's kept activations for its first micro-batch, one visit ahead
  // Host operations, in the order the updater thread runs them.
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
const char* op_name(StepOpKind k);

struct StepOp {
  StepOpKind kind = StepOpKind::kForward;
  Lane lane = Lane::kCompute;
  int64_t piece = -1;          // the piece (kHead: -1; kFetchSaved: -1)
  int64_t block = -1;          // kFetchSaved: the layer; else the piece's block (kHead: the head)
  int64_t visit = -1;          // device operations: the visit they load or compute
  int64_t shard = -1;          // kHead: the vocabulary shard
  bool lse = false, grad = false;  // kHead: pass 1, pass 2
  // Set by passes, read by the executors.
  bool over_slices = false;    // kSumRanks, kSumSquares, kAdamW: this rank holds a slice (sharded state)
  bool collective = false;     // kSumRanks, kGather: the ranks take part (kGather: a barrier when shared)
  bool shared_copy = false;    // kGather, kAdamW: the machine's ranks share one compute copy
  bool gate = false;           // kNorm: a non-finite norm skips the step, and `clip` scales the updates
  double clip = 0;             // kNorm: the clipping norm
  int64_t updated_before = 0;  // kCheckGrad: pieces the pass updated before this one
  std::vector<int32_t> after;  // operations of the same pass it waits for (indices into StepProgram::ops)
  std::vector<int32_t> after_previous;  // operations of the previous pass it waits for
  // The issuing thread's (else the updater's).
  bool on_device() const { return kind <= StepOpKind::kFetchSaved; }
};

struct StepProgram {
  std::vector<StepOp> ops;      // device and host operations; each executor walks its own in order
  int64_t visits = 0;           // the visits (kForward / kHead / kBackward operations)
  std::vector<int32_t> landed;  // per piece: its kLand operation
  std::vector<int32_t> updated; // per piece: its kUpdated operation
  int32_t norm = -1;            // the kNorm operation: the step's end for step()
};

// What the passes need beyond the placement.
struct ProgramInputs {
  int64_t window = 2;           // K: loads run K-1 visits ahead
  double clip_norm = 0;
  int world = 1;                // ranks stepping together (1: none)
  bool shared_compute = false;  // the machine's ranks share one compute copy
};

// The training pass and the evaluation pass (forward and pass 1 only; no host operations).
StepProgram compile_step(const Placement& place, const ProgramInputs& in);
StepProgram compile_eval(const Placement& place, int64_t window);

// The bytes operations move, for both executors' spans: master, m and v of
// n elements in `format`; what AdamW reads and writes for them (fp32: master,
// m, v read and written; q8: the compute copy, the extension and both codes
// read and written, plus the groups' scales), gradients included.
uint64_t state_bytes(StateFormat format, size_t n);
uint64_t adam_bytes(StateFormat format, size_t n, size_t grad_bytes);

// One line per operation: index, lane, operation, what, what it waits for.
std::string describe(const StepProgram& program, const ModelSpec& spec, const Placement& place);
nlohmann::json to_json(const StepProgram& program, const ModelSpec& spec, const Placement& place);

}  // namespace strider
