// ModelSpec from a transformers config.json: every field read, bounded and
// named in its errors; the spec's size checks and summary. (Its layout and
// costs are in model_spec.cpp.)
#include "engine/model/model_spec.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <tuple>

#include "engine/model/model_config_reader.h"
#include "host/error.h"
#include "io/mapped_file.h"

namespace strider {
using namespace config_json;
namespace {

using nlohmann::json;
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
    {Arch::kQwen3Moe, "Qwen3MoeForCausalLM", "qwen3_moe"},
    {Arch::kMixtral, "MixtralForCausalLM", "mixtral"},
    {Arch::kQwen2Moe, "Qwen2MoeForCausalLM", "qwen2_moe"},
};

// Mixture-of-experts architectures strider does not train yet, and what of
// theirs is missing.
struct Unsupported { std::string_view name, model_type, missing; };
constexpr Unsupported kUnsupported[] = {
    {"DeepseekV3ForCausalLM", "deepseek_v3", "multi-head latent attention and bias-corrected (noaux_tc) routing"},
    {"DeepseekV2ForCausalLM", "deepseek_v2", "multi-head latent attention and its shared experts"},
    {"GptOssForCausalLM", "gpt_oss", "attention sinks and its clamped SwiGLU experts with biases"},
    {"OlmoeForCausalLM", "olmoe", "OLMoE's whole-projection q/k norms over experts"},
};

const ArchInfo& arch_of(const Reader& r) {
  std::string name;
  if (const json* a = r.find("architectures")) {
    STRIDER_CHECK(a->is_array() && a->size() == 1 && (*a)[0].is_string(),
                  "{}: field 'architectures' must hold one name, got {}", r.source, a->dump());
    name = (*a)[0].get<std::string>();
    for (const auto& i : kArchs)
      if (i.name == name) return i;
    for (const auto& u : kUnsupported)
      if (u.name == name)
        throw Error(fmt::format("{}: {} is not supported: strider does not build {}", r.source, name, u.missing));
  } else {
    std::string mt = r.string_or("model_type", "");
    for (const auto& i : kArchs)
      if (i.model_type == mt) return i;
    for (const auto& u : kUnsupported)
      if (u.model_type == mt)
        throw Error(fmt::format("{}: model_type '{}' ({}) is not supported: strider does not build {}", r.source,
                                mt, u.name, u.missing));
    name = "model_type '" + mt + "'";
  }
  throw Error(fmt::format("{}: architecture {} is not supported; strider supports LlamaForCausalLM, "
                          "Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, GraniteForCausalLM, Phi3ForCausalLM, "
                          "Olmo2ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM and "
                          "MixtralForCausalLM",
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

}  // namespace

namespace config_json {

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
// files; with both, rope_scaling, as transformers reads them); `theta`: the architecture's default base, `partial`: its rotary
// fraction where rope_parameters does not give one.
RopeDims parse_rope(const Reader& r, int64_t head_dim, double theta, double partial) {
  RopeDims rope;
  rope.partial_rotary = partial;
  const json* params = r.find("rope_parameters");
  const json* scaling = r.find("rope_scaling");
  rope.theta = r.number_or("rope_theta", theta, kRopeThetaRange);
  // transformers' precedence (5.x): a rope_scaling that is there (not null)
  // is the RoPE, whatever rope_parameters says; without one, rope_parameters.
  // Either's own rope_theta is the base over the top-level one.
  // (tests/python/test_rope_config.py holds transformers to it.)
  const json* p = scaling ? scaling : params;
  if (p == nullptr) return parse_rope_params(Reader{json::object(), r.source}, rope, r, head_dim);
  STRIDER_CHECK(p->is_object(), "{}: field '{}' must be an object", r.source,
                scaling ? "rope_scaling" : "rope_parameters");
  Reader pr{*p, r.source, scaling ? "rope_scaling." : "rope_parameters."};
  rope.theta = pr.number_or("rope_theta", rope.theta, kRopeThetaRange);
  return parse_rope_params(pr, rope, r, head_dim);
}

}  // namespace config_json

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

  // Dropout in any of the families' spellings: strider trains without it (a mask of its own would not be
  // torch's), so a model that asks for it is refused by name rather than trained otherwise in silence.
  for (const char* name : {"attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "attn_pdrop"}) {
    const json* v = r.find(name);
    STRIDER_CHECK(v == nullptr || v->is_null() || (v->is_number() && v->get<double>() == 0.0),
                  "{}: field '{}' = {}: strider trains without dropout (its masks would not be torch's); set it "
                  "to 0 to train this model", source, name, v ? v->dump() : "");
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
    case Arch::kQwen3Moe:
    case Arch::kMixtral:
    case Arch::kQwen2Moe:
      parse_moe(r, s);
      break;
  }
  // Sliding-window attention: Mistral and Phi-3 apply it to every layer;
  // Qwen configs carry the field but leave use_sliding_window off.
  const bool every_layer_window = s.arch == Arch::kMistral || s.arch == Arch::kPhi3 || s.arch == Arch::kMixtral;
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
  check_regular_input(file.string(), "a model config is a JSON file");
  std::ifstream in(file);
  STRIDER_CHECK(in.good(), "cannot open model config {}", file.string());
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  STRIDER_CHECK(!j.is_discarded(), "{}: not valid JSON", file.string());
  return from_json(j, file.string());
}

int64_t ModelSpec::sparse_layer_count() const {
  if (!dims.moe.sparse()) return 0;
  if (dense_layers.empty()) return layers;
  return layers - std::count_if(dense_layers.begin(), dense_layers.end(), [](uint8_t x) { return x != 0; });
}

int64_t ModelSpec::largest_layer_block() const {
  if (dense_layers.empty()) return 1;
  int64_t best = 1;
  for (int64_t l = 1; l < layers; ++l)
    if (sparse(l) != sparse(0)) {
      if (layout(l + 1).total_elems() > layout(1).total_elems()) best = l + 1;
      break;
    }
  return best;
}

namespace {
// Embedding, one layer of each kind (layers of a kind have the same tensors),
// head: no loop over the blocks, and no sum that can overflow.
long double param_estimate(const ModelSpec& s) {
  const int64_t sparse = s.sparse_layer_count(), dense = s.layers - sparse;
  auto layer_of = [&](bool want_sparse) {
    for (int64_t l = 0; l < s.layers; ++l)
      if (s.sparse(l) == want_sparse) return static_cast<long double>(s.layout(l + 1).param_elems());
    return 0.0L;
  };
  return static_cast<long double>(s.layout(0).param_elems()) +
         (sparse > 0 ? static_cast<long double>(sparse) * layer_of(true) : 0.0L) +
         (dense > 0 ? static_cast<long double>(dense) * layer_of(false) : 0.0L) +
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
  return static_cast<int64_t>(param_estimate(*this));
}

std::string ModelSpec::summary() const {
  return fmt::format("{}: {} layers, hidden {}, heads {}/{} (head dim {}), intermediate {}, vocab {}, "
                     "{:.3f}B parameters{}{}{}",
                     arch_name, layers, dims.hidden, dims.heads, dims.kv_heads, dims.head_dim,
                     dims.intermediate, dims.vocab, param_count() / 1e9,
                     dims.moe.sparse()
                         ? fmt::format(", {} of {} layers with {} experts (top {}, intermediate {}){}",
                                       sparse_layer_count(), layers, dims.moe.experts, dims.moe.top_k,
                                       dims.moe.intermediate,
                                       dims.moe.shared_intermediate > 0
                                           ? fmt::format(" and a shared expert (intermediate {})",
                                                         dims.moe.shared_intermediate)
                                           : std::string())
                         : std::string(),
                     tie_embeddings ? ", tied embeddings" : "",
                     lora.enabled() ? ", LoRA " + lora.text() + " over a frozen base" : "");
}

}  // namespace strider
