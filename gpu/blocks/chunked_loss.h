// The head block: final RMSNorm, LM head and cross-entropy, computed in
// vocabulary chunks so that the [tokens, vocab] logits never exist at once.
//
// Pass 1 walks the chunks for each token's log-sum-exp (running max and sum)
// and target logit; pass 2 walks them again for softmax - onehot, from which
// the hidden state's gradient and the head weight's gradient both come. The
// norm's backward then runs through autograd.
//
// Labels use -100 for "no loss here". The loss is a sum; the caller divides by
// the number of valid tokens of the whole step (all micro-batches), which it
// passes in as `loss_scale` = 1 / valid_tokens so gradients match that mean.
#pragma once

#include <ATen/ATen.h>

#include "gpu/blocks/blocks.h"

namespace strider {

struct HeadResult {
  double loss_sum = 0;       // sum over valid tokens of -log p(label)
  int64_t valid_tokens = 0;  // labels != -100
  at::Tensor grad_input;     // d(loss_scale * loss_sum)/d(input); undefined in eval
  // The same two figures as 0-dim tensors on the input's device (float64).
  // With Scalars::kOnDevice only these are set: reading a number back to the
  // host waits for the device, which would stall the thread that enqueues work.
  at::Tensor loss_sum_dev, valid_tokens_dev;
};

enum class Scalars {
  kToHost,    // loss_sum / valid_tokens read back, labels checked (a device sync)
  kOnDevice,  // only the tensors; the caller has checked the labels
};

struct HeadWeights {
  at::Tensor norm;     // [hidden]
  at::Tensor lm_head;  // [vocab, hidden]; the embedding's weight when tied
};
struct HeadGrads {
  at::Tensor norm;     // fp32 accumulators; undefined: frozen, its gradient not computed
  at::Tensor lm_head;
};

// Loss only (evaluation).
HeadResult head_loss(const BlockDims& d, const HeadWeights& w, const at::Tensor& x,
                     const at::Tensor& labels, int64_t vocab_chunk, Scalars scalars = Scalars::kToHost,
                     int64_t token_tile = 0);

// Loss and gradients: adds into `grads`, returns grad_input.
HeadResult head_loss_backward(const BlockDims& d, const HeadWeights& w, const at::Tensor& x,
                              const at::Tensor& labels, int64_t vocab_chunk, double loss_scale,
                              HeadGrads& grads, Scalars scalars = Scalars::kToHost, int64_t token_tile = 0);

// The same computation streamed over vocabulary shards, for a head whose LM
// weight never sits on the device whole (engine/placement/pieces.h). For each
// micro-batch: head_lse_shard over every shard in vocabulary order (pass 1),
// head_lse and head_loss_sums, then head_grad_shard over every shard in the
// same order (pass 2), then head_norm_backward. head_loss and
// head_loss_backward are this with one shard, so both paths compute the same
// bits.
//
// `x` is the head's input, [tokens, hidden]; the final norm is recomputed from
// it where needed (cheap next to the logits, and nothing [tokens, hidden]
// stays alive between shards). A shard's rows are `w_rows` = lm_head rows
// [v0, v0 + w_rows.size(0)); `chunk` rows per logits matmul (chunks restart at
// v0: shards fall on chunk boundaries). `token_tile` > 0 processes that many
// tokens at a time, so the working memory is token_tile x (chunk + hidden)
// rather than tokens x (chunk + hidden); the weight gradients are then summed
// tile by tile (equal to fp32 rounding, not bit for bit).
struct HeadState {
  at::Tensor run_max, run_sum, target;  // fp32 [tokens] each
};
// Fresh state in caller-owned fp32 [tokens] buffers: -inf, 0, 0.
void head_state_reset(HeadState& st);
//
// `keep` ([tokens, w_rows.size(0)], the compute dtype; may be a strided view
// of a [tokens, vocab] buffer) receives the shard's logits as the GEMM wrote
// them, so that pass 2 can take them instead of computing them again: the
// same bits, one logits GEMM of three less.
void head_lse_shard(const BlockDims& d, const at::Tensor& norm, const at::Tensor& x, const at::Tensor& w_rows,
                    int64_t v0, const at::Tensor& labels, int64_t chunk, int64_t token_tile, HeadState& st,
                    const at::Tensor& keep = {});
// After pass 1: the per-token log-sum-exp (a new fp32 [tokens] tensor), and
// the micro-batch's loss sum and valid-token count written into 0-dim float64
// tensors on the device.
at::Tensor head_lse(const HeadState& st);
void head_loss_sums(const HeadState& st, const at::Tensor& lse, const at::Tensor& labels, at::Tensor& loss_sum,
                    at::Tensor& valid_tokens);
// Pass 2 over one shard: adds d(loss_scale * loss)/dh (h the normed input)
// into grad_h (fp32 [tokens, hidden]) and the rows' gradient into grad_rows
// (fp32, like w_rows; undefined: frozen rows, no gradient computed).
// `kept`: what pass 1 wrote into `keep` for this shard (the logits are not
// computed again). `coef` (fp32 [tokens]): an objective's per-token
// coefficients (gpu/blocks/objective.h: -d(loss)/d(log p), times the loss
// scale) in place of cross-entropy's loss_scale on each valid token.
void head_grad_shard(const BlockDims& d, const at::Tensor& norm, const at::Tensor& x, const at::Tensor& w_rows,
                     int64_t v0, const at::Tensor& labels, int64_t chunk, int64_t token_tile, const at::Tensor& lse,
                     double loss_scale, const at::Tensor& grad_h, const at::Tensor& grad_rows,
                     const at::Tensor& kept = {}, const at::Tensor& coef = {});
// The final norm's backward once grad_h is complete: adds into grad_norm
// (fp32; undefined: a frozen norm) and returns d(loss)/dx, [tokens, hidden] (tile by tile with a token
// tile), written into grad_x_out when it is given.
at::Tensor head_norm_backward(const BlockDims& d, const at::Tensor& norm, const at::Tensor& x,
                              const at::Tensor& grad_h, const at::Tensor& grad_norm, int64_t token_tile,
                              const at::Tensor& grad_x_out = {});

}  // namespace strider
