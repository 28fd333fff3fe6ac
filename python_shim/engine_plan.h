// What strider.Engine is made from, and the plan it runs by: the binding's
// reading of its two JSON arguments, and the same Plan::make that `strider
// finetune` runs (PlanLimits::take_settings for the settings,
// set_device_rates for the machine), so that Python chooses nothing of its
// own: the window and token tile where the config asks the plan (0, -1),
// and the kept activations and logits from `activations`.
#pragma once

#include <torch/custom_class.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

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

// torch.classes.strider.EngineSettings: what strider.Engine is told, as typed
// values, each checked against engine/config/config_fields.json when it is
// set (a ValueError naming the field and what it takes): the engine config's
// fields by name (set_int, set_float, set_bool, set_text, set_ints; a field
// not set takes its default), and the package's own, which no checkpoint
// records: activations, the pool of devices, and a data-parallel rank's slice
// of the state. No text is parsed to read them.
class EngineSettings : public torch::CustomClassHolder {
 public:
  void set_int(const std::string& name, int64_t v) { set(name, v); }
  void set_float(const std::string& name, double v) { set(name, v); }
  void set_bool(const std::string& name, bool v) { set(name, v); }
  void set_text(const std::string& name, const std::string& v) { set(name, v); }
  void set_ints(const std::string& name, std::vector<int64_t> v) { set(name, v); }
  void set_activations(const std::string& mode);  // auto, recompute or saved
  void set_devices(const std::string& devices);    // a count, or a list of devices
  void set_ranks(int64_t shard, int64_t shards);   // this rank's slice of the state, of `shards`

  // The plan an Engine with these settings runs by (engine_plan), for a
  // model's config.json text, on `device` ("cpu", "cuda", "sim:rtx4090"; no
  // such device need exist when the budget is given) with `budget` bytes (0:
  // the device's default): `strider plan --json`'s document.
  std::string plan(const std::string& model_config_json, const std::string& device, int64_t budget) const;
  // The rules between the settings that no field states alone
  // (settings_problems): each broken one's field, the other field it is held
  // against, and its text. strider.EngineConfig.validate asks here.
  std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>> problems() const;

  nlohmann::json fields = nlohmann::json::object();  // the engine config fields set, checked
  std::string activations, devices = "1";
  int64_t shards = 1, shard = 0;

 private:
  void set(const std::string& name, nlohmann::json v);
};

// Reads strider.Engine's arguments: the model's config.json text and its
// settings. A bad value is a ValueError naming the argument and the field.
// config.devices is left for the caller, who knows the device (the pool's size).
EngineArgs engine_args(const std::string& model_config_json, const EngineSettings& settings);

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
