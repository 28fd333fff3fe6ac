#include "engine/model_spec.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "host/error.h"

namespace strider {
namespace {

using nlohmann::json;

// Field readers that name the file and the field in every error.
struct Reader {
  const json& j;
  std::string_view source;

  const json* find(std::string_view key) const {
    auto it = j.find(key);
    return (it == j.end() || it->is_null()) ? nullptr : &*it;
  }
  int64_t integer(std::string_view key) const {
    const json* v = find(key);
    STRIDER_CHECK(v != nullptr, "{}: missing field '{}'", source, key);
    STRIDER_CHECK(v->is_number_integer(), "{}: field '{}' must be an integer, got {}", source, key, v->dump());
    return v->get<int64_t>();
  }
  int64_t positive(std::string_view key) const {
    int64_t x = integer(key);
    STRIDER_CHECK(x > 0, "{}: field '{}' must be > 0, got {}", source, key, x);
    return x;
  }
  int64_t positive_or(std::string_view key, int64_t dflt) const {
    return find(key) ? positive(key) : dflt;
  }
  double number_or(std::string_view key, double dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    STRIDER_CHECK(v->is_number(), "{}: field '{}' must be a number, got {}", source, key, v->dump());
    return v->get<double>();
  }
  bool boolean_or(std::string_view key, bool dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    STRIDER_CHECK(v->is_boolean(), "{}: field '{}' must be true or false, got {}", source, key, v->dump());
    return v->get<bool>();
  }
  std::string string_or(std::string_view key, std::string dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    STRIDER_CHECK(v->is_string(), "{}: field '{}' must be a string, got {}", source, key, v->dump());
    return v->get<std::string>();
  }
};

struct ArchInfo { Arch arch; std::string_view name, model_type; };
constexpr ArchInfo kArchs[] = {
    {Arch::kLlama, "LlamaForCausalLM", "llama"},
    {Arch::kQwen2, "Qwen2ForCausalLM", "qwen2"},
    {Arch::kQwen3, "Qwen3ForCausalLM", "qwen3"},
    {Arch::kMistral, "MistralForCausalLM", "mistral"},
};

const ArchInfo& arch_of(const Reader& r) {
  std::string name;
  if (const json* a = r.find("architectures")) {
    STRIDER_CHECK(a->is_array() && a->size() == 1 && (*a)[0].is_string(),
                  "{}: field 'architectures' must hold one name, got {}", r.source, a->dump());
    name = (*a)[0].get<std::string>();
    for (const auto& i : kArchs)
      if (i.name == name) return i;
  } else {
    std::string mt = r.string_or("model_type", "");
    for (const auto& i : kArchs)
      if (i.model_type == mt) return i;
    name = "model_type '" + mt + "'";
  }
  throw Error(fmt::format("{}: architecture {} is not supported; strider supports LlamaForCausalLM, "
                          "Qwen2ForCausalLM, Qwen3ForCausalLM and MistralForCausalLM",
                          r.source, name));
}

// rope_parameters (transformers >= 5) or rope_theta + rope_scaling (older files).
RopeDims parse_rope(const Reader& r) {
  RopeDims rope;
  const json* params = r.find("rope_parameters");
  const json* scaling = r.find("rope_scaling");
  rope.theta = r.number_or("rope_theta", 10000.0);
  const json* p = params ? params : scaling;
  if (p == nullptr) return rope;
  STRIDER_CHECK(p->is_object(), "{}: field '{}' must be an object", r.source,
                params ? "rope_parameters" : "rope_scaling");
  Reader pr{*p, r.source};
  if (params) rope.theta = pr.number_or("rope_theta", rope.theta);
  std::string type = pr.string_or("rope_type", pr.string_or("type", "default"));
  if (type == "default") {
    rope.type = RopeType::kDefault;
  } else if (type == "llama3") {
    rope.type = RopeType::kLlama3;
    rope.factor = pr.number_or("factor", 8.0);
    rope.low_freq_factor = pr.number_or("low_freq_factor", 1.0);
    rope.high_freq_factor = pr.number_or("high_freq_factor", 4.0);
    rope.original_max_position = pr.positive_or("original_max_position_embeddings", 8192);
    STRIDER_CHECK(rope.high_freq_factor > rope.low_freq_factor,
                  "{}: rope high_freq_factor {} must exceed low_freq_factor {}", r.source,
                  rope.high_freq_factor, rope.low_freq_factor);
  } else if (type == "linear") {
    rope.type = RopeType::kLinear;
    rope.factor = pr.number_or("factor", 1.0);
  } else {
    throw Error(fmt::format("{}: rope_type '{}' is not supported (default, llama3, linear)", r.source, type));
  }
  STRIDER_CHECK(rope.theta > 0 && rope.factor > 0, "{}: rope theta {} and factor {} must be > 0",
                r.source, rope.theta, rope.factor);
  return rope;
}

}  // namespace

ModelSpec ModelSpec::from_json(const json& config, std::string_view source) {
  STRIDER_CHECK(config.is_object(), "{}: a config must be a JSON object", source);
  Reader r{config, source};
  const ArchInfo& ai = arch_of(r);
  ModelSpec s;
  s.arch = ai.arch;
  s.arch_name = std::string(ai.name);
  const std::string act = r.string_or("hidden_act", "silu");
  STRIDER_CHECK(act == "silu", "{}: hidden_act '{}' is not supported (silu)", source, act);

  BlockDims& d = s.dims;
  d.hidden = r.positive("hidden_size");
  s.layers = r.positive("num_hidden_layers");
  d.heads = r.positive("num_attention_heads");
  d.kv_heads = r.positive_or("num_key_value_heads", d.heads);
  d.intermediate = r.positive("intermediate_size");
  d.vocab = r.positive("vocab_size");
  s.max_position = r.positive_or("max_position_embeddings", 4096);
  STRIDER_CHECK(d.heads % d.kv_heads == 0,
                "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", source,
                d.heads, d.kv_heads);
  if (r.find("head_dim")) {
    d.head_dim = r.positive("head_dim");
  } else {
    STRIDER_CHECK(d.hidden % d.heads == 0,
                  "{}: hidden_size {} is not a multiple of num_attention_heads {} and no head_dim is given",
                  source, d.hidden, d.heads);
    d.head_dim = d.hidden / d.heads;
  }
  STRIDER_CHECK(d.head_dim % 2 == 0, "{}: head_dim {} must be even for RoPE", source, d.head_dim);
  d.rms_eps = r.number_or("rms_norm_eps", 1e-6);
  STRIDER_CHECK(d.rms_eps > 0, "{}: rms_norm_eps {} must be > 0", source, d.rms_eps);
  d.rope = parse_rope(r);
  s.tie_embeddings = r.boolean_or("tie_word_embeddings", false);

  switch (s.arch) {
    case Arch::kLlama:
      d.qkv_bias = d.o_bias = r.boolean_or("attention_bias", false);
      d.mlp_bias = r.boolean_or("mlp_bias", false);
      break;
    case Arch::kQwen2:
      d.qkv_bias = true;  // Qwen2's q/k/v projections always carry a bias
      break;
    case Arch::kQwen3:
      d.qkv_bias = d.o_bias = r.boolean_or("attention_bias", false);
      d.qk_norm = true;
      break;
    case Arch::kMistral:
      break;
  }
  // Sliding-window attention: only Mistral applies it to every layer; Qwen
  // configs carry the field but leave use_sliding_window off.
  if (s.arch == Arch::kMistral || r.boolean_or("use_sliding_window", false)) {
    STRIDER_CHECK(s.arch == Arch::kMistral,
                  "{}: use_sliding_window is not supported for {}", source, s.arch_name);
    if (r.find("sliding_window")) d.sliding_window = r.positive("sliding_window");
  }
  return s;
}

ModelSpec ModelSpec::from_file(const std::filesystem::path& path) {
  std::filesystem::path file = std::filesystem::is_directory(path) ? path / "config.json" : path;
  std::ifstream in(file);
  STRIDER_CHECK(in.good(), "cannot open model config {}", file.string());
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  STRIDER_CHECK(!j.is_discarded(), "{}: not valid JSON", file.string());
  return from_json(j, file.string());
}

BlockRef ModelSpec::block(int64_t i) const {
  STRIDER_CHECK(i >= 0 && i < num_blocks(), "block {} out of range (model has {} blocks)", i, num_blocks());
  if (i == 0) return {BlockKind::kEmbedding};
  if (i == num_blocks() - 1) return {BlockKind::kHead};
  return {BlockKind::kLayer, i - 1};
}

std::string ModelSpec::block_name(int64_t i) const {
  BlockRef b = block(i);
  switch (b.kind) {
    case BlockKind::kEmbedding: return "embedding";
    case BlockKind::kHead: return "head";
    case BlockKind::kLayer: break;
  }
  return fmt::format("layer.{}", b.layer);
}

ParamLayout ModelSpec::layout(int64_t i) const {
  BlockRef b = block(i);
  ParamLayout l(block_name(i));
  const BlockDims& d = dims;
  const int64_t q = d.heads * d.head_dim, kv = d.kv_heads * d.head_dim;
  switch (b.kind) {
    case BlockKind::kEmbedding:
      l.add("model.embed_tokens.weight", {d.vocab, d.hidden});
      break;
    case BlockKind::kHead:
      l.add("model.norm.weight", {d.hidden});
      if (!tie_embeddings) l.add("lm_head.weight", {d.vocab, d.hidden});
      break;
    case BlockKind::kLayer: {
      const std::string p = fmt::format("model.layers.{}.", b.layer);
      l.add(p + "input_layernorm.weight", {d.hidden});
      l.add(p + "self_attn.q_proj.weight", {q, d.hidden});
      if (d.qkv_bias) l.add(p + "self_attn.q_proj.bias", {q});
      l.add(p + "self_attn.k_proj.weight", {kv, d.hidden});
      if (d.qkv_bias) l.add(p + "self_attn.k_proj.bias", {kv});
      l.add(p + "self_attn.v_proj.weight", {kv, d.hidden});
      if (d.qkv_bias) l.add(p + "self_attn.v_proj.bias", {kv});
      l.add(p + "self_attn.o_proj.weight", {d.hidden, q});
      if (d.o_bias) l.add(p + "self_attn.o_proj.bias", {d.hidden});
      if (d.qk_norm) {
        l.add(p + "self_attn.q_norm.weight", {d.head_dim});
        l.add(p + "self_attn.k_norm.weight", {d.head_dim});
      }
      l.add(p + "post_attention_layernorm.weight", {d.hidden});
      l.add(p + "mlp.gate_proj.weight", {d.intermediate, d.hidden});
      if (d.mlp_bias) l.add(p + "mlp.gate_proj.bias", {d.intermediate});
      l.add(p + "mlp.up_proj.weight", {d.intermediate, d.hidden});
      if (d.mlp_bias) l.add(p + "mlp.up_proj.bias", {d.intermediate});
      l.add(p + "mlp.down_proj.weight", {d.hidden, d.intermediate});
      if (d.mlp_bias) l.add(p + "mlp.down_proj.bias", {d.hidden});
      break;
    }
  }
  return l;
}

BlockCost ModelSpec::cost(int64_t i, int64_t batch, int64_t seq, int64_t vocab_chunk, int dtype_bytes) const {
  const BlockDims& d = dims;
  const double t = double(batch) * double(seq);
  const int64_t tok = batch * seq;
  const int64_t q = d.heads * d.head_dim, kv = d.kv_heads * d.head_dim;
  BlockCost c;
  c.output_bytes = tok * d.hidden * dtype_bytes;
  switch (block(i).kind) {
    case BlockKind::kEmbedding:
      c.forward_work_bytes = c.output_bytes;
      c.backward_work_bytes = tok * d.hidden * 4 * 2;  // fp32 scatter of the gradient
      break;
    case BlockKind::kLayer: {
      const double proj = 2.0 * t * d.hidden * (2.0 * q + 2.0 * kv);
      const double attn = 2.0 * 2.0 * double(batch) * d.heads * d.head_dim * double(seq) * double(seq) / 2;
      const double mlp = 2.0 * 3.0 * t * d.hidden * d.intermediate;
      c.forward_flops = proj + attn + mlp;
      c.backward_flops = 2.0 * c.forward_flops;
      // Live activations of one layer (norm out, q/k/v, attention out, MLP
      // gate/up/act) plus attention scores if the kernel materialises them.
      const int64_t acts = tok * (3 * d.hidden + 2 * q + 2 * kv + 3 * d.intermediate) * dtype_bytes;
      const int64_t scores = batch * d.heads * seq * seq * 4;
      c.forward_work_bytes = acts + scores;
      c.backward_work_bytes = 2 * acts + 2 * scores + tok * d.hidden * 4;
      break;
    }
    case BlockKind::kHead: {
      const int64_t chunk = std::min(vocab_chunk > 0 ? vocab_chunk : d.vocab, d.vocab);
      c.forward_flops = 2.0 * t * d.hidden * d.vocab;         // logits, pass 1
      c.backward_flops = 2.0 * 3.0 * t * d.hidden * d.vocab;  // logits again + both grads
      c.forward_work_bytes = tok * d.hidden * 4 + tok * chunk * 4 * 2;
      c.backward_work_bytes = tok * d.hidden * 4 * 2 + tok * chunk * 4 * 3;
      break;
    }
  }
  return c;
}

int64_t ModelSpec::param_count() const {
  int64_t n = 0;
  for (int64_t i = 0; i < num_blocks(); ++i) n += static_cast<int64_t>(layout(i).param_elems());
  return n;
}

std::string ModelSpec::summary() const {
  return fmt::format("{}: {} layers, hidden {}, heads {}/{} (head dim {}), intermediate {}, vocab {}, "
                     "{:.3f}B parameters{}",
                     arch_name, layers, dims.hidden, dims.heads, dims.kv_heads, dims.head_dim,
                     dims.intermediate, dims.vocab, param_count() / 1e9,
                     tie_embeddings ? ", tied embeddings" : "");
}

}  // namespace strider
