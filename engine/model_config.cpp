// ModelSpec from a transformers config.json: every field read, bounded and
// named in its errors; the spec's size checks and summary. (Its layout and
// costs are in model_spec.cpp.)
#include "engine/model_spec.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <tuple>

#include "host/error.h"

namespace strider {
namespace {

using nlohmann::json;

// Bounds of every number read from a config.json. Each is far past any
// published model (the largest we know: hidden 16384, 126 layers, 128 heads
// and intermediate 53248 in Llama 3.1 405B; a vocab of about 262k in Gemma 3;
// 10M positions in Llama 4 Scout; rope_theta 1e7 in Qwen2.5-1M), so no real
// config is refused. What they stop is a typo or a hostile file
// (num_hidden_layers 10^12) that would otherwise reach loops and allocations
// sized by it, or overflow the 64-bit sizes computed from it.
struct IntRange { int64_t lo, hi; };
constexpr IntRange kLayersRange{1, 100'000};
constexpr IntRange kHiddenRange{1, int64_t{1} << 20};
constexpr IntRange kHeadsRange{1, int64_t{1} << 16};  // attention and KV heads
constexpr IntRange kHeadDimRange{2, int64_t{1} << 20};  // given, or hidden / heads
constexpr IntRange kIntermediateRange{1, int64_t{1} << 22};
constexpr IntRange kVocabRange{1, int64_t{1} << 24};
constexpr IntRange kPositionsRange{1, int64_t{1} << 30};  // positions, sliding window

// A real-valued field's bounds; `lo_open`: lo itself is outside.
struct RealRange { double lo, hi; bool lo_open; };
constexpr RealRange kRopeThetaRange{0, 1e12, true};
constexpr RealRange kRopeFactorRange{0, 1e6, true};  // factor, low and high freq factors
constexpr RealRange kRmsEpsRange{0, 1, true};
constexpr RealRange kMultiplierRange{0, 1e6, true};  // Granite's multipliers and logits_scaling

// Field readers that name the file and the field in every error.
struct Reader {
  const json& j;
  std::string_view source;
  std::string_view prefix = {};  // "rope_scaling." inside that object

  std::string name(std::string_view key) const { return fmt::format("{}{}", prefix, key); }

  const json* find(std::string_view key) const {
    auto it = j.find(key);
    return (it == j.end() || it->is_null()) ? nullptr : &*it;
  }
  // An integer within `r`. JSON's 1e12 or 32.0 is a floating-point number, not
  // an integer: refused with the range, rather than rounded.
  int64_t integer(std::string_view key, IntRange r) const {
    const json* v = find(key);
    STRIDER_CHECK(v != nullptr, "{}: missing field '{}'", source, name(key));
    STRIDER_CHECK(!v->is_number_float(), "{}: field '{}' = {} is a floating-point number; it must be "
                  "an integer in [{}, {}], written without a decimal point or exponent", source, name(key),
                  v->dump(), r.lo, r.hi);
    STRIDER_CHECK(v->is_number_integer(), "{}: field '{}' must be an integer in [{}, {}], got {}",
                  source, name(key), r.lo, r.hi, v->dump());
    // The parser stores a non-negative integer as unsigned; past int64 it
    // would wrap in get<int64_t>(), so compare it as unsigned first.
    const bool in = v->is_number_unsigned()
                        ? v->get<uint64_t>() <= uint64_t(r.hi) && v->get<int64_t>() >= r.lo
                        : v->get<int64_t>() >= r.lo && v->get<int64_t>() <= r.hi;
    STRIDER_CHECK(in, "{}: field '{}' = {} is outside [{}, {}]", source, name(key), v->dump(), r.lo, r.hi);
    return v->get<int64_t>();
  }
  int64_t integer_or(std::string_view key, int64_t dflt, IntRange r) const {
    return find(key) ? integer(key, r) : dflt;
  }
  double number_or(std::string_view key, double dflt, RealRange r) const {
    const json* v = find(key);
    if (!v) return dflt;
    STRIDER_CHECK(v->is_number(), "{}: field '{}' must be a number, got {}", source, name(key), v->dump());
    const double x = v->get<double>();
    const bool in = (r.lo_open ? x > r.lo : x >= r.lo) && x <= r.hi;  // false for NaN
    STRIDER_CHECK(in, "{}: field '{}' = {} is outside {}{}, {}]", source, name(key), v->dump(),
                  r.lo_open ? "(" : "[", r.lo, r.hi);
    return x;
  }
  bool boolean_or(std::string_view key, bool dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    STRIDER_CHECK(v->is_boolean(), "{}: field '{}' must be true or false, got {}", source, name(key), v->dump());
    return v->get<bool>();
  }
  std::string string_or(std::string_view key, std::string dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    STRIDER_CHECK(v->is_string(), "{}: field '{}' must be a string, got {}", source, name(key), v->dump());
    return v->get<std::string>();
  }
};

struct ArchInfo { Arch arch; std::string_view name, model_type; };
constexpr ArchInfo kArchs[] = {
    {Arch::kLlama, "LlamaForCausalLM", "llama"},
    {Arch::kQwen2, "Qwen2ForCausalLM", "qwen2"},
    {Arch::kQwen3, "Qwen3ForCausalLM", "qwen3"},
    {Arch::kMistral, "MistralForCausalLM", "mistral"},
    {Arch::kGranite, "GraniteForCausalLM", "granite"},
    {Arch::kPhi3, "Phi3ForCausalLM", "phi3"},
    {Arch::kOlmo2, "Olmo2ForCausalLM", "olmo2"},
    {Arch::kGemma2, "Gemma2ForCausalLM", "gemma2"},
    {Arch::kGemma3, "Gemma3ForCausalLM", "gemma3_text"},
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
                          "Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, GraniteForCausalLM, Phi3ForCausalLM, "
                          "Olmo2ForCausalLM, Gemma2ForCausalLM and Gemma3ForCausalLM",
                          r.source, name));
}

// A list of positive numbers, `count` of them.
std::vector<double> factors(const Reader& r, std::string_view key, size_t count) {
  const json* v = r.find(key);
  STRIDER_CHECK(v != nullptr && v->is_array() && v->size() == count, "{}: field '{}' must list {} factors (half "
                "the rotary dimension)", r.source, r.name(key), count);
  std::vector<double> out;
  for (const json& x : *v) {
    STRIDER_CHECK(x.is_number() && x.get<double>() > 0 && x.get<double>() <= kRopeFactorRange.hi,
                  "{}: field '{}' holds {}, not a factor in (0, {}]", r.source, r.name(key), x.dump(),
                  kRopeFactorRange.hi);
    out.push_back(x.get<double>());
  }
  return out;
}

// The RoPE object `pr` reads (its rope_type and factors) over `rope`; `top`:
// the whole config (longrope's defaults come from its positions), whose
// head_dim is `head_dim`.
RopeDims parse_rope_params(const Reader& pr, RopeDims rope, const Reader& top, int64_t head_dim) {
  // transformers >= 5 keeps Phi-3's partial_rotary_factor here.
  rope.partial_rotary = pr.number_or("partial_rotary_factor", rope.partial_rotary, kMultiplierRange);
  const int64_t dim = rope.rotary_dim(head_dim);
  STRIDER_CHECK(rope.partial_rotary <= 1.0 && dim >= 2 && dim % 2 == 0, "{}: {}partial_rotary_factor {} of head_dim "
                "{} must leave an even rotary dimension of at least 2, at most the head", pr.source, pr.prefix,
                rope.partial_rotary, head_dim);
  std::string type = pr.string_or("rope_type", pr.string_or("type", "default"));
  if (type == "default") {
    rope.type = RopeType::kDefault;
  } else if (type == "llama3") {
    rope.type = RopeType::kLlama3;
    rope.factor = pr.number_or("factor", 8.0, kRopeFactorRange);
    rope.low_freq_factor = pr.number_or("low_freq_factor", 1.0, kRopeFactorRange);
    rope.high_freq_factor = pr.number_or("high_freq_factor", 4.0, kRopeFactorRange);
    rope.original_max_position =
        pr.integer_or("original_max_position_embeddings", 8192, kPositionsRange);
    STRIDER_CHECK(rope.high_freq_factor > rope.low_freq_factor,
                  "{}: rope high_freq_factor {} must exceed low_freq_factor {}", pr.source,
                  rope.high_freq_factor, rope.low_freq_factor);
  } else if (type == "linear") {
    rope.type = RopeType::kLinear;
    rope.factor = pr.number_or("factor", 1.0, kRopeFactorRange);
  } else if (type == "longrope" || type == "su") {  // transformers' _compute_longrope_parameters
    rope.type = RopeType::kLongrope;
    rope.short_factor = factors(pr, "short_factor", size_t(dim / 2));
    rope.long_factor = factors(pr, "long_factor", size_t(dim / 2));
    const int64_t max_position = top.integer_or("max_position_embeddings", 4096, kPositionsRange);
    rope.original_max_position = pr.integer_or(
        "original_max_position_embeddings", top.integer_or("original_max_position_embeddings", max_position,
                                                           kPositionsRange), kPositionsRange);
    const double factor = pr.number_or("factor", double(max_position) / double(rope.original_max_position),
                                       kRopeFactorRange);
    const double dflt = factor <= 1.0 ? 1.0
                                      : std::sqrt(1 + std::log(factor) / std::log(double(rope.original_max_position)));
    rope.attention_factor = pr.number_or("attention_factor", dflt, kRopeFactorRange);
  } else {
    throw Error(fmt::format("{}: rope_type '{}' is not supported (default, llama3, linear, longrope)", pr.source,
                            type));
  }
  return rope;
}

// rope_parameters (transformers >= 5) or rope_theta + rope_scaling (older
// files); `theta`: the architecture's default base, `partial`: its rotary
// fraction where rope_parameters does not give one.
RopeDims parse_rope(const Reader& r, int64_t head_dim, double theta = 10000.0, double partial = 1.0) {
  RopeDims rope;
  rope.partial_rotary = partial;
  const json* params = r.find("rope_parameters");
  const json* scaling = r.find("rope_scaling");
  rope.theta = r.number_or("rope_theta", theta, kRopeThetaRange);
  const json* p = params ? params : scaling;
  if (p == nullptr) return parse_rope_params(Reader{json::object(), r.source}, rope, r, head_dim);
  STRIDER_CHECK(p->is_object(), "{}: field '{}' must be an object", r.source,
                params ? "rope_parameters" : "rope_scaling");
  Reader pr{*p, r.source, params ? "rope_parameters." : "rope_scaling."};
  if (params) rope.theta = pr.number_or("rope_theta", rope.theta, kRopeThetaRange);
  return parse_rope_params(pr, rope, r, head_dim);
}

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

}  // namespace

ModelSpec ModelSpec::from_json(const json& config, std::string_view source) {
  STRIDER_CHECK(config.is_object(), "{}: a config must be a JSON object", source);
  Reader r{config, source};
  const ArchInfo& ai = arch_of(r);
  ModelSpec s;
  s.arch = ai.arch;
  s.arch_name = std::string(ai.name);
  const bool gemma = s.arch == Arch::kGemma2 || s.arch == Arch::kGemma3;  // parse_gemma reads these
  if (!gemma) {
    const std::string act = r.string_or("hidden_act", "silu");
    STRIDER_CHECK(act == "silu", "{}: hidden_act '{}' is not supported (silu)", source, act);
  }

  BlockDims& d = s.dims;
  d.hidden = r.integer("hidden_size", kHiddenRange);
  s.layers = r.integer("num_hidden_layers", kLayersRange);
  d.heads = r.integer("num_attention_heads", kHeadsRange);
  d.kv_heads = r.integer_or("num_key_value_heads", d.heads, kHeadsRange);
  d.intermediate = r.integer("intermediate_size", kIntermediateRange);
  d.vocab = r.integer("vocab_size", kVocabRange);
  // torch's nn.Embedding takes padding_idx in [-vocab, vocab) (a negative one
  // counts from the end); transformers passes pad_token_id.
  if (const json* pad = r.find("pad_token_id"); pad != nullptr && pad->is_number_integer()) {
    const int64_t p = pad->get<int64_t>();
    STRIDER_CHECK(p >= -d.vocab && p < d.vocab, "{}: field 'pad_token_id' = {} is outside [-{}, {}) (vocab_size)",
                  source, p, d.vocab, d.vocab);
    d.pad_token = p < 0 ? p + d.vocab : p;
  }
  s.max_position = r.integer_or("max_position_embeddings", 4096, kPositionsRange);
  STRIDER_CHECK(d.heads % d.kv_heads == 0,
                "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", source,
                d.heads, d.kv_heads);
  if (r.find("head_dim")) {
    d.head_dim = r.integer("head_dim", kHeadDimRange);
  } else {
    STRIDER_CHECK(d.hidden % d.heads == 0,
                  "{}: hidden_size {} is not a multiple of num_attention_heads {} and no head_dim is given",
                  source, d.hidden, d.heads);
    d.head_dim = d.hidden / d.heads;
  }
  STRIDER_CHECK(d.head_dim % 2 == 0, "{}: head_dim {} must be even for RoPE", source, d.head_dim);
  d.rms_eps = r.number_or("rms_norm_eps", 1e-6, kRmsEpsRange);
  // Phi-3's older files keep partial_rotary_factor beside the RoPE, not in it.
  d.rope = parse_rope(r, d.head_dim, 10000.0,
                      s.arch == Arch::kPhi3 ? r.number_or("partial_rotary_factor", 1.0, kMultiplierRange) : 1.0);
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
    case Arch::kGranite:  // Llama's layer with four multipliers (transformers' modeling_granite)
      d.qkv_bias = d.o_bias = r.boolean_or("attention_bias", false);
      d.mlp_bias = r.boolean_or("mlp_bias", false);
      d.embedding_multiplier = r.number_or("embedding_multiplier", 1.0, kMultiplierRange);
      d.attn_scale = r.number_or("attention_multiplier", 1.0, kMultiplierRange);
      d.residual_multiplier = r.number_or("residual_multiplier", 1.0, kMultiplierRange);
      d.logits_scaling = r.number_or("logits_scaling", 1.0, kMultiplierRange);
      break;
    case Arch::kPhi3: {  // Llama's layer with fused projections (transformers' modeling_phi3)
      d.fused_projections = true;
      break;
    }
    case Arch::kOlmo2:  // norms after each branch, q/k norms over the whole projections (modeling_olmo2)
      d.qkv_bias = d.o_bias = r.boolean_or("attention_bias", false);
      d.qk_norm = d.qk_norm_whole = true;
      d.norm = NormKind::kFp32Weight;
      d.norm_placement = NormPlacement::kPost;
      break;
    case Arch::kGemma2:
    case Arch::kGemma3:
      parse_gemma(r, s);
      break;
  }
  // Sliding-window attention: Mistral and Phi-3 apply it to every layer;
  // Qwen configs carry the field but leave use_sliding_window off.
  const bool every_layer_window = s.arch == Arch::kMistral || s.arch == Arch::kPhi3;
  if (!gemma && (every_layer_window || r.boolean_or("use_sliding_window", false))) {
    STRIDER_CHECK(every_layer_window,
                  "{}: use_sliding_window is not supported for {}", source, s.arch_name);
    d.sliding_window = r.integer_or("sliding_window", 0, kPositionsRange);
  }
  s.check_size(source);
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

namespace {
// Embedding, one layer (every layer has the same tensors), head: O(1) however
// many layers, and no sum that can overflow.
long double param_estimate(const ModelSpec& s) {
  return static_cast<long double>(s.layout(0).param_elems()) +
         static_cast<long double>(s.layers) * static_cast<long double>(s.layout(1).param_elems()) +
         static_cast<long double>(s.layout(s.num_blocks() - 1).param_elems());
}
}  // namespace

void ModelSpec::check_size(std::string_view source) const {
  // from_json has checked each field as it read it; a spec built in code gets
  // the same bounds here. Within them every tensor's element count (at most
  // 2^56) and one layer's sum stay inside 64 bits.
  const BlockDims& d = dims;
  const std::tuple<std::string_view, int64_t, IntRange> fields[] = {
      {"num_hidden_layers", layers, kLayersRange},      {"hidden_size", d.hidden, kHiddenRange},
      {"num_attention_heads", d.heads, kHeadsRange},    {"num_key_value_heads", d.kv_heads, kHeadsRange},
      {"head_dim", d.head_dim, kHeadDimRange},          {"intermediate_size", d.intermediate, kIntermediateRange},
      {"vocab_size", d.vocab, kVocabRange}};
  for (const auto& [name, x, r] : fields)
    STRIDER_CHECK(x >= r.lo && x <= r.hi, "{}: field '{}' = {} is outside [{}, {}]", source, name, x,
                  r.lo, r.hi);
  const long double n = param_estimate(*this);
  STRIDER_CHECK(n <= static_cast<long double>(kMaxParams), "{}: the model has {:.4g} parameters "
                "({} layers, hidden {}, intermediate {}, vocab {}), past the {:.0e} strider accepts: "
                "its optimizer state alone (16 bytes per parameter) would need {:.4g} TB; check the "
                "config", source, static_cast<double>(n), layers, d.hidden, d.intermediate, d.vocab,
                static_cast<double>(kMaxParams), static_cast<double>(n) * 16 / 1e12);
}

int64_t ModelSpec::param_count() const {
  check_size(arch_name.empty() ? "model" : arch_name);
  return static_cast<int64_t>(layout(0).param_elems()) + layers * static_cast<int64_t>(layout(1).param_elems()) +
         static_cast<int64_t>(layout(num_blocks() - 1).param_elems());
}

std::string ModelSpec::summary() const {
  return fmt::format("{}: {} layers, hidden {}, heads {}/{} (head dim {}), intermediate {}, vocab {}, "
                     "{:.3f}B parameters{}{}",
                     arch_name, layers, dims.hidden, dims.heads, dims.kv_heads, dims.head_dim,
                     dims.intermediate, dims.vocab, param_count() / 1e9,
                     tie_embeddings ? ", tied embeddings" : "",
                     lora.enabled() ? ", LoRA " + lora.text() + " over a frozen base" : "");
}

}  // namespace strider
