// BlockDims: what a model block's compute needs to know about the model.
// Declared here, filled by engine/'s ModelSpec (gpu/ never includes engine/).
#pragma once

#include <cstdint>
#include <vector>

namespace strider {

// RoPE frequency scaling, as Hugging Face's rope_type names it.
enum class RopeType { kDefault, kLlama3, kLinear, kLongrope };

// How an RMSNorm applies its weight w to the normalised fp32 value n of x:
// Llama's w * cast(n); OLMo 2's cast(w * n), the product in fp32; Gemma's
// cast(n * (1 + w)), in fp32 (its weights are stored as offsets from 1).
enum class NormKind { kLlama, kFp32Weight, kGemma };

// Where a decoder layer's norms sit around its two residual branches
// (attention, MLP): before each (Llama: input_layernorm,
// post_attention_layernorm), after each on the branch's output before it is
// added (OLMo 2: post_attention_layernorm, post_feedforward_layernorm), or
// both (Gemma: input_layernorm, post_attention_layernorm,
// pre_feedforward_layernorm, post_feedforward_layernorm).
enum class NormPlacement { kPre, kPost, kSandwich };

// The MLP's gate activation: act(gate) * up.
enum class Activation { kSilu, kGeluTanh };

struct RopeDims {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;              // kLlama3, kLinear
  double low_freq_factor = 1.0;     // kLlama3
  double high_freq_factor = 4.0;    // kLlama3
  int64_t original_max_position = 8192;  // kLlama3, kLongrope
  // kLongrope (Phi-3.5, Phi-4-mini): each frequency divided by its factor,
  // short_factor's for sequences up to original_max_position, long_factor's
  // past it; cos and sin times attention_factor.
  std::vector<double> short_factor, long_factor;
  double attention_factor = 1.0;
  // RoPE rotates the first partial_rotary of each head's features (Phi-4-mini: 0.75); the rest pass.
  double partial_rotary = 1.0;
  // The features RoPE rotates of a head of head_dim (transformers' int(head_dim * factor)).
  int64_t rotary_dim(int64_t head_dim) const { return int64_t(double(head_dim) * partial_rotary); }
  bool operator==(const RopeDims&) const = default;
};

// A mixture-of-experts MLP (Qwen3-MoE, Mixtral): `experts` SwiGLU experts of
// `intermediate` each, held fused as transformers holds them in memory
// (mlp.experts.gate_up_proj [experts, 2 x intermediate, hidden], gate rows
// first; mlp.experts.down_proj [experts, hidden, intermediate]), and a router
// (mlp.gate.weight [experts, hidden]) whose softmax, in fp32, picks each
// token's top_k. 0 experts: the layer's MLP is dense.
struct MoeDims {
  int64_t experts = 0;
  int64_t top_k = 0;
  int64_t intermediate = 0;
  // The top-k probabilities divided by their sum (Mixtral always;
  // Qwen3-MoE's norm_topk_prob).
  bool norm_topk = false;
  // The experts' outputs are weighted by the fp32 scores (Mixtral); false:
  // by the scores cast to the compute dtype first (Qwen3-MoE).
  bool scores_fp32 = false;
  // Qwen2-MoE's shared expert: a SwiGLU MLP of this intermediate size that
  // every token goes through, its output weighted by sigmoid(h . gate) (0:
  // none).
  int64_t shared_intermediate = 0;
  bool sparse() const { return experts > 0; }
  bool operator==(const MoeDims&) const = default;
};

struct BlockDims {
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate = 0;
  int64_t vocab = 0;
  // pad_token_id: torch's padding_idx of the embedding, whose row gets no
  // gradient from its lookups (transformers builds every embedding so); -1: none.
  int64_t pad_token = -1;
  double rms_eps = 1e-6;
  RopeDims rope;
  bool qkv_bias = false;    // Qwen2, Llama with attention_bias
  bool o_bias = false;      // Llama with attention_bias
  bool mlp_bias = false;    // Llama with mlp_bias
  bool qk_norm = false;     // Qwen3, Gemma 3: RMSNorm over head_dim on q and k
  bool qk_norm_whole = false;  // with qk_norm, OLMo 2's: over the whole projection (heads x head_dim)
  NormKind norm = NormKind::kLlama;
  NormPlacement norm_placement = NormPlacement::kPre;
  Activation act = Activation::kSilu;
  // Phi-3: q, k and v one tensor (self_attn.qkv_proj, their rows in that
  // order), gate and up one (mlp.gate_up_proj); the blocks see their row
  // slices under the separate projections' names (engine/run/block_runner.h).
  bool fused_projections = false;
  // Sliding-window attention: a token attends to itself and the
  // sliding_window - 1 before it (transformers' window); 0: full causal.
  // Per layer: Gemma's global layers have none (ModelSpec::layer_dims).
  int64_t sliding_window = 0;
  // Granite's multipliers (1 and 0 elsewhere): the embedding's output is
  // scaled by embedding_multiplier, the attention scores by attn_scale (0:
  // 1/sqrt(head_dim)), each residual branch (attention, MLP) by
  // residual_multiplier before it is added, and the logits divided by
  // logits_scaling.
  double embedding_multiplier = 1.0;
  // Gemma: the embedding's scale (sqrt(hidden)) is a tensor of the weights'
  // dtype, so rounded to it first (embedding_scale in gpu/blocks/blocks.h).
  bool embedding_multiplier_in_dtype = false;
  double attn_scale = 0.0;
  double residual_multiplier = 1.0;
  double logits_scaling = 1.0;
  // Gemma 2's soft-capping (0: none): the attention scores become
  // attn_softcap * tanh(scores / attn_softcap) before the mask
  // (gpu/blocks/softcap_attention.h), and the logits final_softcap * tanh(logits /
  // final_softcap) after logits_scaling.
  double attn_softcap = 0;
  double final_softcap = 0;
  // LoRA: a linear layer whose block holds "<proj>.lora_A.weight" and
  // "<proj>.lora_B.weight" adds lora_scale * (x A^T) B^T (engine/model/lora.h).
  double lora_scale = 0;
  // This layer's experts (ModelSpec::layer_dims: none in a dense layer of a
  // mixture-of-experts model).
  MoeDims moe;
  // Every member, so that a training checkpoint's record of the model
  // (engine/checkpoint/) compares a member added later without listing it.
  bool operator==(const BlockDims&) const = default;
};

// Soft-capped attention's queries per tile (gpu/blocks/softcap_attention.h) for a
// micro-batch of b sequences of s positions over `heads` heads: as many as
// keep one tile's scores at or under 2^22 elements (at least 16, at most s).
int64_t softcap_query_tile(int64_t b, int64_t heads, int64_t s);

// Positions per query tile of a decoder layer's attention core
// (gpu/blocks/attention.h) for b sequences of s positions under a token tile of
// `token_tile` tokens (ComputeOptions; 0: untiled): s (one tile) where the
// layer is untiled (token_tile 0, or at least b * s) or its attention is
// soft-capped (it tiles its scores itself); else token_tile / b, at least 1,
// so that one tile's queries are at most token_tile tokens.
int64_t attention_query_tile(const BlockDims& d, int64_t b, int64_t s, int64_t token_tile);

}  // namespace strider
