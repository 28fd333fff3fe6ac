// A mixture-of-experts MLP (gpu/blocks/block_dims.h, MoeDims) with ATen: the
// router, the experts over the tokens routed to each, and its backward, as
// transformers' Qwen3-MoE, Qwen2-MoE and Mixtral compute them (Qwen2-MoE's
// shared expert, on every token and weighted by its sigmoid gate, is added
// after the routed experts, as its reference adds it). Called by the decoder
// layer (gpu/blocks/blocks.cpp) on the post-attention norm's output, tile by tile.
//
// Routing is fp32: the router's logits (a GEMM in the compute dtype) go
// through softmax in fp32, and each token's top_k experts are picked from
// those probabilities (so a bf16 run routes as an fp32 one, ties aside).
// Tokens are grouped by expert, each expert's in token order, and the
// experts' GEMMs run on their groups in one call of ATen's grouped GEMM
// (at::_grouped_mm; a GEMM per expert where it does not take the operands:
// fp32 on CUDA, rows that are not 16-byte multiples). An expert no token of
// the tile routes to is not computed and gets no gradient; each expert's
// weight gradient is its own GEMM. On the CPU below fp32 each expert's rows
// are padded with zero rows to a bucket, so that oneDNN meets few GEMM
// shapes (moe.cpp, Groups). The experts' outputs are added into each token's
// row in expert order (their gradients into d(loss)/dh in the reverse
// order), through k places per token, not an index_add_ of rows that share
// tokens: the same bits on every run, CUDA's atomics included.
// gpu/blocks/moe_cut.h cuts the MLP into its router and groups of experts.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "gpu/blocks/blocks.h"

namespace strider {

// What a micro-batch's sparse layers share for the load-balancing loss
// (docs/moe.md, "How the engine runs them"): `stats`, fp32 [2, experts], row 0
// each expert's top-k assignments, row 1 its router probabilities summed over
// the tokens. Each forward adds its tokens' into it; each backward, given the
// loss's weight `aux_scale` (0: it is not in this step) and the micro-batch's
// router rows (its tokens x its sparse layers), adds the loss's gradient
// (moe_aux_grad) to the router's. An undefined `stats`: no such loss.
// `valid`, where defined, is fp32 [tokens] of 0 and 1, aligned with h: a 0 is
// padding (attention mask 0), which transformers leaves out of the loss, so
// its token adds nothing to the statistics and gets no gradient from the
// loss; `rows` then counts only the valid tokens. Undefined: every token
// counts (the bits of a batch without padding do not depend on it).
// `routes`, where given, receives each forward's routing: its tokens' chosen
// experts, int64 [tokens, top_k] as top-k orders them (a tool for tests: how
// bf16 routes against fp32).
struct MoeStep {
  at::Tensor stats;
  double aux_scale = 0;
  double rows = 0;
  at::Tensor valid;
  std::vector<at::Tensor>* routes = nullptr;
  // The same step for tokens [t0, t1) of h (a layer's tile).
  MoeStep tile(int64_t t0, int64_t t1) const {
    MoeStep s = *this;
    if (valid.defined()) s.valid = valid.slice(0, t0, t1);
    return s;
  }
};

// The MLP's output for h ([tokens, hidden], the normed residual stream), in
// h's dtype. Adds the routing statistics into step->stats where given.
at::Tensor moe_forward(const BlockDims& d, const TensorMap& w, const at::Tensor& h, const MoeStep* step = nullptr);

// Back-propagates gy = d(loss)/d(output) through moe_forward(h): adds the
// router's and the experts' gradients into `grads` (fp32 accumulators under
// the weights' names; one that is missing is not computed) and returns
// d(loss)/dh. The routing is recomputed from h (the forward's bits).
at::Tensor moe_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const at::Tensor& h,
                        const at::Tensor& gy, const MoeStep* step = nullptr);

// The load-balancing loss of one micro-batch from its statistics over
// `rows` router rows (its tokens times its sparse layers), as transformers'
// load_balancing_loss_func computes it: experts x sum over e of
// (assignments_e / rows) x (probabilities_e / rows). A 0-dim fp32 tensor; 0
// for no rows (a micro-batch of padding only, where transformers' 0/0 gives
// NaN).
at::Tensor moe_aux_loss(const at::Tensor& stats, double rows);
// Its gradient with respect to each token's probability of expert e, times
// `scale` (the loss's weight in the step): fp32 [experts].
at::Tensor moe_aux_grad(const at::Tensor& stats, double rows, double scale);

}  // namespace strider
