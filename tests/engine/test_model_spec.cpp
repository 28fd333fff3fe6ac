#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "engine/model_spec.h"
#include "host/error.h"

using namespace strider;
using nlohmann::json;

namespace {

// Llama-3.1-8B's config.json as published (the fields strider reads).
json llama31_8b() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": false, "vocab_size": 128256})");
}

json qwen3_tiny() {
  return json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "vocab_size": 1000, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": true, "sliding_window": null, "use_sliding_window": false})");
}

}  // namespace

TEST_CASE("Llama 3.1 8B parses with its llama3 rope scaling and 8.03B parameters", "[engine][spec]") {
  ModelSpec s = ModelSpec::from_json(llama31_8b(), "config.json");
  CHECK(s.arch == Arch::kLlama);
  CHECK(s.num_blocks() == 34);
  CHECK(s.dims.head_dim == 128);
  CHECK(s.dims.rope.type == RopeType::kLlama3);
  CHECK(s.dims.rope.theta == 500000.0);
  CHECK(s.dims.rope.original_max_position == 8192);
  CHECK(s.param_count() == 8'030'261'248);  // the published count
  CHECK(s.block_name(5) == "layer.4");
  ParamLayout l = s.layout(1);
  CHECK(l.at("model.layers.0.self_attn.k_proj.weight").shape == std::vector<int64_t>{1024, 4096});
  CHECK(l.find("model.layers.0.self_attn.q_proj.bias") == nullptr);
  BlockCost c = s.cost(1, 1, 1024, 8192, 2);
  // ~2 * params_of_layer * tokens, plus attention.
  CHECK(c.forward_flops > 2.0 * 218'112'000 * 1024);
  CHECK(c.backward_flops == Approx(2 * c.forward_flops));
}

TEST_CASE("Qwen3 gets q/k norms, an explicit head_dim and a tied head", "[engine][spec]") {
  ModelSpec s = ModelSpec::from_json(qwen3_tiny(), "qwen3/config.json");
  CHECK(s.dims.qk_norm);
  CHECK(s.dims.head_dim == 24);
  CHECK(s.tie_embeddings);
  CHECK(s.dims.rope.theta == 1000000.0);
  CHECK(s.layout(1).at("model.layers.0.self_attn.q_proj.weight").shape == std::vector<int64_t>{96, 64});
  CHECK(s.layout(1).find("model.layers.0.self_attn.q_norm.weight") != nullptr);
  CHECK(s.layout(3).find("lm_head.weight") == nullptr);  // tied: the head reads the embedding
  json q2 = qwen3_tiny();
  q2["architectures"] = {"Qwen2ForCausalLM"};
  CHECK(ModelSpec::from_json(q2, "x").dims.qkv_bias);
}

TEST_CASE("bad configs fail naming the file and the field", "[engine][spec]") {
  auto fails = [](json j, const std::string& what) {
    CHECK_THROWS_WITH(ModelSpec::from_json(j, "m/config.json"),
                      Catch::Contains("m/config.json") && Catch::Contains(what));
  };
  json j = llama31_8b();
  j["architectures"] = {"GPT2LMHeadModel"};
  fails(j, "GPT2LMHeadModel");
  j = llama31_8b();
  j.erase("hidden_size");
  fails(j, "'hidden_size'");
  j = llama31_8b();
  j["num_attention_heads"] = 0;
  fails(j, "'num_attention_heads' must be > 0");
  j = llama31_8b();
  j["num_key_value_heads"] = 5;
  fails(j, "num_key_value_heads 5");
  j = llama31_8b();
  j["hidden_size"] = "4096";
  fails(j, "'hidden_size' must be an integer");
  j = llama31_8b();
  j["rope_scaling"]["rope_type"] = "yarn";
  fails(j, "rope_type 'yarn'");
  j = llama31_8b();
  j["hidden_act"] = "gelu";
  fails(j, "hidden_act 'gelu'");
  CHECK_THROWS_WITH(ModelSpec::from_file("/nonexistent/dir"), Catch::Contains("/nonexistent/dir"));
}
