#include "engine/model/model_spec.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <random>
#include <regex>

#include <fmt/ranges.h>

#include "engine/model/layer_work.h"
#include "host/error.h"

namespace strider {

BlockRef ModelSpec::block(int64_t i) const {
  STRIDER_CHECK(i >= 0 && i < num_blocks(), "block {} out of range (model has {} blocks)", i, num_blocks());
  if (i == 0) return {BlockKind::kEmbedding};
  if (i == num_blocks() - 1) return {BlockKind::kHead};
  return {BlockKind::kLayer, i - 1};
}

BlockDims ModelSpec::layer_dims(int64_t layer) const {
  STRIDER_CHECK(layer >= 0 && layer < layers, "layer {} out of range (model has {} layers)", layer, layers);
  BlockDims d = dims;
  if (!sparse(layer)) d.moe = MoeDims{};
  if (sliding_layers.empty()) return d;
  if (slides(layer)) d.rope = local_rope;
  else d.sliding_window = 0;
  return d;
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

void initial_values(const TensorSlot& t, uint64_t seed, std::span<float> out, NormKind norm) {
  STRIDER_CHECK(out.size() == t.numel, "initial_values: '{}' has {} elements, the buffer {}", t.name, t.numel,
                out.size());
  if (t.name.ends_with(".bias") || t.name.ends_with(".lora_B.weight")) {
    std::fill(out.begin(), out.end(), 0.0f);
    return;
  }
  if (t.name.ends_with("norm.weight")) {
    std::fill(out.begin(), out.end(), norm == NormKind::kGemma ? 0.0f : 1.0f);
    return;
  }
  std::mt19937_64 rng(seed ^ std::hash<std::string>{}(t.name));
  if (t.name.ends_with(".lora_A.weight")) {
    const float bound = 1.0f / std::sqrt(float(t.shape.back()));
    std::uniform_real_distribution<float> u(-bound, bound);
    for (float& x : out) x = u(rng);
    return;
  }
  std::normal_distribution<float> nd(0.0f, 0.02f);
  for (float& x : out) x = nd(rng);
}

bool weight_decays(std::string_view name) {
  static const std::regex exempt(R"(bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.))");
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  return !std::regex_search(lower, exempt);
}

namespace {

// A ParamLayout whose tensors take their decay flag from their names.
struct NamedLayout {
  ParamLayout l;
  bool trainable = true;
  void add(std::string name, std::vector<int64_t> shape) {
    const bool decay = weight_decays(name);
    l.add(std::move(name), std::move(shape), decay, trainable);
  }
};

}  // namespace

ParamLayout ModelSpec::layout(int64_t i) const {
  BlockRef b = block(i);
  NamedLayout l{ParamLayout(block_name(i))};
  const BlockDims& d = dims;
  const int64_t q = d.heads * d.head_dim, kv = d.kv_heads * d.head_dim;
  l.trainable = !lora.enabled();
  switch (b.kind) {
    case BlockKind::kEmbedding:
      l.trainable = l.trainable || lora.trains("embed_tokens");
      l.add("model.embed_tokens.weight", {d.vocab, d.hidden});
      break;
    case BlockKind::kHead:
      l.add("model.norm.weight", {d.hidden});
      l.trainable = l.trainable || lora.trains("lm_head");
      if (!tie_embeddings) l.add("lm_head.weight", {d.vocab, d.hidden});
      break;
    case BlockKind::kLayer: {
      const std::string p = fmt::format("model.layers.{}.", b.layer);
      const bool pre = d.norm_placement != NormPlacement::kPost, post = d.norm_placement != NormPlacement::kPre;
      if (pre) l.add(p + "input_layernorm.weight", {d.hidden});
      if (d.fused_projections) {  // Phi-3: one tensor each for q/k/v and gate/up, no biases
        l.add(p + "self_attn.qkv_proj.weight", {q + 2 * kv, d.hidden});
        l.add(p + "self_attn.o_proj.weight", {d.hidden, q});
        l.add(p + "post_attention_layernorm.weight", {d.hidden});
        l.add(p + "mlp.gate_up_proj.weight", {2 * d.intermediate, d.hidden});
        l.add(p + "mlp.down_proj.weight", {d.hidden, d.intermediate});
        break;
      }
      l.add(p + "self_attn.q_proj.weight", {q, d.hidden});
      if (d.qkv_bias) l.add(p + "self_attn.q_proj.bias", {q});
      l.add(p + "self_attn.k_proj.weight", {kv, d.hidden});
      if (d.qkv_bias) l.add(p + "self_attn.k_proj.bias", {kv});
      l.add(p + "self_attn.v_proj.weight", {kv, d.hidden});
      if (d.qkv_bias) l.add(p + "self_attn.v_proj.bias", {kv});
      l.add(p + "self_attn.o_proj.weight", {d.hidden, q});
      if (d.o_bias) l.add(p + "self_attn.o_proj.bias", {d.hidden});
      if (d.qk_norm) {
        l.add(p + "self_attn.q_norm.weight", {d.qk_norm_whole ? q : d.head_dim});
        l.add(p + "self_attn.k_norm.weight", {d.qk_norm_whole ? kv : d.head_dim});
      }
      l.add(p + "post_attention_layernorm.weight", {d.hidden});  // the MLP's pre-norm where norms come first
      if (pre && post) l.add(p + "pre_feedforward_layernorm.weight", {d.hidden});
      if (post) l.add(p + "post_feedforward_layernorm.weight", {d.hidden});
      if (sparse(b.layer)) {  // the router, then the experts (gpu/blocks/block_dims.h, MoeDims)
        const MoeDims& e = d.moe;
        l.add(p + "mlp.gate.weight", {e.experts, d.hidden});
        l.add(p + "mlp.experts.gate_up_proj", {e.experts, 2 * e.intermediate, d.hidden});
        l.add(p + "mlp.experts.down_proj", {e.experts, d.hidden, e.intermediate});
        if (e.shared_intermediate > 0) {  // Qwen2-MoE's shared expert and its gate
          l.add(p + "mlp.shared_expert.gate_proj.weight", {e.shared_intermediate, d.hidden});
          l.add(p + "mlp.shared_expert.up_proj.weight", {e.shared_intermediate, d.hidden});
          l.add(p + "mlp.shared_expert.down_proj.weight", {d.hidden, e.shared_intermediate});
          l.add(p + "mlp.shared_expert_gate.weight", {1, d.hidden});
        }
        break;
      }
      l.add(p + "mlp.gate_proj.weight", {d.intermediate, d.hidden});
      if (d.mlp_bias) l.add(p + "mlp.gate_proj.bias", {d.intermediate});
      l.add(p + "mlp.up_proj.weight", {d.intermediate, d.hidden});
      if (d.mlp_bias) l.add(p + "mlp.up_proj.bias", {d.intermediate});
      l.add(p + "mlp.down_proj.weight", {d.hidden, d.intermediate});
      if (d.mlp_bias) l.add(p + "mlp.down_proj.bias", {d.hidden});
      // The adapters, after the base: [in] -> [r] -> [out] per target.
      l.trainable = true;
      const std::pair<int64_t, int64_t> in_out[] = {{d.hidden, q}, {d.hidden, kv}, {d.hidden, kv}, {q, d.hidden},
                                                    {d.hidden, d.intermediate}, {d.hidden, d.intermediate},
                                                    {d.intermediate, d.hidden}};
      for (size_t k = 0; k < std::size(kLinearModules); ++k) {
        const std::string_view m = kLinearModules[k];
        if (!lora.targets_module(m)) continue;
        const std::string proj = p + (k < 4 ? "self_attn." : "mlp.") + std::string(m);
        l.add(proj + ".lora_A.weight", {lora.r, in_out[k].first});
        l.add(proj + ".lora_B.weight", {in_out[k].second, lora.r});
      }
      break;
    }
  }
  return std::move(l.l);
}

ModelSpec ModelSpec::with_lora(std::string_view text, std::string_view source) const {
  ModelSpec s = *this;
  s.lora = LoraSpec::parse(text, source);
  STRIDER_CHECK(!s.lora.enabled() || !tie_embeddings || s.lora.train.empty(),
                "{}: LoRA train={}: {} ties its embedding and LM head; training either in full beside adapters "
                "is not supported for tied embeddings", source, fmt::join(s.lora.train, "+"), arch_name);
  STRIDER_CHECK(!s.lora.enabled() || !dims.moe.sparse(),
                "{}: LoRA on {}, a mixture-of-experts model, is not supported yet (its experts are trained in full)",
                source, arch_name);
  STRIDER_CHECK(!s.lora.enabled() || !dims.fused_projections,
                "{}: LoRA on {}'s fused projections (qkv_proj, gate_up_proj) is not supported yet", source, arch_name);
  s.dims.lora_scale = s.lora.enabled() ? s.lora.scale() : 0;
  return s;
}

double ModelSpec::attention_flops(int64_t layer, int64_t batch, int64_t seq, bool packed, int64_t token_tile) const {
  const BlockDims ld = layer_dims(layer);
  const double s = double(seq);
  // Every tile's queries by the keys it reads, a window before its first
  // query (or from the start) up to its last.
  auto tiles = [&](int64_t tile) {
    double pairs = 0;
    for (int64_t t0 = 0; t0 < seq; t0 += tile) {
      const int64_t t1 = std::min(seq, t0 + tile);
      const int64_t k0 = ld.sliding_window > 0 ? std::max<int64_t>(0, t0 - ld.sliding_window + 1) : 0;
      pairs += double(t1 - t0) * double(t1 - k0);
    }
    return pairs;
  };
  double pairs = s * s / 2;  // causal: is_causal's kernels skip the blocks above the diagonal
  if (ld.attn_softcap > 0) pairs = tiles(softcap_query_tile(batch, ld.heads, seq));
  else if (packed || (ld.sliding_window > 0 && seq > ld.sliding_window))
    pairs = tiles(attention_query_tile(ld, batch, seq, token_tile));  // a mask: every block of a tile's keys
  return 2.0 * 2.0 * double(batch) * double(ld.heads) * double(ld.head_dim) * pairs;
}

BlockCost ModelSpec::cost(int64_t i, int64_t batch, int64_t seq, int64_t vocab_chunk, int dtype_bytes,
                          int64_t token_tile, const WorkCoefficients& work, bool packed) const {
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
      // One vocabulary shard's visit (engine/placement/pieces.h): forward gathers the
      // rows of its tokens, backward their gradient (cast to fp32) and sums
      // them per distinct token (fp32, at most min(tokens, vocab) rows) before
      // the index_add (gpu/blocks/blocks.h); ids, masks, positions and the distinct
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
      const BlockDims ld = layer_dims(block(i).layer);
      const double proj = 2.0 * t * d.hidden * (2.0 * double(q) + 2.0 * double(kv));
      const double attn = attention_flops(block(i).layer, batch, seq, packed, token_tile);
      // A layer with experts: the router, and top_k experts' SwiGLU per token,
      // with a shared expert's and its gate (FLOPs by the active parameters;
      // bytes and the optimizer's work are by all of them).
      const MoeDims& moe = ld.moe;
      const double mlp = moe.sparse() ? 2.0 * t * d.hidden * double(moe.experts + (moe.shared_intermediate > 0)) +
                                            2.0 * 3.0 * t * d.hidden *
                                                double(moe.intermediate * moe.top_k + moe.shared_intermediate)
                                      : 2.0 * 3.0 * t * d.hidden * d.intermediate;
      // LoRA: each adapter's two thin GEMMs, x A^T and (x A^T) B^T.
      double adapters = 0;
      const double in_out[] = {double(d.hidden + q), double(d.hidden + kv), double(d.hidden + kv),
                               double(q + d.hidden), double(d.hidden + d.intermediate),
                               double(d.hidden + d.intermediate), double(d.intermediate + d.hidden)};
      for (size_t k = 0; k < std::size(kLinearModules); ++k)
        if (lora.targets_module(kLinearModules[k])) adapters += 2.0 * t * double(lora.r) * in_out[k];
      c.forward_flops = proj + attn + mlp + adapters;
      // Full training: every input and weight gradient (2x the forward). A
      // frozen base (LoRA): the input gradients only (the projections' and
      // the MLP's once, the attention core's twice), and the adapters' x A^T
      // again, dB, du, dA and du A (2.5x theirs).
      c.backward_flops = lora.enabled() ? proj + mlp + 2.0 * attn + 2.5 * adapters : 2.0 * c.forward_flops;
      // Post-norms: their backward recomputes o_proj's and down_proj's outputs.
      if (d.norm_placement != NormPlacement::kPre) c.backward_flops += 2.0 * t * d.hidden * (double(q) + d.intermediate);
      // What a kept layer's backward computes again: the experts' forward
      // (gpu/blocks/moe.h), and soft-capped attention's core (gpu/blocks/attention.h;
      // any other core's backward runs from its kept output and log-sum-exp).
      if (moe.sparse()) c.backward_recompute_flops += mlp;
      if (ld.attn_softcap > 0) c.backward_recompute_flops += attn;
      const LayerWork w = layer_work(ld, batch, seq, token_tile, dtype_bytes, work, packed);
      c.forward_work_bytes = bytes(w.forward, "forward working memory");
      c.backward_work_bytes = bytes(w.backward, "backward working memory");
      break;
    }
    case BlockKind::kHead: {
      // One launch of the streamed head (gpu/blocks/chunked_loss.h) on a token tile
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
      // Gemma 2's soft-capped logits: pass 2 keeps the cap's derivative, [t, c] fp32, beside.
      const i128 capped = d.final_softcap > 0 ? 4 * tt * ch : 0;
      const i128 grad = normed + capped + std::max<i128>(12 * tt * ch, (4 + below * e) * tt * ch +
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

}  // namespace strider
