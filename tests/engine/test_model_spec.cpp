#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>

#include "engine/model/model_presets.h"
#include "engine/model/model_spec.h"
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

TEST_CASE("Granite reads its four multipliers, each range-checked, and elsewhere they are the identity",
          "[engine][spec]") {
  json g = qwen3_tiny();
  g.erase("head_dim");
  g["architectures"] = {"GraniteForCausalLM"};
  g.update({{"embedding_multiplier", 12.0}, {"attention_multiplier", 0.0078125}, {"residual_multiplier", 0.22},
            {"logits_scaling", 16.0}});
  const ModelSpec s = ModelSpec::from_json(g, "granite/config.json");
  CHECK(s.arch_name == "GraniteForCausalLM");
  CHECK(s.dims.embedding_multiplier == 12.0);
  CHECK(s.dims.attn_scale == 0.0078125);
  CHECK(s.dims.residual_multiplier == 0.22);
  CHECK(s.dims.logits_scaling == 16.0);
  CHECK_FALSE(s.dims.qk_norm);
  g["logits_scaling"] = 0;
  CHECK_THROWS_WITH(ModelSpec::from_json(g, "granite/config.json"),
                    Catch::Contains("granite/config.json") && Catch::Contains("'logits_scaling' = 0 is outside (0"));
  const ModelSpec q = ModelSpec::from_json(qwen3_tiny(), "qwen3/config.json");  // other architectures: the identity
  CHECK((q.dims.embedding_multiplier == 1.0 && q.dims.attn_scale == 0.0 && q.dims.residual_multiplier == 1.0 &&
         q.dims.logits_scaling == 1.0));
}

TEST_CASE("Phi-3 holds fused projections under its own names, reads longrope, and refuses what it cannot train",
          "[engine][spec]") {
  json p = qwen3_tiny();
  p.erase("head_dim");
  p["architectures"] = {"Phi3ForCausalLM"};
  p["tie_word_embeddings"] = false;
  const ModelSpec s = ModelSpec::from_json(p, "phi3/config.json");
  CHECK(s.dims.fused_projections);
  const ParamLayout l = s.layout(1);
  const int64_t q = s.dims.heads * s.dims.head_dim, kv = s.dims.kv_heads * s.dims.head_dim;
  CHECK(l.at("model.layers.0.self_attn.qkv_proj.weight").shape == std::vector<int64_t>{q + 2 * kv, s.dims.hidden});
  CHECK(l.at("model.layers.0.mlp.gate_up_proj.weight").shape ==
        std::vector<int64_t>{2 * s.dims.intermediate, s.dims.hidden});
  CHECK(l.find("model.layers.0.self_attn.q_proj.weight") == nullptr);
  CHECK_THROWS_WITH(s.with_lora("r=4,alpha=8,targets=all-linear", "--lora"),
                    Catch::Contains("fused projections (qkv_proj, gate_up_proj) is not supported"));
  // Phi-4-mini: a partial rotary factor and longrope, its factors one per rotated pair.
  p["max_position_embeddings"] = 131072;
  p["rope_parameters"] = {{"rope_theta", 10000.0}, {"rope_type", "longrope"}, {"partial_rotary_factor", 0.75},
                          {"original_max_position_embeddings", 4096},
                          {"short_factor", std::vector<double>(6, 1.0)}, {"long_factor", std::vector<double>(6, 2.0)}};
  const RopeDims r = ModelSpec::from_json(p, "phi3/config.json").dims.rope;
  CHECK(r.type == RopeType::kLongrope);
  CHECK(r.rotary_dim(16) == 12);
  CHECK(r.long_factor == std::vector<double>(6, 2.0));
  CHECK(r.attention_factor == Approx(std::sqrt(1 + std::log(32.0) / std::log(4096.0))));  // transformers' default
  p["rope_parameters"]["long_factor"] = std::vector<double>(8, 2.0);
  CHECK_THROWS_WITH(ModelSpec::from_json(p, "phi3/config.json"),
                    Catch::Contains("'rope_parameters.long_factor' must list 6 factors"));
  p["rope_parameters"] = {{"rope_theta", 10000.0}, {"rope_type", "default"}, {"partial_rotary_factor", 0.1}};
  CHECK_THROWS_WITH(ModelSpec::from_json(p, "phi3/config.json"),
                    Catch::Contains("rope_parameters.partial_rotary_factor 0.1 of head_dim 16 must leave an even"));
}

TEST_CASE("Gemma 3 reads its layer kinds and their RoPE, old and new config forms, and refuses soft-capping",
          "[engine][spec]") {
  json g = qwen3_tiny();
  g["architectures"] = {"Gemma3ForCausalLM"};
  g.erase("tie_word_embeddings");  // Gemma ties by default
  g.erase("rope_parameters");      // the older form: rope_theta and rope_local_base_freq
  g.update({{"sliding_window", 512}, {"num_hidden_layers", 7}, {"query_pre_attn_scalar", 256},
            {"rope_theta", 1000000.0}, {"rope_local_base_freq", 10000.0}, {"pad_token_id", 0}});
  const ModelSpec s = ModelSpec::from_json(g, "gemma3/config.json");
  CHECK(s.tie_embeddings);
  CHECK(s.dims.norm == NormKind::kGemma);
  CHECK(s.dims.norm_placement == NormPlacement::kSandwich);
  CHECK(s.dims.act == Activation::kGeluTanh);
  CHECK(s.dims.attn_scale == 1.0 / 16);
  CHECK(s.dims.embedding_multiplier == std::sqrt(double(s.dims.hidden)));
  CHECK(s.dims.pad_token == 0);
  // sliding_window_pattern 6 by default: layer 5 is global.
  CHECK(s.sliding_layers == std::vector<uint8_t>{1, 1, 1, 1, 1, 0, 1});
  CHECK(s.layer_dims(0).sliding_window == 512);
  CHECK(s.layer_dims(0).rope.theta == 10000.0);
  CHECK(s.layer_dims(5).sliding_window == 0);
  CHECK(s.layer_dims(5).rope.theta == 1000000.0);
  const ParamLayout l = s.layout(1);
  for (const char* t : {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                        "post_feedforward_layernorm"})
    CHECK(l.find(fmt::format("model.layers.0.{}.weight", t)) != nullptr);
  CHECK(l.at("model.layers.0.self_attn.q_norm.weight").shape == std::vector<int64_t>{s.dims.head_dim});
  // transformers >= 5: rope_parameters per layer kind, and layer_types.
  g.erase("rope_theta");
  g.erase("rope_local_base_freq");
  g["num_hidden_layers"] = 2;
  g["layer_types"] = {"full_attention", "sliding_attention"};
  g["rope_parameters"] = {{"full_attention", {{"rope_type", "linear"}, {"factor", 8.0}, {"rope_theta", 1e6}}},
                          {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 1e4}}}};
  const ModelSpec n = ModelSpec::from_json(g, "gemma3/config.json");
  CHECK(n.sliding_layers == std::vector<uint8_t>{0, 1});
  CHECK(n.layer_dims(0).rope.type == RopeType::kLinear);
  CHECK(n.layer_dims(0).rope.factor == 8.0);
  CHECK(n.layer_dims(1).rope.type == RopeType::kDefault);
  CHECK(n.layer_dims(1).rope.theta == 1e4);
  auto fails = [&](json j, const std::string& what) {
    CHECK_THROWS_WITH(ModelSpec::from_json(j, "gemma3/config.json"),
                      Catch::Contains("gemma3/config.json") && Catch::Contains(what));
  };
  json bad = g;
  bad["layer_types"] = {"full_attention"};
  fails(bad, "'layer_types' must list the 2 layers' types");
  bad = g;
  bad["attn_logit_softcapping"] = 50.0;
  fails(bad, "attn_logit_softcapping = 50.0: soft-capping is not supported for Gemma 3");
  bad = g;
  bad["final_logit_softcapping"] = 30.0;
  fails(bad, "final_logit_softcapping = 30.0: soft-capping is not supported");
  bad = g;
  bad["hidden_activation"] = "gelu";
  fails(bad, "hidden_activation 'gelu' is not supported");
  bad = g;
  bad["use_bidirectional_attention"] = true;
  fails(bad, "use_bidirectional_attention is not supported");
  bad = g;
  bad["pad_token_id"] = 5000;
  fails(bad, "'pad_token_id' = 5000 is outside");
}

TEST_CASE("Gemma 2 soft-caps by default and alternates sliding and global layers with one RoPE",
          "[engine][spec]") {
  json g = qwen3_tiny();
  g["architectures"] = {"Gemma2ForCausalLM"};
  g.update({{"num_hidden_layers", 4}, {"sliding_window", 4096}});
  // Neither field given: Gemma2Config's defaults (transformers reads such a file with them).
  const ModelSpec s = ModelSpec::from_json(g, "gemma2/config.json");
  CHECK(s.dims.attn_softcap == 50.0);
  CHECK(s.dims.final_softcap == 30.0);
  g.update({{"attn_logit_softcapping", 20.0}, {"final_logit_softcapping", 10.0}});
  CHECK(ModelSpec::from_json(g, "gemma2/config.json").dims.attn_softcap == 20.0);
  CHECK(ModelSpec::from_json(g, "gemma2/config.json").dims.final_softcap == 10.0);
  CHECK_FALSE(s.dims.qk_norm);
  CHECK(s.dims.norm == NormKind::kGemma);
  CHECK(s.sliding_layers == std::vector<uint8_t>{1, 0, 1, 0});  // every second layer global
  CHECK(s.layer_dims(0).rope.theta == s.layer_dims(1).rope.theta);
  CHECK(s.layout(1).find("model.layers.0.self_attn.q_norm.weight") == nullptr);
  g["attn_logit_softcapping"] = nullptr;  // null: none
  CHECK(ModelSpec::from_json(g, "gemma2/config.json").dims.attn_softcap == 0);
  g["final_logit_softcapping"] = -1.0;
  CHECK_THROWS_WITH(ModelSpec::from_json(g, "gemma2/config.json"),
                    Catch::Contains("'final_logit_softcapping' = -1.0 is outside (0"));
}

TEST_CASE("OLMo 2 has norms after its branches and q/k norms over whole projections", "[engine][spec]") {
  json o = qwen3_tiny();
  o.erase("head_dim");
  o["architectures"] = {"Olmo2ForCausalLM"};
  const ModelSpec s = ModelSpec::from_json(o, "olmo2/config.json");
  CHECK(s.dims.norm_placement == NormPlacement::kPost);
  CHECK(s.dims.norm == NormKind::kFp32Weight);
  const ParamLayout l = s.layout(1);
  const int64_t q = s.dims.heads * s.dims.head_dim, kv = s.dims.kv_heads * s.dims.head_dim;
  CHECK(l.find("model.layers.0.input_layernorm.weight") == nullptr);
  CHECK(l.find("model.layers.0.post_feedforward_layernorm.weight") != nullptr);
  CHECK(l.at("model.layers.0.self_attn.q_norm.weight").shape == std::vector<int64_t>{q});
  CHECK(l.at("model.layers.0.self_attn.k_norm.weight").shape == std::vector<int64_t>{kv});
  CHECK(s.sliding_layers.empty());
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
  fails(j, "field 'num_attention_heads' = 0 is outside [1, 65536]");
  j = llama31_8b();
  j["num_key_value_heads"] = 5;
  fails(j, "num_key_value_heads 5");
  j = llama31_8b();
  j["hidden_size"] = "4096";
  fails(j, "field 'hidden_size' must be an integer in [1, 1048576]");
  j = llama31_8b();
  j["rope_scaling"]["rope_type"] = "yarn";
  fails(j, "rope_type 'yarn'");
  j = llama31_8b();
  j["hidden_act"] = "gelu";
  fails(j, "hidden_act 'gelu'");
  CHECK_THROWS_WITH(ModelSpec::from_file("/nonexistent/dir"), Catch::Contains("/nonexistent/dir"));
}

TEST_CASE("every numeric field is range-checked, naming the field, the value and the range",
          "[engine][spec]") {
  auto fails = [](json j, const std::string& what) {
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(ModelSpec::from_json(j, "m/config.json"),
                      Catch::Contains("m/config.json") && Catch::Contains(what));
    // Refused before anything is sized by the value: at once, not after a loop.
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1));
  };
  auto with = [](const char* key, json value) {
    json j = llama31_8b();
    j[key] = std::move(value);
    return j;
  };
  fails(with("num_hidden_layers", int64_t{1'000'000'000'000}),
        "field 'num_hidden_layers' = 1000000000000 is outside [1, 100000]");
  fails(with("num_hidden_layers", int64_t{100'000'000}), "field 'num_hidden_layers' = 100000000 is outside [1, 100000]");
  fails(with("num_hidden_layers", -3), "field 'num_hidden_layers' = -3 is outside [1, 100000]");
  // JSON's 1e12 is a floating-point number: refused as one, with the range.
  fails(json::parse(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
                        "num_hidden_layers": 1e12, "num_attention_heads": 4, "vocab_size": 100})"),
        "field 'num_hidden_layers' = 1000000000000.0 is a floating-point number; it must be an integer in [1, 100000]");
  fails(with("num_hidden_layers", 32.0), "field 'num_hidden_layers' = 32.0 is a floating-point number");
  // Past int64: get<int64_t>() would wrap it to -1.
  fails(with("vocab_size", std::numeric_limits<uint64_t>::max()),
        "field 'vocab_size' = 18446744073709551615 is outside [1, 16777216]");
  fails(with("hidden_size", (int64_t{1} << 20) + 1), "field 'hidden_size' = 1048577 is outside [1, 1048576]");
  fails(with("num_key_value_heads", 0), "field 'num_key_value_heads' = 0 is outside [1, 65536]");
  // As parsed from text, 0 is an unsigned number: the same bound holds.
  fails(with("num_key_value_heads", json::parse("0")), "field 'num_key_value_heads' = 0 is outside [1, 65536]");
  fails(with("head_dim", 0), "field 'head_dim' = 0 is outside [2, 1048576]");
  fails(with("intermediate_size", int64_t{1} << 23), "field 'intermediate_size' = 8388608 is outside [1, 4194304]");
  fails(with("max_position_embeddings", int64_t{1} << 31),
        "field 'max_position_embeddings' = 2147483648 is outside [1, 1073741824]");
  fails(with("rms_norm_eps", 0), "field 'rms_norm_eps' = 0 is outside (0, 1]");
  fails(with("rms_norm_eps", 2.5), "field 'rms_norm_eps' = 2.5 is outside (0, 1]");
  fails(with("rope_theta", -1.0), "field 'rope_theta' = -1.0 is outside (0, 1000000000000]");
  json j = llama31_8b();
  j["rope_scaling"]["factor"] = 1e9;
  fails(j, "field 'rope_scaling.factor' = 1000000000.0 is outside (0, 1000000]");
  j = llama31_8b();
  j["rope_scaling"]["original_max_position_embeddings"] = 0;
  fails(j, "field 'rope_scaling.original_max_position_embeddings' = 0 is outside [1, 1073741824]");
  j = llama31_8b();
  j["architectures"] = {"MistralForCausalLM"};
  j["sliding_window"] = 0;
  fails(j, "field 'sliding_window' = 0 is outside [1, 1073741824]");
  // Each field within its range, the product past any machine: refused by the count.
  j = llama31_8b();
  j["num_hidden_layers"] = 100000;
  j["hidden_size"] = 1 << 20;
  j["intermediate_size"] = 1 << 22;
  fails(j, "past the 1e+14 strider accepts");
}

TEST_CASE("the bounds refuse no published shape", "[engine][spec]") {
  for (const std::string& name : model_preset_names()) {
    INFO(name);
    CHECK_NOTHROW(ModelSpec::from_json(model_preset(name), name));
  }
  // Llama 3.1 405B: the largest dense shape published.
  json j = llama31_8b();
  j["hidden_size"] = 16384;
  j["intermediate_size"] = 53248;
  j["num_hidden_layers"] = 126;
  j["num_attention_heads"] = 128;
  ModelSpec s = ModelSpec::from_json(j, "405b/config.json");
  CHECK(s.param_count() == 405'853'388'800);
}

TEST_CASE("a spec built in code is held to the same bounds, in constant time", "[engine][spec]") {
  ModelSpec s = ModelSpec::from_json(llama31_8b(), "config.json");
  CHECK_NOTHROW(s.check_size("x"));
  s.layers = 1'000'000'000'000;
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(s.check_size("built"), Catch::Contains("built: field 'num_hidden_layers' = 1000000000000 "
                                                           "is outside [1, 100000]"));
  CHECK_THROWS_WITH(s.param_count(), Catch::Contains("num_hidden_layers"));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1));
  s.layers = 32;
  s.dims.vocab = int64_t{1} << 40;
  CHECK_THROWS_WITH(s.check_size("built"), Catch::Contains("field 'vocab_size' = 1099511627776"));
}

TEST_CASE("block costs refuse byte counts that would wrap", "[engine][spec]") {
  ModelSpec s = ModelSpec::from_json(llama31_8b(), "config.json");
  CHECK_NOTHROW(s.cost(1, 1, 131072, 8192, 2));
  // 2^31 sequences of 2^20 tokens: past 2^40 tokens.
  CHECK_THROWS_WITH(s.cost(1, int64_t{1} << 31, int64_t{1} << 20, 8192, 2), Catch::Contains("2^40 tokens"));
  // A layer's working memory grows with tokens x intermediate (no seq^2
  // scores): 2^40 tokens of the largest intermediate a config may give.
  s.dims.intermediate = int64_t{1} << 22;
  CHECK_THROWS_WITH(s.cost(1, 1, int64_t{1} << 40, 8192, 2),
                    Catch::Contains("layer.0: its forward working memory") && Catch::Contains("past 2^62"));
  // A token tile bounds the MLP's share; attention's O(tokens x hidden) remains.
  CHECK_NOTHROW(s.cost(1, 1, int64_t{1} << 36, 8192, 2, 4096));
  CHECK_THROWS_WITH(s.cost(1, 1, 1024, 8192, 2, -1), Catch::Contains("token tile -1"));
}

TEST_CASE("weight decay spares norms and biases by name, as transformers' Trainer does", "[engine][spec]") {
  for (const char* name : {"model.embed_tokens.weight", "lm_head.weight", "model.layers.3.self_attn.q_proj.weight",
                           "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"})
    CHECK(weight_decays(name));
  for (const char* name : {"model.norm.weight", "model.layers.3.input_layernorm.weight",
                           "model.layers.3.post_attention_layernorm.weight", "model.layers.0.self_attn.q_norm.weight",
                           "model.layers.0.self_attn.k_norm.weight", "model.layers.0.self_attn.q_proj.bias",
                           "model.layers.0.pre_feedforward_layernorm.weight", "model.layers.0.RMSNorm.weight"})
    CHECK_FALSE(weight_decays(name));
  CHECK(weight_decays("model.normalizer.weight"));  // "norm" only as a whole component or a "_norm" suffix

  // A Qwen2 layer (biases) cut into runs: the norm, the projections with their
  // biases between them, the second norm, the MLP.
  json q2 = qwen3_tiny();
  q2["architectures"] = {"Qwen2ForCausalLM"};
  const ParamLayout l = ModelSpec::from_json(q2, "x").layout(1);
  for (const TensorSlot& s : l.slots()) CHECK(s.decay == weight_decays(s.name));
  const auto runs = l.decay_runs(0, l.total_elems());
  std::vector<bool> kinds;
  for (const DecayRun& r : runs) kinds.push_back(r.decay);
  CHECK(kinds == std::vector<bool>{false, true, false, true, false, true, false, true, false, true});
  CHECK(runs.front().begin == 0);
  CHECK(runs.back().end == l.total_elems());
  for (size_t i = 1; i < runs.size(); ++i) {
    CHECK(runs[i].begin == runs[i - 1].end);
    CHECK(runs[i].begin % ParamLayout::kAlignElems == 0);
  }
  // A range inside one tensor is one run; a range across a cut is cut there.
  const TensorSlot& q = l.at("model.layers.0.self_attn.q_proj.weight");
  const TensorSlot& qb = l.at("model.layers.0.self_attn.q_proj.bias");
  CHECK(l.decay_runs(q.offset_elems + 5, q.offset_elems + 9).size() == 1);
  const auto cut = l.decay_runs(q.offset_elems + 5, qb.offset_elems + 3);
  REQUIRE(cut.size() == 2);
  CHECK((cut[0].begin == q.offset_elems + 5 && cut[0].end == qb.offset_elems && cut[0].decay));
  CHECK((cut[1].begin == qb.offset_elems && cut[1].end == qb.offset_elems + 3 && !cut[1].decay));
}

TEST_CASE("attention FLOPs count the query-key pairs the kernel computes", "[engine][spec]") {
  // 4 heads of 16: 2 matmuls x 2 FLOPs x 64 features a pair.
  nlohmann::json j = {{"architectures", {"MistralForCausalLM"}}, {"hidden_size", 64}, {"intermediate_size", 96},
                      {"num_hidden_layers", 1}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                      {"vocab_size", 100}, {"max_position_embeddings", 4096}, {"sliding_window", 256}};
  const double per_pair = 4.0 * 64;
  const ModelSpec window = ModelSpec::from_json(j, "mistral");
  CHECK(window.attention_flops(0, 2, 256) == 2 * per_pair * 256.0 * 256 / 2);    // the window covers it: causal
  CHECK(window.attention_flops(0, 2, 1024) == 2 * per_pair * 1024.0 * 1024);     // a mask: every block
  CHECK(window.attention_flops(0, 2, 256, true) == 2 * per_pair * 256.0 * 256);  // packed documents: a mask too
  // In query tiles (token tile 512 at b 2: 256 positions a tile), each tile
  // by the keys it reads: the window's 255 before its first query, and its own.
  REQUIRE(attention_query_tile(window.layer_dims(0), 2, 1024, 512) == 256);
  CHECK(window.attention_flops(0, 2, 1024, false, 512) == 2 * per_pair * (256.0 * 256 + 3 * 256.0 * (255 + 256)));
  // Packed documents in tiles of 64 positions (token tile 128), the window
  // covering the sequence: every key up to each tile's last query.
  CHECK(window.attention_flops(0, 2, 256, true, 128) == 2 * per_pair * 64.0 * (64 + 128 + 192 + 256));
  // Causal alone, tiled or not: half the square.
  CHECK(window.attention_flops(0, 2, 256, false, 128) == 2 * per_pair * 256.0 * 256 / 2);
  // Soft-capped tiles (Gemma 2): 512 queries a tile at b 2, 4 heads, seq 1024 (softcap_query_tile's
  // 2^22 / (b h s)); each tile reads the keys up to its last query (the window, 4096, covers the sequence).
  j["architectures"] = {"Gemma2ForCausalLM"};
  j.update({{"head_dim", 16}, {"attn_logit_softcapping", 50.0}, {"sliding_window", 4096}});
  const ModelSpec capped = ModelSpec::from_json(j, "gemma2");
  REQUIRE(softcap_query_tile(2, 4, 1024) == 512);
  CHECK(capped.attention_flops(0, 2, 1024) == 2 * per_pair * (512.0 * 512 + 512.0 * 1024));
  CHECK(capped.cost(1, 2, 1024, 64, 2).forward_flops > capped.attention_flops(0, 2, 1024));
}

TEST_CASE("RoPE from rope_scaling and rope_parameters together: rope_scaling first, as transformers reads them",
          "[engine][spec]") {
  // What transformers (the pinned 5.23) makes of each config's RoPE:
  // tests/python/test_rope_config.py checks these against AutoConfig.
  struct Case {
    json extra;
    RopeType type;
    double factor, theta;
  };
  const json linear4 = {{"rope_type", "linear"}, {"factor", 4.0}};
  const std::vector<Case> cases = {
      {{{"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 500000.0}}}, {"rope_theta", 20000.0}},
       RopeType::kDefault, 1.0, 500000.0},
      {{{"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 500000.0}}}, {"rope_scaling", linear4}},
       RopeType::kLinear, 4.0, 10000.0},
      {{{"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 500000.0}}}, {"rope_scaling", linear4},
        {"rope_theta", 20000.0}},
       RopeType::kLinear, 4.0, 20000.0},
      {{{"rope_parameters", {{"rope_type", "linear"}, {"factor", 2.0}, {"rope_theta", 500000.0}}},
        {"rope_scaling", nullptr}},
       RopeType::kLinear, 2.0, 500000.0},
      {{{"rope_scaling", {{"rope_type", "linear"}, {"factor", 4.0}, {"rope_theta", 30000.0}}}},
       RopeType::kLinear, 4.0, 30000.0},
  };
  for (const Case& c : cases) {
    json j = {{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 64},         {"intermediate_size", 128},
              {"num_hidden_layers", 2},              {"num_attention_heads", 4}, {"num_key_value_heads", 2},
              {"vocab_size", 100}};
    j.update(c.extra);
    INFO(c.extra.dump());
    const ModelSpec s = ModelSpec::from_json(j, "config.json");
    CHECK(s.dims.rope.type == c.type);
    CHECK(s.dims.rope.factor == c.factor);
    CHECK(s.dims.rope.theta == c.theta);
  }
}
