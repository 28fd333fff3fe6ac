// A mixture-of-experts MLP (gpu/blocks/moe.h) cut into its router and groups of
// experts, for a layer whose experts are visits of their own: the router
// runs once per tile and hands its routing to every group; each group adds
// its experts' weighted outputs into the layer's sum, and in backward its
// share of d(loss)/dh and of d(loss)/d(score); the router's backward then
// takes the scores' gradients through top-k and the softmax.
//
// The bits do not depend on the cut: moe_forward and moe_backward are these
// functions over one group of every expert. A token's experts add into its
// row one choice rank at a time, ranks in expert order (moe.cpp,
// add_by_token); a group adds +0 at the ranks of experts it does not hold,
// which leaves a sum exactly as it was (a sum that starts at +0 is never
// -0), so groups of ascending experts, each added in turn, give the whole
// layer's sum. Backward adds a token's d(loss)/dh in the reverse order, so
// its groups come in reverse, as a step's backward visits pieces.
//
// A group's expert tensors (mlp.experts.gate_up_proj [E, 2I, H] and
// mlp.experts.down_proj [E, H, I]) and their gradients may hold every
// expert or exactly the group's [e0, e1) (a cache unit's piece).
#pragma once

#include <ATen/ATen.h>

#include "gpu/blocks/moe.h"

namespace strider {

// One tile's routing: its tokens' top_k experts, int64 [tokens, top_k] by
// falling probability, and their weights [tokens, top_k] (fp32, or the
// compute dtype: MoeDims::scores_fp32).
struct MoeRoute {
  at::Tensor top, scores;
};

// The router on h ([tokens, hidden], the post-attention norm's output):
// fp32 softmax and top-k, as moe_forward routes. Adds the tile's routing
// statistics into step->stats where given (call it once per tile and
// forward; a backward's recompute passes no step).
MoeRoute moe_route(const BlockDims& d, const TensorMap& w, const at::Tensor& h, const MoeStep* step = nullptr);

// Experts [e0, e1) on the tokens routed to them: adds their outputs, weighted
// by the scores, into out ([tokens, hidden], h's dtype; +0 where the layer's
// sum starts).
void moe_experts_forward(const BlockDims& d, const TensorMap& w, int64_t e0, int64_t e1, const at::Tensor& h,
                         const MoeRoute& r, at::Tensor& out);

// Their backward for gy = d(loss)/d(output): the experts' weight gradients
// into `grads` (fp32; one that is missing is not computed), their share of
// d(loss)/dh added into dh (h's dtype, +0 where it starts; the groups in
// descending order), and
// d(loss)/d(score) of their (token, choice) pairs written into dscores (fp32
// [tokens x top_k], zeros where it starts: every pair is some group's).
void moe_experts_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, int64_t e0, int64_t e1,
                          const at::Tensor& h, const at::Tensor& gy, const MoeRoute& r, at::Tensor& dh,
                          at::Tensor& dscores);

// Qwen2-MoE's shared expert, after every group: its output (to add into the
// sum last), and its backward (after every group's, before the router's):
// its weights' gradients into `grads`, d(loss)/dh added into dh.
at::Tensor moe_shared_forward(const BlockDims& d, const TensorMap& w, const at::Tensor& h);
void moe_shared_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const at::Tensor& h,
                         const at::Tensor& gy, at::Tensor& dh);

// The router's backward, last: the routing again from h with autograd,
// d(loss)/d(score) (and the load-balancing loss's gradient, as moe_backward
// adds it) back to the logits, the router's gradient into `grads`, and its
// share of d(loss)/dh added into dh.
void moe_router_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const at::Tensor& h,
                         const at::Tensor& dscores, at::Tensor& dh, const MoeStep* step = nullptr);

}  // namespace strider
