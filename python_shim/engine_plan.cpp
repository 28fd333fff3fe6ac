#include "python_shim/engine_plan.h"

#include <nlohmann/json.hpp>
#include <tuple>
#include <vector>

#include "engine/config/config_fields.h"
#include "engine/config/engine_config_json.h"
#include "engine/plan/plan_device.h"
#include "gpu/device/device.h"
#include "python_shim/translated.h"

namespace strider {

void EngineSettings::set(const std::string& name, nlohmann::json v) {
  translated("EngineSettings", true, [&] {
    const ConfigField& f = config_field(name);
    STRIDER_CHECK(f.engine, "EngineSettings: '{}' is chosen for each run, not an engine setting", name);
    check_config_value(f, v, "EngineSettings");
    fields[name] = std::move(v);
  });
}

void EngineSettings::set_activations(const std::string& mode) {
  TORCH_CHECK_VALUE(mode == "auto" || mode == "recompute" || mode == "saved", "EngineSettings: activations '", mode,
                    "' is not auto, recompute or saved");
  activations = mode;
}

void EngineSettings::set_devices(const std::string& d) {
  TORCH_CHECK_VALUE(!d.empty(), "EngineSettings: devices must be a count or a list of devices, got ''");
  devices = d;  // read by make_devices, which refuses a bad one naming it
}

void EngineSettings::set_ranks(int64_t shard_, int64_t shards_) {
  TORCH_CHECK_VALUE(shards_ >= 1 && shard_ >= 0 && shard_ < shards_, "EngineSettings: rank slice ", shard_, " of ",
                    shards_, " is not one of 0..shards-1");
  shard = shard_;
  shards = shards_;
}

EngineArgs engine_args(const std::string& model_config_json, const EngineSettings& s) {
  const nlohmann::json model_json = parse_json(model_config_json, "model_config_json");
  EngineArgs a;
  a.activations = s.activations;
  a.devices = s.devices;
  a.spec = translated("model_config_json", true, [&] { return ModelSpec::from_json(model_json, "model_config_json"); });
  a.config = translated("EngineSettings", true, [&] { return engine_config_from_json(s.fields); });
  a.config.state_shards = int(s.shards);
  a.config.state_shard = int(s.shard);
  // The adapters, if any, are tensors of the model the engine trains (and names).
  a.spec = translated("EngineSettings", true, [&] { return a.spec.with_lora(a.config.lora, "EngineSettings lora"); });
  for (int64_t b : a.config.saved_blocks)
    TORCH_CHECK_VALUE(b >= 1 && b <= a.spec.layers, "EngineSettings: saved_blocks holds ", b,
                      ", which is not a decoder-layer block (1..", a.spec.layers, ")");
  return a;
}

Plan engine_plan(const EngineArgs& a, const std::string& device_spec, uint64_t device_budget) {
  return translated("plan", true, [&] {
    PlanLimits l;
    l.take_settings(a.config);
    l.device_bytes = device_budget;
    l.activations = a.activations.empty() ? ActivationMode::kRecompute : parse_activation_mode(a.activations);
    set_device_rates(l, device_spec);
    l.process_bytes = process_rss_bytes();
    return Plan::make(a.spec, l);
  });
}

void take_plan(const Plan& p, EngineArgs& a, uint64_t device_budget) {
  EngineConfig& c = a.config;
  const bool asked = c.window == 0 || c.compute.token_tile < 0;
  TORCH_CHECK_VALUE(p.feasible || !asked, "engine_config_json: window ", c.window, " and token_tile ",
                    c.compute.token_tile, " ask the plan to choose (0 and -1), and no plan fits this device's ",
                    device_budget, "-byte budget: ", p.reason);
  if (!p.feasible) {  // a config's own window and tile: the engine's checks decide, with nothing kept
    if (!a.activations.empty()) {
      c.saved_blocks.clear();
      c.keep_logits = false;
    }
    return;
  }
  TORCH_CHECK_VALUE(p.mlp_pieces == 0, "engine_config_json: only layers cut into sub-layer pieces (", p.mlp_pieces,
                    " MLP slices) fit this device's ", device_budget, "-byte budget, and those are not yet run "
                    "from Python; use `strider finetune`");
  if (c.window == 0) c.window = p.window;
  if (c.compute.token_tile < 0) c.compute.token_tile = p.token_tile;
  c.expert_pieces = p.expert_pieces;            // the config's own, unless only experts in groups fit
  c.checkpoints_on_host = p.checkpoints_on_host;  // the config's true, or the plan's choice
  if (a.activations.empty()) return;
  c.saved_blocks = p.saved_blocks;
  c.keep_logits = p.keep_logits;
}

std::string EngineSettings::plan(const std::string& model_config_json, const std::string& device,
                                 int64_t budget) const {
  TORCH_CHECK_VALUE(budget >= 0, "device_budget_bytes must be >= 0 (0: the device's default), got ", budget);
  EngineArgs a = engine_args(model_config_json, *this);
  a.config.devices = int(translated("plan", true, [&] { return pool_specs(device, a.devices).size(); }));
  const uint64_t bytes = budget > 0 ? uint64_t(budget) : translated("plan", true, [&] {
    return uint64_t(make_devices({.spec = device}, a.devices).front()->budget_bytes());
  });
  return engine_plan(a, device, bytes).to_json().dump();
}

std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>> EngineSettings::problems()
    const {
  const EngineConfig c =
      translated("EngineSettings", true, [&] { return engine_config_from_json(fields, /*check_rules=*/false); });
  std::vector<std::string> names, others, texts;
  for (const SettingsProblem& p : settings_problems(c)) {
    names.push_back(p.field);
    others.push_back(p.other);
    texts.push_back(p.text);
  }
  return {names, others, texts};
}

}  // namespace strider
