// SimUpdater: the step program's host operations on virtual clocks.
//
// On a SimDevice the engine issues its device operations unchanged and the
// device prices them; this prices the host operations of the same program
// (engine/program/step_program.h) on simulated host lanes (optimizer, NVMe read,
// NVMe write), where the real updater would run them: in program order on
// one thread, each when what it waits for is done, the NVMe operations on
// their own lanes. Its results go back to the device as events recorded at
// virtual times (gpu/device/sim_device.h, "Simulating the host"): a ring slot free
// again, a piece updated. It is the host executor (engine/run/host_executor.h)
// of an engine whose devices are SimDevices, as the Updater is of one whose
// devices run.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/placement/placement.h"
#include "engine/program/step_program.h"
#include "engine/program/timeline.h"
#include "engine/run/host_executor.h"
#include "gpu/device/sim_device.h"
#include "gpu/device/sim_host_memory.h"
#include "host/state_format.h"

namespace strider {

class SimUpdater final : public HostExecutor {
 public:
  SimUpdater(SimDevice& device, const Placement& place, StateFormat format, int64_t ring_slots, Timeline& timeline);

  // A pass of `program` begins (AdamW step job->step, for the spans).
  void begin(const StepProgram& program, std::shared_ptr<UpdateJob> job) override;
  // Piece p's gradient D2H is enqueued (recorded into `landed`): the host
  // operations up to the next piece not yet enqueued run now, so the events
  // the device waits on next (a ring slot) exist before it waits.
  void landed(int64_t p, const Event& landed) override;
  // The device's stream waits for the event this records at the virtual
  // time piece p's update ends, ring slot r's gradients are consumed.
  void after_update(int64_t p, Device& dev) override { dev.wait(StreamId::kH2D, *update_done_[size_t(p)]); }
  void after_ring(int r, int64_t, Device& dev) override { dev.wait(StreamId::kD2H, *ring_free_[size_t(r)]); }
  // Compute copies on NVMe: the read of `bytes` of them (named by the visit's
  // first piece), once the slot's last load has copied it out and the
  // pieces' previous updates and write-backs are done, on the drive's reads
  // that the state's share; its end recorded on the slot's event for `dev`.
  void read_compute(ComputeSlot& slot, std::span<const int64_t> pieces, uint64_t bytes, const StepOp& read,
                    Device& dev) override;
  void await_compute(ComputeSlot& slot, const StepOp& load, Device& dev) override {
    dev.wait(StreamId::kH2D, *slot.read_done[size_t(load.device)]);
  }
  // The rest of the pass: its span from the previous pass's end (0 before
  // the first) to the virtual time step() returns at (the norm known).
  PassEnd end(UpdateJob& job) override;
  void finish_updates() override {}  // the device's waits order everything
  bool abandon(const UpdateJob&) override { return false; }  // prices only: no state to leave half-updated

 private:
  void advance();  // prices operations up to the next piece not yet enqueued
  void run(const StepOp& op, double ready_us, double& end_us);
  void span(Lane lane, const char* name, int64_t piece, SimInterval t, uint64_t bytes);
  // An optimizer-lane job `t` that moves `bytes` through host memory: on a pool's shared bus too.
  SimInterval on_host_bus(SimInterval t, uint64_t bytes);

  SimDevice& sim_;
  const Placement& place_;
  StateFormat format_;
  Timeline& timeline_;
  std::vector<std::unique_ptr<Event>> update_done_, ring_free_;
  SimHostLane optimizer_, nvme_read_, nvme_write_, collective_;
  // The drive's reads as a calendar: the state's (in program order on
  // nvme_read_) and the compute copies' (issued by the device executor, out
  // of the updater's order) share its time.
  SimHostMemory drive_reads_;
  std::vector<double> compute_written_us_;  // per piece
  const StepProgram* program_ = nullptr;
  int64_t step_ = 0;
  size_t next_ = 0;                 // the next operation to price
  double thread_us_ = 0;            // the updater thread reaches the next operation
  double begin_us_ = 0, end_us_ = 0;
  std::vector<double> end_;         // per operation: when it is done
  std::vector<double> previous_end_;  // the same in the previous pass
  std::vector<double> landed_us_;   // per piece: its gradients on the host (-1: not enqueued yet)
};

}  // namespace strider
