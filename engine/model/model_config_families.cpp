// The config.json fields of the families whose layers differ most from
// Llama's: Gemma 2 and 3, and the mixtures of experts (Qwen3-MoE, Mixtral).
#include <algorithm>
#include <cmath>

#include "engine/model/model_config_reader.h"

namespace strider::config_json {

// Gemma 2 and Gemma 3's text model (transformers' modeling_gemma2,
// modeling_gemma3): Gemma's norms and GELU-tanh MLP, its embedding scale and
// query_pre_attn_scalar, sliding and global layers; Gemma 2's soft-capping
// (of the attention scores and of the logits); Gemma 3's q/k norms and a RoPE
// per layer kind.
void parse_gemma(const Reader& r, ModelSpec& s) {
  const bool gemma2 = s.arch == Arch::kGemma2;
  BlockDims& d = s.dims;
  const std::string act = r.string_or("hidden_activation", r.string_or("hidden_act", "gelu_pytorch_tanh"));
  STRIDER_CHECK(act == "gelu_pytorch_tanh", "{}: hidden_activation '{}' is not supported (gelu_pytorch_tanh)",
                r.source, act);
  d.act = Activation::kGeluTanh;
  d.norm = NormKind::kGemma;
  d.norm_placement = NormPlacement::kSandwich;
  d.qk_norm = !gemma2;
  d.qkv_bias = d.o_bias = r.boolean_or("attention_bias", false);
  d.embedding_multiplier = std::sqrt(double(d.hidden));
  d.embedding_multiplier_in_dtype = true;
  d.attn_scale = 1.0 / std::sqrt(r.number_or("query_pre_attn_scalar", 256.0, kMultiplierRange));
  s.tie_embeddings = r.boolean_or("tie_word_embeddings", true);
  if (gemma2) {
    // Absent: Gemma2Config's defaults, 50 and 30, as transformers reads the
    // file; null: no soft-capping.
    auto cap = [&](const char* key, double absent) {
      return r.j.contains(key) ? r.number_or(key, 0, kMultiplierRange) : absent;
    };
    d.attn_softcap = cap("attn_logit_softcapping", 50.0);
    d.final_softcap = cap("final_logit_softcapping", 30.0);
  } else {
    for (const char* cap : {"final_logit_softcapping", "attn_logit_softcapping"})
      if (const json* v = r.find(cap))
        throw Error(fmt::format("{}: {} = {}: soft-capping is not supported for Gemma 3 (null)", r.source, cap,
                                v->dump()));
  }
  STRIDER_CHECK(!r.boolean_or("use_bidirectional_attention", false),
                "{}: use_bidirectional_attention is not supported (causal attention only)", r.source);
  d.sliding_window = r.integer_or("sliding_window", 4096, kPositionsRange);
  // The layers' kinds: layer_types, or every sliding_window_pattern-th layer global.
  s.sliding_layers.assign(size_t(s.layers), 1);
  if (const json* types = r.find("layer_types")) {
    STRIDER_CHECK(types->is_array() && types->size() == size_t(s.layers),
                  "{}: field 'layer_types' must list the {} layers' types", r.source, s.layers);
    for (size_t l = 0; l < types->size(); ++l) {
      const json& t = (*types)[l];
      STRIDER_CHECK(t == "sliding_attention" || t == "full_attention",
                    "{}: layer_types[{}] = {} is not supported (sliding_attention, full_attention)", r.source, l,
                    t.dump());
      s.sliding_layers[l] = t == "sliding_attention";
    }
  } else {
    const int64_t pattern = r.integer_or("sliding_window_pattern", gemma2 ? 2 : 6, kLayersRange);
    for (int64_t l = 0; l < s.layers; ++l) s.sliding_layers[size_t(l)] = (l + 1) % pattern != 0;
  }
  // RoPE per layer kind under rope_parameters (transformers >= 5); else
  // rope_theta and rope_scaling for the global layers and
  // rope_local_base_freq for the sliding ones.
  const json* params = r.find("rope_parameters");
  if (gemma2) {  // one RoPE for both kinds
    d.rope = parse_rope(r, d.head_dim);
    s.local_rope = d.rope;
  } else if (params && params->is_object() &&
             (params->contains("full_attention") || params->contains("sliding_attention"))) {
    auto kind = [&](const char* key, double theta) {
      RopeDims rope;
      rope.theta = theta;
      const auto it = params->find(key);
      if (it == params->end() || it->is_null()) return rope;
      STRIDER_CHECK(it->is_object(), "{}: field 'rope_parameters.{}' must be an object", r.source, key);
      const std::string prefix = fmt::format("rope_parameters.{}.", key);
      const Reader pr{*it, r.source, prefix};
      rope.theta = pr.number_or("rope_theta", theta, kRopeThetaRange);
      return parse_rope_params(pr, rope, r, d.head_dim);
    };
    d.rope = kind("full_attention", 1e6);
    s.local_rope = kind("sliding_attention", 1e4);
  } else {
    d.rope = parse_rope(r, d.head_dim, 1e6);
    s.local_rope.theta = r.number_or("rope_local_base_freq", 1e4, kRopeThetaRange);
  }
}

constexpr IntRange kExpertsRange{1, 1 << 16};

// Qwen3-MoE, Qwen2-MoE and Mixtral (transformers' modeling_qwen3_moe,
// modeling_qwen2_moe, modeling_mixtral): the attention of Qwen3 (q/k norms),
// Qwen2 (q/k/v biases) or Mistral, and an MLP of experts behind a top-k
// router (gpu/blocks/block_dims.h, MoeDims), with Qwen2-MoE's shared expert beside
// them. The Qwens' layers in mlp_only_layers, and those off their
// decoder_sparse_step, keep a dense MLP of intermediate_size. The
// load-balancing loss counts where the config asks transformers for it
// (output_router_logits).
void parse_moe(const Reader& r, ModelSpec& s) {
  BlockDims& d = s.dims;
  MoeDims& e = d.moe;
  const bool qwen = s.arch == Arch::kQwen3Moe || s.arch == Arch::kQwen2Moe;
  // transformers >= 5 writes Qwen3-MoE's num_experts as num_local_experts.
  const char* experts_key = qwen && r.find("num_experts") ? "num_experts" : "num_local_experts";
  e.experts = r.integer(experts_key, kExpertsRange);
  e.top_k = r.integer("num_experts_per_tok", kExpertsRange);
  STRIDER_CHECK(e.top_k <= e.experts, "{}: num_experts_per_tok {} is more than the {} experts ({})", r.source, e.top_k,
                e.experts, experts_key);
  e.intermediate = qwen ? r.integer("moe_intermediate_size", kIntermediateRange) : d.intermediate;
  e.norm_topk = qwen ? r.boolean_or("norm_topk_prob", false) : true;
  e.scores_fp32 = !qwen;
  if (s.arch == Arch::kQwen2Moe) {
    d.qkv_bias = r.boolean_or("qkv_bias", true);  // Qwen2's q/k/v biases; o_proj has none
    e.shared_intermediate = r.integer("shared_expert_intermediate_size", kIntermediateRange);
  } else if (qwen) {
    d.qkv_bias = d.o_bias = r.boolean_or("attention_bias", false);
    d.qk_norm = true;
  }
  if (qwen) {
    const int64_t step = r.integer_or("decoder_sparse_step", 1, kLayersRange);
    s.dense_layers.assign(size_t(s.layers), 0);
    for (int64_t l = 0; l < s.layers; ++l) s.dense_layers[size_t(l)] = (l + 1) % step != 0;
    if (const json* only = r.find("mlp_only_layers")) {
      STRIDER_CHECK(only->is_array(), "{}: field 'mlp_only_layers' must list layer indices", r.source);
      for (const json& l : *only) {
        STRIDER_CHECK(l.is_number_integer() && l.get<int64_t>() >= 0 && l.get<int64_t>() < s.layers,
                      "{}: mlp_only_layers holds {}, not a layer index in [0, {})", r.source, l.dump(), s.layers);
        s.dense_layers[size_t(l.get<int64_t>())] = 1;
      }
    }
    if (std::all_of(s.dense_layers.begin(), s.dense_layers.end(), [](uint8_t x) { return x == 0; }))
      s.dense_layers.clear();
  } else {
    const double jitter = r.number_or("router_jitter_noise", 0.0, RealRange{0, 1, false});
    STRIDER_CHECK(jitter == 0, "{}: router_jitter_noise = {}: the router's random jitter cannot be reproduced, "
                  "so strider trains Mixtral without it (set it to 0)", r.source, jitter);
  }
  if (r.boolean_or("output_router_logits", false))
    s.router_aux_coef = r.number_or("router_aux_loss_coef", 0.001, RealRange{0, 1e6, false});
}

}  // namespace strider::config_json
