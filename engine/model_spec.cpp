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
  rope.theta = r.number_or("rope_theta", 10000.0, kRopeThetaRange);
  const json* p = params ? params : scaling;
  if (p == nullptr) return rope;
  STRIDER_CHECK(p->is_object(), "{}: field '{}' must be an object", r.source,
                params ? "rope_parameters" : "rope_scaling");
  Reader pr{*p, r.source, params ? "rope_parameters." : "rope_scaling."};
  if (params) rope.theta = pr.number_or("rope_theta", rope.theta, kRopeThetaRange);
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
                  "{}: rope high_freq_factor {} must exceed low_freq_factor {}", r.source,
                  rope.high_freq_factor, rope.low_freq_factor);
  } else if (type == "linear") {
    rope.type = RopeType::kLinear;
    rope.factor = pr.number_or("factor", 1.0, kRopeFactorRange);
  } else {
    throw Error(fmt::format("{}: rope_type '{}' is not supported (default, llama3, linear)", r.source, type));
  }
  return rope;
}

// The working memory of gpu/blocks' decoder layer for a micro-batch of
// batch x seq tokens: the peak of ATen's allocations above what was live
// before the call (its output included), phase by phase in the order
// gpu/blocks.cpp runs them. tests/engine/test_layer_memory measures it on the
// CPU and holds it within [0.7, 1] of this.
//
// Per token unless said otherwise; e = compute dtype bytes; H, Q, KV = hidden,
// heads x head_dim, kv_heads x head_dim; I = intermediate; t = MLP tile.
// Nothing grows with seq^2 (SDPA's flash kernels) and nothing with
// tokens x intermediate beyond one tile.
struct LayerWork {
  __int128 forward = 0, backward = 0;
};
LayerWork layer_work(const BlockDims& d, int64_t batch, int64_t seq, int64_t token_tile, int dtype_bytes,
                     const WorkCoefficients& k) {
  using i128 = __int128;
  const i128 n = i128{batch} * seq;
  const i128 t = token_tile == 0 || token_tile > n ? n : token_tile;
  const i128 e = dtype_bytes, h = d.hidden, inter = d.intermediate, heads = d.heads;
  const i128 q = heads * d.head_dim, kv = i128{d.kv_heads} * d.head_dim;
  // Below fp32, RMSNorm normalises an fp32 copy of its input (and autograd
  // keeps it: our own code, on every device). A GEMM may write its output in
  // fp32 first (oneDNN on CPUs without bf16 units), and silu's backward stage
  // in fp32: those two are the device's kernels' (gpu/work_calibration.h,
  // in half bytes per element here).
  const i128 f32_copy = dtype_bytes < 4 ? 4 : 0;
  auto half_bytes = [&](double coef) { return dtype_bytes < 4 ? i128(std::llround(coef * 2)) : i128{0}; };
  const i128 gemm_f32_x2 = half_bytes(k.gemm_staging_bytes), silu_f32_x2 = half_bytes(k.silu_back_staging_bytes);
  auto gemm_f32 = [&](i128 elems) { return gemm_f32_x2 * elems / 2; };
  // RMSNorm of w features without grad: the fp32 copy, x * rsqrt in fp32, its
  // cast and the scaled output; mean, +eps and rsqrt per row (`rows` of them).
  auto norm = [&](i128 w, i128 rows) { return w * (8 + f32_copy) + 12 * rows; };
  // The flash kernel's blocks of scores: on a GPU they stay on chip; ATen's
  // CPU kernel allocates, per thread, a 256 x 512 fp32 block (and, backward,
  // one of their gradients). The model allows two threads (as the test runs).
  const i128 q_blk = std::min<i128>(seq, 256), kv_blk = std::min<i128>(seq, 512);
  const i128 scores = 2 * q_blk * (kv_blk + d.head_dim + 2) * 4;
  const i128 small = 4096;  // scalars and shapes
  // Headroom for what the count above does not see: a caching allocator's
  // rounding and fragmentation, other ATen versions' kernels. 1/8.
  auto headroom = [](i128 bytes) { return bytes + bytes / 8; };

  // Forward, no autograd: the largest of the attention half's steps, and
  // the MLP with x1 alive (the output, which each tile adds into).
  i128 attn = std::max({norm(h, 1),                                   // input norm
                        (h + q + 2 * kv) * e + gemm_f32(q),          // h, q, k, v
                        (5 * q / 2 + 2 * kv) * e,                     // RoPE: q, q * cos, a half, k, v
                        q * e + h * e + std::max(gemm_f32(h), e * h)});  // o_proj, then x + o
  if (d.qk_norm) attn = std::max(attn, (q + 2 * kv) * e + norm(q, heads));
  attn = std::max(n * attn, n * ((2 * q + 2 * kv) * e + 4 * heads) + scores);  // SDPA, logsumexp
  const i128 mlp = n * h * e + t * std::max(norm(h, 1), h * e + 2 * inter * e + gemm_f32(inter));  // gate, up
  LayerWork w;
  w.forward = headroom(std::max(attn, mlp) + small);

  // Backward (gpu/blocks.cpp's layer_backward, recomputing: a layer whose
  // activations are kept holds less). Held through the MLP: the attention
  // core's autograd graph (RoPE'd q and k, SDPA's output and log-sum-exp,
  // the heads' output reshaped for o_proj; with q/k norms their fp32 inputs
  // and normalised values), the recomputed projections q, k, v, x1 and
  // d(loss)/d(x1).
  i128 held = (3 * q + kv) * e + 4 * heads + (q + 2 * kv) * e + 2 * h * e;
  if (d.qk_norm) held += (q + kv) * (e + 4) + 4 * (heads + d.kv_heads);
  // One MLP tile: gate, up, d(act), d(up), d(gate) and silu_backward's
  // scratch (fp32 below fp32), and d(h2) with a GEMM's output; one weight
  // gradient [intermediate, hidden] at a time.
  const i128 tile = n * held + t * (inter * 4 * e + silu_f32_x2 * inter / 2 + 2 * h * e) + h * inter * e;
  // Attention's backward, x1 gone: d(a), its transposed copy, d(q), d(k),
  // d(v) (below fp32 the CPU kernel accumulates d(q) in fp32) and the
  // block scores' gradients.
  const i128 attn_back = n * (held - h * e + 2 * q * e + (q + 2 * kv) * e + f32_copy * q) + 2 * scores;
  // Last, the input norm recomputed with autograd and back-propagated, the
  // rest freed: d(loss)/d(x1), d(h1), the norm's fp32 graph and its
  // backward's fp32 temporaries.
  const i128 norm_back = n * (2 * h * e + h * (12 + 2 * e) + 12 * h);
  w.backward = headroom(std::max({tile, attn_back, norm_back}) + small);
  return w;
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
  d.hidden = r.integer("hidden_size", kHiddenRange);
  s.layers = r.integer("num_hidden_layers", kLayersRange);
  d.heads = r.integer("num_attention_heads", kHeadsRange);
  d.kv_heads = r.integer_or("num_key_value_heads", d.heads, kHeadsRange);
  d.intermediate = r.integer("intermediate_size", kIntermediateRange);
  d.vocab = r.integer("vocab_size", kVocabRange);
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

BlockCost ModelSpec::cost(int64_t i, int64_t batch, int64_t seq, int64_t vocab_chunk, int dtype_bytes,
                          int64_t token_tile, const WorkCoefficients& work) const {
  // Byte counts in 128 bits, then checked: batch and seq come from the
  // caller, and their products with the model's dimensions must not wrap.
  using i128 = __int128;
  STRIDER_CHECK(batch >= 1 && seq >= 1 && i128{batch} * seq <= kMaxTokens,
                "block cost: micro-batch {} x seq {} must be positive and at most 2^40 tokens", batch,
                seq);
  STRIDER_CHECK(vocab_chunk >= 0 && dtype_bytes >= 1 && dtype_bytes <= 8 && token_tile >= 0,
                "block cost: vocab chunk {}, dtype bytes {} or token tile {} is out of range", vocab_chunk,
                dtype_bytes, token_tile);
  const std::string name = block_name(i);
  auto bytes = [&](i128 x, std::string_view what) {
    STRIDER_CHECK(x <= kMaxBytes, "{}: its {} for micro-batch {} x seq {} is {:.4g} bytes, past 2^62 "
                  "(no machine holds that); shorten seq or the micro-batch", name, what, batch, seq,
                  static_cast<double>(x));
    return static_cast<int64_t>(x);
  };
  const BlockDims& d = dims;
  const double t = double(batch) * double(seq);
  const i128 tok = i128{batch} * seq;
  const i128 q = i128{d.heads} * d.head_dim, kv = i128{d.kv_heads} * d.head_dim;
  BlockCost c;
  c.output_bytes = bytes(tok * d.hidden * dtype_bytes, "output");
  switch (block(i).kind) {
    case BlockKind::kEmbedding: {
      // One vocabulary shard's visit (engine/shards.h): forward gathers the
      // rows of its tokens, backward their gradient (cast to fp32) and sums
      // them per distinct token (fp32, at most min(tokens, vocab) rows) before
      // the index_add (gpu/blocks.h); ids, masks, positions and the distinct
      // tokens' sort are ~64 bytes a token. tests/engine/test_head_memory
      // measures them.
      const i128 e = dtype_bytes, to_f32 = dtype_bytes < 4 ? 4 : 0;
      const i128 distinct = std::min<i128>(tok, d.vocab);
      c.forward_work_bytes = bytes(tok * (d.hidden * e + 32) + 4096, "forward working memory");
      c.backward_work_bytes =
          bytes(tok * (d.hidden * (e + to_f32) + 64) + distinct * d.hidden * 4 + 4096, "backward working memory");
      break;
    }
    case BlockKind::kLayer: {
      const double proj = 2.0 * t * d.hidden * (2.0 * double(q) + 2.0 * double(kv));
      const double attn = 2.0 * 2.0 * double(batch) * d.heads * d.head_dim * double(seq) * double(seq) / 2;
      const double mlp = 2.0 * 3.0 * t * d.hidden * d.intermediate;
      c.forward_flops = proj + attn + mlp;
      c.backward_flops = 2.0 * c.forward_flops;
      const LayerWork w = layer_work(d, batch, seq, token_tile, dtype_bytes, work);
      c.forward_work_bytes = bytes(w.forward, "forward working memory");
      c.backward_work_bytes = bytes(w.backward, "backward working memory");
      break;
    }
    case BlockKind::kHead: {
      // One launch of the streamed head (gpu/chunked_loss.h) on a token tile
      // t (all tokens untiled) and `vocab_chunk` rows at a time, c: the tile's
      // normed input t x H; pass 1's logits, their shifted copy and its exp
      // (12 t c); pass 2's fp32 softmax gradient with its cast (4 + e) t c and
      // then one of the two gradient GEMMs' results with its fp32 copy (below
      // fp32 both the cast and the copy; in fp32 neither); the final norm's
      // backward through autograd (24 bytes a feature, 2e more below fp32).
      // The norm itself (an fp32 copy, its square, the scaled value, the cast)
      // stays under 12 + 2e. Per-token state: ~32 bytes. Plus 1/8 headroom, as
      // for the layers. tests/engine/test_head_memory holds this within
      // [0.7, 1] of what the CPU measures.
      const int64_t chunk = std::min(vocab_chunk > 0 ? vocab_chunk : d.vocab, d.vocab);
      c.forward_flops = 2.0 * t * d.hidden * d.vocab;         // logits, pass 1
      c.backward_flops = 2.0 * 3.0 * t * d.hidden * d.vocab;  // logits again + both grads
      const i128 e = dtype_bytes, H = d.hidden, ch = chunk, below = dtype_bytes < 4 ? 1 : 0;
      const i128 tt = token_tile > 0 && token_tile < tok ? i128{token_tile} : tok;
      const i128 normed = tt * H * e, norm_tmp = tt * H * (12 + 2 * e);
      const i128 lse = normed + 12 * tt * ch;
      const i128 grad = normed + std::max<i128>(12 * tt * ch, (4 + below * e) * tt * ch +
                                                                  std::max(tt, ch) * H * (e + below * 4));
      const i128 norm_back = tt * H * (24 + below * 2 * e);
      auto headroom = [&](i128 x) { return x + x / 8 + 32 * tok + 4096; };
      c.forward_work_bytes = bytes(headroom(std::max(lse, norm_tmp)), "forward working memory");
      c.backward_work_bytes = bytes(headroom(std::max({lse, grad, norm_back, norm_tmp})), "backward working memory");
      break;
    }
  }
  return c;
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
                     "{:.3f}B parameters{}",
                     arch_name, layers, dims.hidden, dims.heads, dims.kv_heads, dims.head_dim,
                     dims.intermediate, dims.vocab, param_count() / 1e9,
                     tie_embeddings ? ", tied embeddings" : "");
}

}  // namespace strider
