#include "engine/engine_config_json.h"

#include <algorithm>
#include <nlohmann/json.hpp>

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
          {"dtype", c.compute.dtype == at::kFloat ? "fp32" : "bf16"},
          {"vocab_chunk", c.compute.vocab_chunk},
          {"token_tile", c.compute.token_tile},
          {"vocab_shard_rows", c.vocab_shard_rows},
          {"grad_transfer", c.fp32_grad_transfer ? "fp32" : "bf16"},
          {"window", c.window},
          {"checkpoints_on_host", c.checkpoints_on_host},
          {"lr", c.adam.lr},
          {"beta1", c.adam.beta1},
          {"beta2", c.adam.beta2},
          {"eps", c.adam.eps},
          {"weight_decay", c.adam.weight_decay},
          {"optimizer", c.adam.mode == AdamMode::kAdamW ? "adamw" : "adam"},
          {"schedule", shape_name(c.schedule.shape)},
          {"warmup_steps", c.schedule.warmup_steps},
          {"total_steps", c.schedule.total_steps},
          {"clip_norm", c.clip_norm},
          {"optimizer_state", std::string(state_format_name(c.optimizer_state))},
          {"optimizer_threads", c.optimizer_threads},
          {"nvme_dir", c.nvme_dir},
          {"nvme_blocks", c.nvme_blocks},
          {"grad_ring", c.grad_ring},
          {"saved_blocks", c.saved_blocks},
          {"keep_logits", c.keep_logits}};
}

EngineConfig engine_config_from_json(const nlohmann::json& j) {
  STRIDER_CHECK(j.is_object(), "engine config: expected a JSON object, got {}", j.dump());
  EngineConfig c;
  const nlohmann::json known = engine_config_to_json(c);
  for (const auto& [key, value] : j.items()) {
    STRIDER_CHECK(known.contains(key), "engine config: unknown field '{}'", key);
    STRIDER_CHECK(value.type() == known[key].type() ||
                      (value.is_number() && known[key].is_number()) || key == "nvme_blocks",
                  "engine config: field '{}' has the wrong type ({})", key, value.dump());
  }
  auto get = [&](const char* key, auto& out) {
    if (j.contains(key)) out = j[key].get<std::decay_t<decltype(out)>>();
  };
  get("seq", c.seq);
  get("micro_batch", c.micro_batch);
  get("accumulation", c.accumulation);
  if (j.contains("dtype")) {
    const std::string d = j["dtype"];
    STRIDER_CHECK(d == "fp32" || d == "bf16", "engine config: dtype '{}' is not fp32 or bf16", d);
    c.compute.dtype = d == "fp32" ? at::kFloat : at::kBFloat16;
  }
  get("vocab_chunk", c.compute.vocab_chunk);
  get("token_tile", c.compute.token_tile);
  get("vocab_shard_rows", c.vocab_shard_rows);
  if (j.contains("grad_transfer")) {
    const std::string g = j["grad_transfer"];
    STRIDER_CHECK(g == "fp32" || g == "bf16", "engine config: grad_transfer '{}' is not bf16 or fp32", g);
    c.fp32_grad_transfer = g == "fp32";
  }
  get("window", c.window);
  get("checkpoints_on_host", c.checkpoints_on_host);
  get("lr", c.adam.lr);
  get("beta1", c.adam.beta1);
  get("beta2", c.adam.beta2);
  get("eps", c.adam.eps);
  get("weight_decay", c.adam.weight_decay);
  if (j.contains("optimizer")) {
    const std::string o = j["optimizer"];
    STRIDER_CHECK(o == "adamw" || o == "adam", "engine config: optimizer '{}' is not adamw or adam", o);
    c.adam.mode = o == "adamw" ? AdamMode::kAdamW : AdamMode::kAdam;
  }
  if (j.contains("schedule")) c.schedule.shape = LrSchedule::parse_shape(j["schedule"]);
  get("warmup_steps", c.schedule.warmup_steps);
  get("total_steps", c.schedule.total_steps);
  get("clip_norm", c.clip_norm);
  if (j.contains("optimizer_state")) c.optimizer_state = parse_state_format(j["optimizer_state"].get<std::string>());
  get("optimizer_threads", c.optimizer_threads);
  get("nvme_dir", c.nvme_dir);
  get("nvme_blocks", c.nvme_blocks);
  get("grad_ring", c.grad_ring);
  get("keep_logits", c.keep_logits);
  // Decoder-layer blocks are 1..layers: the upper bound needs the model,
  // which whoever builds the Engine checks (the Engine does too).
  if (j.contains("saved_blocks")) {
    for (const auto& b : j["saved_blocks"])
      STRIDER_CHECK(b.is_number_integer() && b.get<int64_t>() >= 1, "engine config: saved_blocks holds {}: each "
                    "must be a decoder-layer block index >= 1 (block 0 is the embedding)", b.dump());
    c.saved_blocks = j["saved_blocks"].get<std::vector<int64_t>>();
    std::vector<int64_t> sorted = c.saved_blocks;
    std::sort(sorted.begin(), sorted.end());
    STRIDER_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                  "engine config: saved_blocks lists a block twice ({})", j["saved_blocks"].dump());
  }
  return c;
}

}  // namespace strider
