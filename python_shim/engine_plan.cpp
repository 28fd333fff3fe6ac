#include "python_shim/engine_plan.h"

#include <torch/library.h>

#include <nlohmann/json.hpp>
#include <tuple>
#include <vector>

#include "engine/config/engine_config_json.h"
#include "engine/plan/plan_device.h"
#include "gpu/device/device.h"
#include "python_shim/translated.h"

namespace strider {

EngineArgs engine_args(const std::string& model_config_json, const std::string& engine_config_json) {
  const nlohmann::json model_json = parse_json(model_config_json, "model_config_json");
  nlohmann::json engine_json = parse_json(engine_config_json, "engine_config_json");
  EngineArgs a;
  // The package's own fields, taken out before the engine config is read.
  for (auto [key, dst] : {std::pair{"activations", &a.activations}, std::pair{"devices", &a.devices}}) {
    if (!engine_json.is_object() || !engine_json.contains(key)) continue;
    TORCH_CHECK_VALUE(engine_json[key].is_string(), "engine_config_json: ", key, " must be a string, got ",
                      engine_json[key].dump());
    *dst = engine_json[key].get<std::string>();
    engine_json.erase(key);
  }
  TORCH_CHECK_VALUE(a.activations.empty() || a.activations == "auto" || a.activations == "recompute" ||
                        a.activations == "saved",
                    "engine_config_json: activations '", a.activations, "' is not auto, recompute or saved");
  // strider.Engine in a torch.distributed group: this rank's slice of the sharded state.
  int64_t shards = 1, shard = 0;
  for (auto [key, dst] : {std::pair{"state_shards", &shards}, std::pair{"state_shard", &shard}}) {
    if (!engine_json.is_object() || !engine_json.contains(key)) continue;
    TORCH_CHECK_VALUE(engine_json[key].is_number_integer(), "engine_config_json: ", key, " must be an integer, got ",
                      engine_json[key].dump());
    *dst = engine_json[key].get<int64_t>();
    engine_json.erase(key);
  }
  a.spec = translated("model_config_json", true, [&] { return ModelSpec::from_json(model_json, "model_config_json"); });
  a.config = translated("engine_config_json", true, [&] { return engine_config_from_json(engine_json); });
  a.config.state_shards = int(shards);
  a.config.state_shard = int(shard);
  // The adapters, if any, are tensors of the model the engine trains (and names).
  a.spec = translated("engine_config_json", true, [&] { return a.spec.with_lora(a.config.lora, "engine_config_json lora"); });
  for (int64_t b : a.config.saved_blocks)
    TORCH_CHECK_VALUE(b >= 1 && b <= a.spec.layers, "engine_config_json: saved_blocks holds ", b,
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
    if (!a.activations.empty()) c.saved_blocks.clear(), c.keep_logits = false;
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

namespace {

// torch.ops.strider.plan: the plan strider.Engine would run by, as `strider
// plan --json` prints one. The budget 0: the device's default (a device of
// that kind is made to read it).
std::string plan_op(const std::string& model_config_json, const std::string& engine_config_json,
                    const std::string& device, int64_t device_budget_bytes) {
  TORCH_CHECK_VALUE(device_budget_bytes >= 0, "device_budget_bytes must be >= 0 (0: the device's default), got ",
                    device_budget_bytes);
  EngineArgs a = engine_args(model_config_json, engine_config_json);
  a.config.devices = int(translated("plan", true, [&] { return pool_specs(device, a.devices).size(); }));
  const uint64_t budget = device_budget_bytes > 0 ? uint64_t(device_budget_bytes) : translated("plan", true, [&] {
    return uint64_t(make_devices({.spec = device}, a.devices).front()->budget_bytes());
  });
  return engine_plan(a, device, budget).to_json().dump();
}

// torch.ops.strider.settings_problems: the rules between an engine config's
// settings (engine/config/engine_config_json.h), each as its field, the
// other field and the text,
// for strider.EngineConfig.validate. The fields one by one are the caller's
// to have checked: a bad one is a ValueError here.
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>> settings_problems_op(
    const std::string& engine_config_json) {
  const nlohmann::json j = parse_json(engine_config_json, "engine_config_json");
  const EngineConfig c =
      translated("engine_config_json", true, [&] { return engine_config_from_json(j, /*check_rules=*/false); });
  std::vector<std::string> fields, others, texts;
  for (const SettingsProblem& p : settings_problems(c)) {
    fields.push_back(p.field);
    others.push_back(p.other);
    texts.push_back(p.text);
  }
  return {fields, others, texts};
}

}  // namespace
}  // namespace strider

TORCH_LIBRARY_IMPL(strider, CompositeImplicitAutograd, m) {
  m.impl("plan", &strider::plan_op);
  m.impl("settings_problems", &strider::settings_problems_op);
}
