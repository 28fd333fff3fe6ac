#include "gpu/chunked_loss.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <limits>

#include "host/error.h"

namespace strider {
namespace {

constexpr int64_t kIgnore = -100;

// Per-token statistics from pass 1: log-sum-exp and the target's logit (fp32).
struct Pass1 {
  at::Tensor lse, target_logit, valid;
};

int64_t chunk_size(const BlockDims& d, int64_t vocab_chunk) {
  return vocab_chunk > 0 ? std::min(vocab_chunk, d.vocab) : d.vocab;
}

void check_labels(const BlockDims& d, const at::Tensor& labels, const at::Tensor& valid) {
  if (labels.numel() == 0) return;
  at::Tensor bad = valid & ((labels < 0) | (labels >= d.vocab));
  STRIDER_CHECK(!bad.any().item<bool>(), "labels hold ids outside [0, {}) that are not -100", d.vocab);
}

Pass1 pass1(const BlockDims& d, const at::Tensor& h, const at::Tensor& w, const at::Tensor& labels,
            int64_t chunk) {
  const int64_t t = h.size(0);
  auto f32 = h.options().dtype(at::kFloat);
  at::Tensor run_max = at::full({t}, -std::numeric_limits<float>::infinity(), f32);
  at::Tensor run_sum = at::zeros({t}, f32);
  at::Tensor target = at::zeros({t}, f32);
  for (int64_t v0 = 0; v0 < d.vocab; v0 += chunk) {
    const int64_t v1 = std::min(d.vocab, v0 + chunk);
    at::Tensor logits = at::matmul(h, w.slice(0, v0, v1).t()).to(at::kFloat);  // [t, c]
    at::Tensor new_max = at::maximum(run_max, std::get<0>(logits.max(1)));
    run_sum = run_sum * at::exp(run_max - new_max) + at::exp(logits - new_max.unsqueeze(1)).sum(1);
    run_max = new_max;
    at::Tensor in_chunk = (labels >= v0) & (labels < v1);
    at::Tensor idx = (labels - v0).clamp(0, v1 - v0 - 1).unsqueeze(1);
    target = at::where(in_chunk, logits.gather(1, idx).squeeze(1), target);
  }
  return {run_max + at::log(run_sum), target, labels != kIgnore};
}

void set_scalars(const BlockDims& d, const Pass1& p, const at::Tensor& labels, Scalars scalars, HeadResult& r) {
  r.loss_sum_dev = at::where(p.valid, p.lse - p.target_logit, 0.0f).sum(at::kDouble);
  r.valid_tokens_dev = p.valid.sum(at::kDouble);
  if (scalars == Scalars::kOnDevice) return;
  check_labels(d, labels, p.valid);
  r.loss_sum = r.loss_sum_dev.item<double>();
  r.valid_tokens = p.valid.sum().item<int64_t>();
}

}  // namespace

HeadResult head_loss(const BlockDims& d, const HeadWeights& w, const at::Tensor& x,
                     const at::Tensor& labels, int64_t vocab_chunk, Scalars scalars) {
  at::NoGradGuard no_grad;
  at::Tensor h = rms_norm(x, w.norm, d.rms_eps).reshape({-1, d.hidden});
  at::Tensor lab = labels.reshape({-1});
  Pass1 p = pass1(d, h, w.lm_head, lab, chunk_size(d, vocab_chunk));
  HeadResult r;
  set_scalars(d, p, lab, scalars, r);
  return r;
}

HeadResult head_loss_backward(const BlockDims& d, const HeadWeights& w, const at::Tensor& x,
                              const at::Tensor& labels, int64_t vocab_chunk, double loss_scale,
                              HeadGrads& grads, Scalars scalars) {
  const int64_t chunk = chunk_size(d, vocab_chunk);
  at::AutoGradMode enable(true);
  at::Tensor xin = x.detach().requires_grad_(true);
  at::Tensor norm_w = w.norm.detach().requires_grad_(true);
  at::Tensor normed = rms_norm(xin, norm_w, d.rms_eps);
  at::Tensor h = normed.detach().reshape({-1, d.hidden});
  at::Tensor lab = labels.reshape({-1});

  HeadResult r;
  at::Tensor grad_h = at::zeros(h.sizes(), h.options().dtype(at::kFloat));
  {
    at::NoGradGuard no_grad;
    Pass1 p = pass1(d, h, w.lm_head, lab, chunk);
    set_scalars(d, p, lab, scalars, r);
    // d(scale * sum_t (lse_t - logit_t[label]))/d(logit) = scale * (softmax - onehot), valid rows only.
    at::Tensor row_scale = p.valid.to(at::kFloat) * loss_scale;
    for (int64_t v0 = 0; v0 < d.vocab; v0 += chunk) {
      const int64_t v1 = std::min(d.vocab, v0 + chunk);
      at::Tensor wc = w.lm_head.slice(0, v0, v1);
      at::Tensor logits = at::matmul(h, wc.t()).to(at::kFloat);
      at::Tensor g = at::exp(logits - p.lse.unsqueeze(1));
      at::Tensor in_chunk = (lab >= v0) & (lab < v1);
      at::Tensor idx = (lab - v0).clamp(0, v1 - v0 - 1).unsqueeze(1);
      g.scatter_add_(1, idx, -in_chunk.to(at::kFloat).unsqueeze(1));
      g.mul_(row_scale.unsqueeze(1));
      at::Tensor gc = g.to(h.scalar_type());
      grad_h.add_(at::matmul(gc, wc));
      grads.lm_head.slice(0, v0, v1).add_(at::matmul(gc.t(), h));
    }
  }
  std::vector<at::Tensor> g = torch::autograd::grad(
      {normed}, {xin, norm_w}, {grad_h.to(normed.scalar_type()).view(normed.sizes())});
  grads.norm.add_(g[1]);
  r.grad_input = g[0];
  return r;
}

}  // namespace strider
