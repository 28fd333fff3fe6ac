#include "engine/model/model_presets.h"

#include <algorithm>
#include <cctype>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "engine/model/builtin.h"
#include "host/error.h"

namespace strider {
namespace {

using nlohmann::json;

// The fields strider reads, as published in each model's config.json.
json llama(int64_t hidden, int64_t inter, int64_t layers, int64_t heads, int64_t kv, int64_t vocab) {
  return {{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", hidden}, {"intermediate_size", inter},
          {"num_hidden_layers", layers}, {"num_attention_heads", heads}, {"num_key_value_heads", kv},
          {"vocab_size", vocab}, {"max_position_embeddings", 131072}, {"rms_norm_eps", 1e-5},
          {"rope_theta", 500000.0},
          {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                            {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}}},
          {"tie_word_embeddings", false}};
}

json qwen25(int64_t hidden, int64_t inter, int64_t layers, int64_t heads, int64_t kv) {
  return {{"architectures", {"Qwen2ForCausalLM"}}, {"hidden_size", hidden}, {"intermediate_size", inter},
          {"num_hidden_layers", layers}, {"num_attention_heads", heads}, {"num_key_value_heads", kv},
          {"vocab_size", 152064}, {"max_position_embeddings", 32768}, {"rms_norm_eps", 1e-6},
          {"rope_theta", 1000000.0}, {"tie_word_embeddings", false}};
}

// Qwen3-MoE (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B): 128 experts, top 8
// renormalised, every layer sparse.
json qwen3_moe(int64_t hidden, int64_t inter, int64_t moe_inter, int64_t layers, int64_t heads, int64_t kv) {
  return {{"architectures", {"Qwen3MoeForCausalLM"}}, {"hidden_size", hidden}, {"intermediate_size", inter},
          {"moe_intermediate_size", moe_inter}, {"num_experts", 128}, {"num_experts_per_tok", 8},
          {"norm_topk_prob", true}, {"decoder_sparse_step", 1}, {"mlp_only_layers", json::array()},
          {"num_hidden_layers", layers}, {"num_attention_heads", heads}, {"num_key_value_heads", kv},
          {"head_dim", 128}, {"vocab_size", 151936}, {"max_position_embeddings", 40960}, {"rms_norm_eps", 1e-6},
          {"rope_theta", 1000000.0}, {"tie_word_embeddings", false}, {"output_router_logits", false},
          {"router_aux_loss_coef", 0.001}};
}

// Qwen/Qwen1.5-MoE-A2.7B (Qwen2MoeForCausalLM): 60 experts, top 4 not
// renormalised, a shared expert of 5632 beside them, every layer sparse.
json qwen15_moe() {
  return {{"architectures", {"Qwen2MoeForCausalLM"}}, {"hidden_size", 2048}, {"intermediate_size", 5632},
          {"moe_intermediate_size", 1408}, {"shared_expert_intermediate_size", 5632}, {"num_experts", 60},
          {"num_experts_per_tok", 4}, {"norm_topk_prob", false}, {"decoder_sparse_step", 1},
          {"mlp_only_layers", json::array()}, {"num_hidden_layers", 24}, {"num_attention_heads", 16},
          {"num_key_value_heads", 16}, {"vocab_size", 151936}, {"max_position_embeddings", 8192},
          {"rms_norm_eps", 1e-6}, {"rope_theta", 1000000.0}, {"tie_word_embeddings", false},
          {"use_sliding_window", false}, {"output_router_logits", false}, {"router_aux_loss_coef", 0.001}};
}

const std::vector<std::pair<std::string, json>>& presets() {
  static const std::vector<std::pair<std::string, json>> p = {
      {"builtin", builtin_model_config()},
      {"llama-3.1-8b", llama(4096, 14336, 32, 32, 8, 128256)},
      {"llama-3.1-70b", llama(8192, 28672, 80, 64, 8, 128256)},
      {"qwen2.5-14b", qwen25(5120, 13824, 48, 40, 8)},
      {"qwen2.5-32b", qwen25(5120, 27648, 64, 40, 8)},
      {"qwen2.5-72b", qwen25(8192, 29568, 80, 64, 8)},
      // Mistral-Large-Instruct-2407: the 123B dense shape.
      {"mistral-large-123b",
       {{"architectures", {"MistralForCausalLM"}}, {"hidden_size", 12288}, {"intermediate_size", 28672},
        {"num_hidden_layers", 88}, {"num_attention_heads", 96}, {"num_key_value_heads", 8}, {"head_dim", 128},
        {"vocab_size", 32768}, {"max_position_embeddings", 131072}, {"rms_norm_eps", 1e-5},
        {"rope_theta", 1000000.0}, {"sliding_window", nullptr}, {"tie_word_embeddings", false}}},
      {"qwen3-30b-a3b", qwen3_moe(2048, 6144, 768, 48, 32, 4)},
      {"qwen3-235b-a22b", qwen3_moe(4096, 12288, 1536, 94, 64, 4)},
      {"qwen1.5-moe-a2.7b", qwen15_moe()},
      // mistralai/Mixtral-8x7B-v0.1: 8 experts, top 2.
      {"mixtral-8x7b",
       {{"architectures", {"MixtralForCausalLM"}}, {"hidden_size", 4096}, {"intermediate_size", 14336},
        {"num_local_experts", 8}, {"num_experts_per_tok", 2}, {"num_hidden_layers", 32},
        {"num_attention_heads", 32}, {"num_key_value_heads", 8}, {"vocab_size", 32000},
        {"max_position_embeddings", 32768}, {"rms_norm_eps", 1e-5}, {"rope_theta", 1000000.0},
        {"sliding_window", nullptr}, {"tie_word_embeddings", false}, {"output_router_logits", false},
        {"router_aux_loss_coef", 0.02}, {"router_jitter_noise", 0.0}}},
  };
  return p;
}

}  // namespace

std::vector<std::string> model_preset_names() {
  std::vector<std::string> out;
  for (const auto& [name, _] : presets()) out.push_back(name);
  return out;
}

json model_preset(const std::string& name) {
  std::string lower = name;
  for (auto& c : lower) c = char(std::tolower(static_cast<unsigned char>(c)));
  for (const auto& [n, cfg] : presets())
    if (n == lower) return cfg;
  throw Error(fmt::format("no model preset '{}' (known: {}); or give a config.json or a checkpoint directory",
                          name, fmt::join(model_preset_names(), ", ")));
}

}  // namespace strider
