// Internal to the step program's compiler (engine/program/step_program.cpp): its
// device operations, which the host operations' passes then follow.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/program/step_program.h"

namespace strider {

// What the host operations' passes take from the device's.
struct DeviceOps {
  std::vector<int32_t> grads_out;  // per piece: its kGradsOut (-1: none, a frozen piece)
  int32_t loss = -1;               // the pass's kLossOut
};

// The device operations of a training (`train`) or evaluation pass into
// prog.ops, with prog.visits and prog.layouts.
DeviceOps compile_device(const Placement& place, const ProgramInputs& in, bool train, StepProgram& prog);

}  // namespace strider
