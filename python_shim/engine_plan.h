// What strider.Engine is made from, and the plan it runs by: the binding's
// reading of its two JSON arguments, and the same Plan::make that `strider
// finetune` runs (PlanLimits::take_settings for the settings,
// set_device_rates for the machine), so that Python chooses nothing of its
// own: the window and token tile where the config asks the plan (0, -1),
// and the kept activations and logits from `activations`.
#pragma once

#include <cstdint>
#include <string>

#include "engine/config/engine_config.h"
#include "engine/model/model_spec.h"
#include "engine/plan/plan.h"

namespace strider {

struct EngineArgs {
  ModelSpec spec;       // with the config's adapters, if any: what the engine trains
  EngineConfig config;
  // The Python package's own fields (not the engine config's, so not in a
  // checkpoint): how to choose saved_blocks and keep_logits ("auto",
  // "recompute", "saved"; empty: the config's own lists stand), and the pool
  // of devices ("2", "cuda:0,cuda:2").
  std::string activations;
  std::string devices = "1";
};

// Reads strider.Engine's model and engine config JSON (the engine config's
// fields, plus activations, devices, state_shards and state_shard). A bad
// value is a ValueError naming the argument and the field. config.devices is
// left for the caller, who knows the device (the pool's size).
EngineArgs engine_args(const std::string& model_config_json, const std::string& engine_config_json);

// The plan for `a` on `device_spec` (its kind: a device of that kind need
// not exist here) with `device_budget` bytes per device (> 0).
Plan engine_plan(const EngineArgs& a, const std::string& device_spec, uint64_t device_budget);

// The plan's choices into a.config, as `strider finetune` takes them: the
// window and token tile where the config asks (refused, with the plan's
// reason, when no plan fits), the expert pieces, the checkpoints' place
// (the host where the config says so, else the plan's choice), and
// saved_blocks and keep_logits where `activations` was given. A config with
// its own window and tile and no feasible plan keeps its placement, with no
// activations or logits kept: the engine's own checks then decide.
void take_plan(const Plan& p, EngineArgs& a, uint64_t device_budget);

}  // namespace strider
