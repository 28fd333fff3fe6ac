// After a failure mid-work (engine/run/engine.h, settle_after_failure): the
// engine brought to rest and the state judged whole or not, so that a
// caller may still save the last step that completed; and the device fault
// its tests inject.
#include <fmt/format.h>

#include "engine/run/collectives.h"
#include "engine/run/engine.h"
#include "engine/run/engine_core.h"

namespace strider {

std::string Engine::settle_after_failure(std::string_view error) {
  EngineCore& core = *core_;
  std::string broken;
  const std::shared_ptr<UpdateJob> job = std::exchange(core.open_job_, nullptr);
  try {
    if (job && !core.dist_update_->ranks().solo())
      // Its host work may wait in a collective for the other ranks, whose part of the step is theirs.
      broken = fmt::format("step {} failed on one of {} data-parallel ranks, and the others' part of it is unknown",
                           job->step, core.dist_update_->ranks().world);
    else if (job && core.host_->abandon(*job))
      broken = fmt::format("step {} had updated part of the model before it failed (without clipping, updates "
                           "overlap the backward; --clip checks every gradient before any update)",
                           job->step);
    else if (!job)
      core.host_->finish_updates();  // a failure after the pass, or outside one: every update issued is done
  } catch (const std::exception& e) {
    broken = e.what() == error ? std::string("an update failed with that error")
                               : fmt::format("an update failed: {}", e.what());
  }
  // No copy or kernel of the failed pass still runs (a device that failed
  // reports it again here: its failure is the step's, already thrown).
  for (EngineCore::Seat& st : core.seats_) try {
      st.device->synchronize();
    } catch (...) {
    }
  core.failed_ = broken.empty() ? fmt::format("a call failed after step {}", core.steps_) : broken;
  return broken;
}

void Engine::inject_device_fault(StepOpKind kind, int64_t block) {
  EngineCore& core = *core_;
  STRIDER_CHECK(op_side(kind) == OpSide::kDevice, "inject_device_fault: '{}' is a host operation", op_name(kind));
  bool found = false;
  for (const StepOp& op : core.program_.ops) found = found || (op.kind == kind && op.block == block);
  STRIDER_CHECK(found, "inject_device_fault: the training program has no '{}' of block {}", op_name(kind), block);
  core.device_fault_ = {kind, block};
}

int64_t EngineCore::take_device_fault() {
  if (!device_fault_) return -1;
  const auto [kind, block] = *std::exchange(device_fault_, std::nullopt);
  for (size_t i = 0; i < program_.ops.size(); ++i)
    if (program_.ops[i].kind == kind && program_.ops[i].block == block) return int64_t(i);
  return -1;
}

}  // namespace strider
