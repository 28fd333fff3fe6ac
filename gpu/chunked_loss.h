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

#include "gpu/blocks.h"

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
  at::Tensor norm;     // fp32 accumulators
  at::Tensor lm_head;
};

// Loss only (evaluation).
HeadResult head_loss(const BlockDims& d, const HeadWeights& w, const at::Tensor& x,
                     const at::Tensor& labels, int64_t vocab_chunk, Scalars scalars = Scalars::kToHost);

// Loss and gradients: adds into `grads`, returns grad_input.
HeadResult head_loss_backward(const BlockDims& d, const HeadWeights& w, const at::Tensor& x,
                              const at::Tensor& labels, int64_t vocab_chunk, double loss_scale,
                              HeadGrads& grads, Scalars scalars = Scalars::kToHost);

}  // namespace strider
