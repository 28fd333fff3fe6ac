// A decoder layer cut into sub-layer pieces (docs/pieces.md,
// "Sub-layer pieces"): the attention half (its norms, projections and the residual),
// then the MLP in slices along its intermediate dimension. Each slice has
// its own weights, so that a layer larger than a cache unit allows runs as
// several visits, each holding one piece:
//   slice j of [i0, i1):  mlp.gate_proj.weight  [i1 - i0, hidden]  (rows of gate_proj)
//                         mlp.up_proj.weight    [i1 - i0, hidden]  (rows of up_proj)
//                         mlp.down_proj.weight  [hidden, i1 - i0]  (columns of down_proj)
//                         gate's and up's biases' elements, and down_proj's
//                         bias in the first slice only
// and the attention half the layer's other tensors.
//
// Slice j's output is a partial sum, down_j(act(gate_j h2) * up_j h2); the
// layer's output is x1 + (the slices' sum, rounded to the compute dtype).
// The sum, and in backward the sum of the slices' input gradients, are fp32
// [tokens, hidden] buffers the caller holds per micro-batch, and the MLP's
// input h2 (after the attention residual and the post-attention norm) is
// the checkpoint each slice's backward recomputes from. One slice gives the
// uncut layer's bits (the sums are exact); several change the order of the
// MLP's additions, so they agree with it to fp32 rounding
// (tests/gpu/layer_cut_test.cpp).
//
// A layer with experts is cut instead into its attention-and-router half
// and groups of experts (gpu/blocks/moe_cut.h; the MoeCut functions below), which
// give the uncut layer's bits.
//
// Layers whose MLP has a post-norm (OLMo 2, Gemma), or LoRA adapters, are
// refused: their MLP output is not a sum of pieces' outputs (a post-norm).
#pragma once

#include <ATen/ATen.h>

#include "gpu/blocks/blocks.h"

namespace strider {

// Refuses, naming the layer's kind, a layer that cannot be cut into MLP
// slices (check_cuttable) or into groups of experts (check_moe_cuttable).
void check_cuttable(const BlockDims& d, const TensorMap& w);
void check_moe_cuttable(const BlockDims& d, const TensorMap& w);

// The attention half's forward for x [b, s, hidden]: x1 = x + attention(x)
// and h2 = the MLP's input (post-attention norm of x1), both [b, s, hidden]
// in the compute dtype, tiles as layer_forward's (gpu/blocks/blocks.h).
struct AttentionHalf {
  at::Tensor x1, h2;
};
AttentionHalf attention_half_forward(const BlockDims& d, const TensorMap& w, const TokenLayout& layout,
                                     const at::Tensor& x, int64_t token_tile);

// Adds one MLP slice's partial output for the MLP input h2 into `sum`
// (fp32, h2's shape), tile by tile.
void mlp_slice_forward(const BlockDims& d, const TensorMap& w, const at::Tensor& h2, const at::Tensor& sum,
                       int64_t token_tile);

// The layer's output: x1 + the slices' `sum`, rounded to x1's dtype (times
// Granite's residual_multiplier).
at::Tensor mlp_slices_output(const BlockDims& d, const at::Tensor& x1, const at::Tensor& sum);

// One slice's backward from the MLP input h2 (the forward's) and the
// layer's output gradient grad_out: its weight gradients added into `grads`
// (fp32), and its share of d(loss)/d(h2) into `dh2_sum` (fp32, h2's shape).
void mlp_slice_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const at::Tensor& h2,
                        const at::Tensor& grad_out, const at::Tensor& dh2_sum, int64_t token_tile);

// The attention half's backward for the layer's input x: from the slices'
// summed d(loss)/d(h2) and the layer's output gradient (the residual), adds
// the half's parameter gradients into `grads` and returns d(loss)/dx. The
// attention is recomputed from x, as layer_backward's.
at::Tensor attention_half_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const TokenLayout& layout,
                                   const at::Tensor& x, const at::Tensor& grad_out, const at::Tensor& dh2_sum,
                                   int64_t token_tile);

// A layer with experts, cut: what its pieces keep per micro-batch besides
// x1 and h2. The routing of every token (top: int64 [tokens, top_k]; scores:
// fp32 [tokens, top_k], exact for scores in the compute dtype), and in
// backward d(loss)/d(score) (fp32 [tokens x top_k]); Qwen2-MoE's shared
// expert's output (h2's shape and dtype: the half makes it, the last group
// adds it after every group's, as moe_forward does); `step`, the
// load-balancing loss's (gpu/blocks/moe.h; null: none): its statistics in the
// routing's forward, its gradient in the half's backward. The groups' sum
// and input-gradient sum are in the compute dtype (h2's shape), as the
// uncut layer adds its experts' outputs.
struct MoeCut {
  at::Tensor top, scores, dscores, shared;
  const MoeStep* step = nullptr;
};
// The router on the MLP input h2, tile by tile as layer_forward routes:
// the routing into cut.top and cut.scores, the statistics into cut.step.
void moe_cut_route(const BlockDims& d, const TensorMap& w, const at::Tensor& h2, const MoeCut& cut,
                   int64_t token_tile);
// The shared expert's output on h2 into cut.shared, tile by tile (forward
// only; a layer without one: nothing).
void moe_cut_shared(const BlockDims& d, const TensorMap& w, const at::Tensor& h2, const MoeCut& cut,
                    int64_t token_tile);
// Experts [e0, e1) (their tensors the group's or every expert's) on their
// tokens, tile by tile, added into `sum` (zeros where the layer's starts).
void moe_group_forward(const BlockDims& d, const TensorMap& w, int64_t e0, int64_t e1, const at::Tensor& h2,
                       const MoeCut& cut, const at::Tensor& sum, int64_t token_tile);
// The layer's output, x1 + the groups' sum (the shared expert's output added
// into it first, where there is one: `shared`).
at::Tensor moe_groups_output(const BlockDims& d, const at::Tensor& x1, const at::Tensor& sum,
                             const at::Tensor& shared = {});
// A group's backward (groups in descending order): its weight gradients into
// `grads`, its share of d(loss)/d(h2) into dh2_sum (zeros where the first
// starts), its pairs' d(loss)/d(score) into cut.dscores.
void moe_group_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, int64_t e0, int64_t e1,
                        const at::Tensor& h2, const at::Tensor& grad_out, const MoeCut& cut,
                        const at::Tensor& dh2_sum, int64_t token_tile);
// The attention-and-router half's backward: attention_half_backward's, with
// the shared expert's backward and then the router's (from cut.dscores, and
// the load-balancing loss's gradient) added into d(loss)/d(h2) first, as the
// uncut layer adds them.
at::Tensor moe_half_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const TokenLayout& layout,
                             const at::Tensor& x, const at::Tensor& grad_out, const at::Tensor& dh2_sum,
                             const MoeCut& cut, int64_t token_tile);

}  // namespace strider
