// The model blocks of Llama-family decoders, computed with ATen on whatever
// device the tensors live on (CPU device or CUDA). Parameters are views of a
// cache unit's memory; nothing here copies or owns them. Gradients are added
// into fp32 accumulators (views of the unit's gradient area), so several
// micro-batches accumulate in place.
//
// Weights and gradient accumulators are looked up by the checkpoint's tensor
// name with the block prefix removed: "self_attn.q_proj.weight",
// "input_layernorm.weight", "mlp.down_proj.weight", ... ("weight" alone for the
// embedding; "norm.weight" and "lm_head.weight" for the head).
//
// LoRA (engine/model/lora.h): a linear layer whose weights include
// "<proj>.lora_A.weight" [r, in] and "<proj>.lora_B.weight" [out, r] adds
// BlockDims::lora_scale * (x A^T) B^T to x W^T, as PEFT's lora.Linear does.
// A tensor with no gradient accumulator is frozen: its gradient is not
// computed (the input's still is).
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>

#include "gpu/blocks/block_dims.h"

namespace strider {

using TensorMap = std::map<std::string, at::Tensor, std::less<>>;

// cos/sin tables for positions [0, seq), shape [seq, rotary dim] (the head's
// features RoPE rotates: RopeDims::rotary_dim), in `dtype`, computed as
// transformers computes them (fp32 frequencies, then cast).
struct RopeTables {
  at::Tensor cos, sin;
};
// `longest`: the sequence length that picks longrope's factors (transformers:
// the largest position + 1); -1 for seq.
RopeTables rope_tables(const RopeDims& rope, int64_t head_dim, int64_t seq, at::ScalarType dtype,
                       at::Device device, int64_t longest = -1);

// Where a micro-batch's tokens sit: the RoPE rows of their positions and,
// where a row packs several documents, the document of each token. Attention
// stays within a document (block-diagonal, causal inside), as transformers'
// masks do for packed position_ids.
struct TokenLayout {
  TokenLayout(RopeTables r, at::Tensor d = {}) : rope(std::move(r)), docs(std::move(d)) {}  // NOLINT: implicit
  RopeTables rope;  // [s, rotary dim] (every row at positions 0..s-1) or [b, s, rotary dim]
  at::Tensor docs;  // [b, s] int64, each token's document in its row; undefined: one document per row
};
// The layout of rows at `positions` ([b, s] int64 on the tables' device, each
// below the tables' length; each document's positions count from where it
// starts, as packed position_ids do): the tables' rows at those positions,
// and a new document wherever a position is not its predecessor's + 1
// (transformers' find_packed_sequence_indices).
TokenLayout token_layout(const RopeTables& tables, const at::Tensor& positions);

// RMSNorm as transformers computes it: normalise in fp32, then apply the
// weight as `kind` says (BlockDims::norm; Llama's: cast back, then scale).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, NormKind kind = NormKind::kLlama);

// The embedding's output scale for weights of `dtype`: BlockDims::
// embedding_multiplier, rounded to `dtype` where the model says so (Gemma).
double embedding_scale(const BlockDims& d, at::ScalarType dtype);

// Embedding: ids [b, s] (int64) -> [b, s, hidden], times `scale`
// (embedding_scale; 1: the rows as they are).
at::Tensor embedding_forward(const at::Tensor& weight, const at::Tensor& ids, double scale);
// Adds d(loss)/d(weight) for this micro-batch into grad_weight (fp32): each
// token's rows summed first, then added to its row once (so micro-batches add
// as data-parallel ranks do). `pad` (>= 0): the padding token, whose row gets
// no gradient (torch's padding_idx; BlockDims::pad_token).
void embedding_backward(const at::Tensor& ids, const at::Tensor& grad_out, at::Tensor& grad_weight, double scale,
                        int64_t pad = -1);
// One vocabulary shard of the embedding, rows [v0, v0 + rows.size(0)): writes
// the rows of `out` ([b, s, hidden]) whose ids fall in the shard and leaves the
// others as they are; over all shards, out equals embedding_forward's.
void embedding_shard_forward(const at::Tensor& rows, int64_t v0, const at::Tensor& ids, const at::Tensor& out,
                             double scale);
// Adds d(loss)/d(rows) of the shard's ids into grad_rows (fp32), the tokens in
// order, as embedding_backward sums them for these rows.
void embedding_shard_backward(const at::Tensor& ids, int64_t v0, const at::Tensor& grad_out,
                              const at::Tensor& grad_rows, double scale, int64_t pad = -1);

// What a decoder layer's backward needs of its forward besides the input x:
// the outputs of its projections, one micro-batch's, as [tokens, features]
// views in the compute dtype: q, k, v before the q/k norms and RoPE, the
// attention core's output (o_proj's input), x1 = x + attention (the residual
// stream between the halves), and the MLP's gate and up projections; and
// the attention kernel's log-sum-exp, fp32 (tokens x heads values, first in
// the buffer). With them a backward recomputes no matmul and no attention
// core: only the norms, RoPE and silu(gate) * up; it calls the attention
// kernel's backward itself (gpu/blocks/attention.h, where that kernel has one:
// elsewhere it rebuilds the core). A layer with soft-capped attention
// (Gemma 2) keeps no core output or log-sum-exp (undefined): its backward
// rebuilds the core.
struct LayerSaved {
  at::Tensor lse, q, k, v, attn, x1, gate, up;
};
// Elements of one micro-batch's LayerSaved for `tokens` tokens (b * s) in a
// compute dtype of `dtype_bytes` bytes.
int64_t layer_saved_elems(const BlockDims& d, int64_t tokens, int64_t dtype_bytes);
// Views of a flat 1-D tensor of at least layer_saved_elems elements (its
// first element 4-byte aligned), in the order lse, q, k, v, attn, x1, gate,
// up (one copy moves them all).
LayerSaved layer_saved_views(const BlockDims& d, int64_t tokens, const at::Tensor& flat);

// Decoder layer: x [b, s, hidden] -> [b, s, hidden], no autograd.
//
// token_tile > 0 runs the layer over tiles of that many tokens (of the b *
// s, in order): the input norm and the q/k/v projections, o_proj and the
// residual, the post-attention norm and the MLP, so that one tile's [tile,
// intermediate] intermediates are alive at a time; and the attention core
// in query tiles of token_tile / b positions (attention_query_tile; K and V
// whole, gpu/blocks/attention.h). 0 (or a tile of at least b * s tokens) runs them
// on all tokens at once. Either way the working memory is O(b * s * hidden)
// (SDPA's flash kernels, grouped K/V read in place), with smaller
// coefficients tiled. A tiled layer equals the untiled one up to summation
// order (its GEMMs see fewer rows, a tile's attention is merged from two
// kernel calls).
//
// `save` (views from layer_saved_views) receives what the backward needs;
// the output is the same bits with or without it.
//
// A layer with experts (d.moe, gpu/blocks/moe.h) runs its MLP through moe_forward;
// its LayerSaved keeps no gate or up (its backward recomputes the MLP), and
// `moe` receives the layer's routing statistics.
struct MoeStep;
at::Tensor layer_forward(const BlockDims& d, const TensorMap& w, const TokenLayout& layout,
                         const at::Tensor& x, int64_t token_tile, const LayerSaved* save = nullptr,
                         const MoeStep* moe = nullptr);
// Back-propagates grad_out through the layer whose input was x, adds every
// parameter gradient into `grads` (fp32, same names as `w`) and returns
// d(loss)/dx. `saved` (what layer_forward saved for this x) spares the
// projections; without it they are recomputed from x by the forward's own
// ops, tile by tile, so the two give the same bits. In parts, so that no
// moment holds the whole layer's weight gradients: each MLP tile (token_tile
// as above) is back-propagated and its weight gradients added, then
// attention. Matmul gradients are explicit GEMMs; autograd differentiates
// only the element-wise parts and the attention core.
// A layer with experts back-propagates its MLP through moe_backward, with
// the load-balancing loss's gradient `moe` gives.
at::Tensor layer_backward(const BlockDims& d, const TensorMap& w, const TokenLayout& layout,
                          const at::Tensor& x, const at::Tensor& grad_out, TensorMap& grads,
                          int64_t token_tile, const LayerSaved* saved = nullptr, const MoeStep* moe = nullptr);

}  // namespace strider
