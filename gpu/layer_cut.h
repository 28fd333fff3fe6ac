// A decoder layer cut into sub-layer pieces (engine/README.md, "Sub-layer
// pieces"): the attention half (its norms, projections and the residual),
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
// Layers whose MLP has a post-norm (OLMo 2, Gemma), experts, or LoRA
// adapters are refused: their MLP output is not a sum of slices' outputs
// (a post-norm), or is cut another way (experts: expert pieces).
#pragma once

#include <ATen/ATen.h>

#include "gpu/blocks.h"

namespace strider {

// Refuses, naming the layer's kind, a layer that cannot be cut this way.
void check_cuttable(const BlockDims& d, const TensorMap& w);

// The attention half's forward for x [b, s, hidden]: x1 = x + attention(x)
// and h2 = the MLP's input (post-attention norm of x1), both [b, s, hidden]
// in the compute dtype, tiles as layer_forward's (gpu/blocks.h).
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

}  // namespace strider
