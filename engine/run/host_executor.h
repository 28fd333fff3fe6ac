// HostExecutor: the step program's host operations (engine/program/step_program.h:
// the optimizer, NVMe and collective lanes) as the device executor and the
// step see them; the host side of the seam that Device (gpu/device/device.h)
// is on the device side. Two implement it, chosen once when the engine is
// made, as its Device is:
//   EngineCore::Updater (engine/run/updater.h): the updater thread, running
//     the operations over the engine's state in RAM and on NVMe;
//   SimUpdater (engine/run/sim_updater.h): the same operations priced on
//     virtual clocks, beside a SimDevice.
// The device executor and step() call only this interface and never ask
// which one runs, as ggml's scheduler never asks which backend runs a graph.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/program/step_program.h"
#include "gpu/device/device.h"
#include "io/nvme_store.h"

namespace strider {

// A training pass's host work: what the step gives it, and what it decides.
struct UpdateJob {
  int64_t step = 0;  // 1-based: the AdamW step count
  int64_t pass = 0;  // 1-based: the training pass whose gradients it consumes
  double lr = 0;
  double loss_scale = 1.0;  // what the pass's loss gradient was multiplied by (fp16; else 1)
  int64_t fault_block = -1;  // Engine::inject_nonfinite_gradient's block, for this pass
  // Set by the executor before the norm is published (read after it).
  bool skipped = false;
  std::string skip_reason;
  int64_t nonfinite_block = -1;
  std::string nonfinite_tensor;
};

// What a pass's end tells the step: the gradient norm, or (an executor that
// prices the operations rather than runs them) the pass's span on its
// virtual clock: no figure was computed.
struct PassEnd {
  double grad_norm = std::numeric_limits<double>::quiet_NaN();
  bool priced = false;
  double begin_us = 0, end_us = 0;  // priced only
};

// Load staging of compute copies on NVMe (kComputeLoadSlots): each slot's
// buffer, its reads in flight, and per device an event its last load's
// copies out of it recorded (and, priced, one the read's end is recorded on).
// The device executor fills and empties it; the host executor reads into it.
struct ComputeSlot {
  std::span<std::byte> bytes;
  std::vector<NvmeTicket> reads;
  int64_t block = -1;
  uint64_t read_bytes = 0;
  double read_begin_us = 0;
  int copied_on = -1;                                     // the device of its last load (-1: none yet)
  std::vector<std::unique_ptr<Event>> copied, read_done;  // per device
};

class HostExecutor {
 public:
  virtual ~HostExecutor() = default;

  // A training pass of `program` begins (job->pass is its number): its host
  // operations run as its gradients land, freeing the ring slots the pass
  // may wait for.
  virtual void begin(const StepProgram& program, std::shared_ptr<UpdateJob> job) = 0;
  // Piece p's gradient D2H is enqueued, recorded into `landed`.
  virtual void landed(int64_t p, const Event& landed) = 0;
  // The next load of (trained) piece p on `dev` comes after the previous
  // pass's update of it: the issuing thread waits, or the H2D stream does.
  virtual void after_update(int64_t p, Device& dev) = 0;
  // The use-th D2H (0-based) into gradient ring slot r on `dev` comes after
  // `use` consumptions of the slot's gradients.
  virtual void after_ring(int r, int64_t use, Device& dev) = 0;
  // kReadCompute: `pieces`' compute copies (`bytes` of them) read into
  // `slot` for the visit `read`, once the slot's last load has copied it out
  // and their previous updates and write-backs are done. And its kLoad's
  // side: the H2D stream of `dev` waits until the reads are done.
  virtual void read_compute(ComputeSlot& slot, std::span<const int64_t> pieces, uint64_t bytes, const StepOp& read,
                            Device& dev) = 0;
  virtual void await_compute(ComputeSlot& slot, const StepOp& load, Device& dev) = 0;
  // The pass has issued its device work: returns once its norm is known
  // (its updates may go on), `job` filled.
  virtual PassEnd end(UpdateJob& job) = 0;
  // Every update issued so far is done (between steps).
  virtual void finish_updates() = 0;
  // The pass `job` will not end (its device work failed part way): its host
  // operations stop where they would wait for a gradient that will not land.
  // Returns once every earlier pass's host work is done and none of this
  // one's still runs: whether any of its updates was applied (the state is
  // then neither the previous step's nor this one's). Rethrows a host
  // operation's failure, of this pass or an earlier one.
  virtual bool abandon(const UpdateJob& job) = 0;
};

}  // namespace strider
