#include "engine/config/engine_config_json.h"

#include <algorithm>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/config/config_fields.h"
#include "host/error.h"

namespace strider {

namespace {
const char* shape_name(LrShape s) {
  return s == LrShape::kConstant ? "constant" : s == LrShape::kLinear ? "linear" : "cosine";
}
}  // namespace

nlohmann::json engine_config_to_json(const EngineConfig& c) {
  return {{"seq", c.seq},
          {"micro_batch", c.micro_batch},
          {"accumulation", c.accumulation},
          {"dtype", std::string(compute_dtype_name(c.compute.dtype))},
          {"matmul_accumulate", c.compute.fp16_accumulate ? "fp16" : "fp32"},
          {"loss_scale", c.loss_scaling.init},
          {"loss_scale_growth_interval", c.loss_scaling.growth_interval},
          {"vocab_chunk", c.compute.vocab_chunk},
          {"token_tile", c.compute.token_tile},
          {"vocab_shard_rows", c.vocab_shard_rows},
          {"layer_pieces", c.layer_pieces},
          {"expert_pieces", c.expert_pieces},
          {"mlp_pieces", c.mlp_pieces},
          {"lora", c.lora},
          {"base_format", std::string(base_format_name(c.base_format))},
          {"grad_transfer", c.fp32_grad_transfer ? "fp32" : "bf16"},
          {"window", c.window},
          {"checkpoints_on_host", c.checkpoints_on_host},
          {"lr", c.adam.lr},
          {"beta1", c.adam.beta1},
          {"beta2", c.adam.beta2},
          {"eps", c.adam.eps},
          {"weight_decay", c.adam.weight_decay},
          {"decay_norms_and_biases", c.decay_norms_and_biases},
          {"optimizer", c.adam.mode == AdamMode::kAdamW ? "adamw" : "adam"},
          {"schedule", shape_name(c.schedule.shape)},
          {"warmup_steps", c.schedule.warmup_steps},
          {"total_steps", c.schedule.total_steps},
          {"clip_norm", c.clip_norm},
          {"optimizer_state", std::string(state_format_name(c.optimizer_state))},
          {"optimizer_threads", c.optimizer_threads},
          {"nvme_dir", c.nvme_dir},
          {"nvme_blocks", c.nvme_blocks},
          {"nvme_compute_blocks", c.nvme_compute_blocks},
          {"grad_ring", c.grad_ring},
          {"saved_blocks", c.saved_blocks},
          {"keep_logits", c.keep_logits},
          {"packed_documents", c.packed_documents},
          {"keep_reference", c.keep_reference},
          {"objective", c.objective.objective},
          {"loss_type", c.objective.loss_type},
          {"beta", c.objective.beta},
          {"label_smoothing", c.objective.label_smoothing},
          {"simpo_gamma", c.objective.simpo_gamma},
          {"epsilon", c.objective.epsilon},
          {"epsilon_high", c.objective.epsilon_high},
          {"max_completion_length", c.objective.max_completion_length}};
}

EngineConfig engine_config_from_json(const nlohmann::json& given, bool check_rules) {
  STRIDER_CHECK(given.is_object(), "engine config: expected a JSON object, got {}", given.dump());
  // Every field the declaration (engine/config/config_fields.json) puts in the
  // engine config, checked against it; what is not given takes its default.
  nlohmann::json j;
  for (const ConfigField& f : config_fields())
    if (f.engine) j[f.name] = f.default_value;
  for (const auto& [key, value] : given.items()) {
    STRIDER_CHECK(j.contains(key), "engine config: unknown field '{}'", key);
    check_config_value(config_field(key), value, "engine config");
    j[key] = value;
  }
  EngineConfig c;
  auto get = [&](const char* key, auto& out) { out = j[key].get<std::decay_t<decltype(out)>>(); };
  get("seq", c.seq);
  get("micro_batch", c.micro_batch);
  get("accumulation", c.accumulation);
  c.compute.dtype = parse_compute_dtype(j["dtype"].get<std::string>(), "engine config dtype");
  c.compute.fp16_accumulate = j["matmul_accumulate"] == "fp16";
  get("loss_scale", c.loss_scaling.init);
  get("loss_scale_growth_interval", c.loss_scaling.growth_interval);
  get("vocab_chunk", c.compute.vocab_chunk);
  get("token_tile", c.compute.token_tile);
  get("vocab_shard_rows", c.vocab_shard_rows);
  get("layer_pieces", c.layer_pieces);
  get("expert_pieces", c.expert_pieces);
  get("mlp_pieces", c.mlp_pieces);
  get("lora", c.lora);
  c.base_format = parse_base_format(j["base_format"].get<std::string>(), "engine config base_format");
  c.fp32_grad_transfer = j["grad_transfer"] == "fp32";
  get("window", c.window);
  get("checkpoints_on_host", c.checkpoints_on_host);
  get("lr", c.adam.lr);
  get("beta1", c.adam.beta1);
  get("beta2", c.adam.beta2);
  get("eps", c.adam.eps);
  get("weight_decay", c.adam.weight_decay);
  get("decay_norms_and_biases", c.decay_norms_and_biases);
  c.adam.mode = j["optimizer"] == "adamw" ? AdamMode::kAdamW : AdamMode::kAdam;
  c.schedule.shape = LrSchedule::parse_shape(j["schedule"]);
  get("warmup_steps", c.schedule.warmup_steps);
  get("total_steps", c.schedule.total_steps);
  get("clip_norm", c.clip_norm);
  c.optimizer_state = parse_state_format(j["optimizer_state"].get<std::string>());
  get("optimizer_threads", c.optimizer_threads);
  get("nvme_dir", c.nvme_dir);
  get("nvme_blocks", c.nvme_blocks);
  get("nvme_compute_blocks", c.nvme_compute_blocks);
  get("grad_ring", c.grad_ring);
  get("keep_logits", c.keep_logits);
  get("packed_documents", c.packed_documents);
  get("keep_reference", c.keep_reference);
  get("objective", c.objective.objective);
  get("loss_type", c.objective.loss_type);
  get("beta", c.objective.beta);
  get("label_smoothing", c.objective.label_smoothing);
  get("simpo_gamma", c.objective.simpo_gamma);
  get("epsilon", c.objective.epsilon);
  get("epsilon_high", c.objective.epsilon_high);
  get("max_completion_length", c.objective.max_completion_length);
  // Decoder-layer blocks are 1..layers (the declaration's minimum is 1): the
  // upper bound needs the model, which whoever builds the Engine checks (the
  // Engine does too).
  get("saved_blocks", c.saved_blocks);
  std::vector<int64_t> sorted = c.saved_blocks;
  std::sort(sorted.begin(), sorted.end());
  STRIDER_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                "engine config: saved_blocks lists a block twice ({})", j["saved_blocks"].dump());
  if (check_rules) check_settings(c);
  return c;
}

std::vector<SettingsProblem> settings_problems(const EngineConfig& c) {
  std::vector<SettingsProblem> out;
  auto rule = [&](bool holds, const char* field, const char* other, std::string text) {
    if (!holds) out.push_back({field, other, std::move(text)});
  };
  rule(c.window != 1, "window", "",
       "window 1: must be 0 (the plan chooses) or >= 2: one unit computes while the next is copied in");
  rule(!c.compute.fp16_accumulate || c.compute.dtype == at::kHalf, "matmul_accumulate", "dtype",
       fmt::format("matmul_accumulate fp16 accumulates fp16 GEMMs in fp16: it needs dtype fp16, not {}",
                   compute_dtype_name(c.compute.dtype)));
  rule(!state_uses_compute_copy(c.optimizer_state) || c.compute.dtype == at::kBFloat16, "optimizer_state", "dtype",
       fmt::format("optimizer_state {0}: the {0} optimizer state keeps the master's high half in the bf16 compute "
                   "copy: it needs the bf16 compute dtype, not {1}",
                   state_format_name(c.optimizer_state), compute_dtype_name(c.compute.dtype)));
  const std::string_view base = base_format_name(c.base_format);
  rule(c.base_format == BaseFormat::kCompute || !c.lora.empty(), "base_format", "lora",
       fmt::format("base_format {}: only a frozen LoRA base is quantized; give lora too, or base_format compute", base));
  rule(c.base_format == BaseFormat::kCompute || c.compute.dtype != at::kHalf, "base_format", "dtype",
       fmt::format("base_format {} with the fp16 compute dtype: a quantized base dequantizes to bf16 or fp32 only; "
                   "give base_format compute, or dtype bf16", base));
  rule(c.base_format == BaseFormat::kCompute || c.layer_pieces.empty(), "base_format", "layer_pieces",
       fmt::format("base_format {} with layer_pieces '{}': a quantized base is one piece of its layer; leave "
                   "layer_pieces empty", base, c.layer_pieces));
  for (ObjectiveProblem& p : objective_problems(c.objective, c.packed_documents))
    out.push_back({p.field, "", std::move(p.text)});
  rule(!c.keep_reference || c.lora.empty(), "keep_reference", "lora",
       "keep_reference with lora: LoRA's reference model is its frozen base, which the engine holds already; "
       "leave keep_reference off");
  rule(!c.keep_reference || c.nvme_compute_blocks.empty(), "keep_reference", "nvme_compute_blocks",
       "keep_reference with compute copies on NVMe (nvme_compute_blocks): the reference copy lives in RAM only; "
       "give more RAM, or leave keep_reference off");
  rule(c.mlp_pieces == 0 || c.saved_blocks.empty(), "mlp_pieces", "saved_blocks",
       fmt::format("mlp_pieces {} with saved_blocks: a layer cut into sub-layer pieces keeps no activations yet; "
                   "leave saved_blocks empty", c.mlp_pieces));
  return out;
}

void check_settings(const EngineConfig& c) {
  const std::vector<SettingsProblem> problems = settings_problems(c);
  STRIDER_CHECK(problems.empty(), "{}", problems.empty() ? "" : problems.front().text);
}

}  // namespace strider
