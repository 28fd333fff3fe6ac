#include "gpu/blocks/chunked_loss.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <limits>

#include "gpu/blocks/weight_grad.h"
#include "host/error.h"

namespace strider {
namespace {

constexpr int64_t kIgnore = -100;

int64_t chunk_size(const BlockDims& d, int64_t vocab_chunk) {
  return vocab_chunk > 0 ? std::min(vocab_chunk, d.vocab) : d.vocab;
}

void check_labels(const BlockDims& d, const at::Tensor& labels) {
  if (labels.numel() == 0) return;
  at::Tensor bad = (labels != kIgnore) & ((labels < 0) | (labels >= d.vocab));
  STRIDER_CHECK(!bad.any().item<bool>(), "labels hold ids outside [0, {}) that are not -100", d.vocab);
}

// Token tiles [t0, t1) of `tokens`: one tile when token_tile is 0 or covers them.
template <class F>
void for_tiles(int64_t tokens, int64_t token_tile, F&& f) {
  const int64_t step = token_tile > 0 ? token_tile : tokens;
  for (int64_t t0 = 0; t0 < tokens; t0 += step) f(t0, std::min(tokens, t0 + step));
  if (tokens == 0) f(0, 0);
}

// Gemma 2's final soft-capping of a chunk of logits, in place, with
// transformers' ops (/ cap, tanh, * cap) in the logits' dtype.
void softcap_(const BlockDims& d, at::Tensor& logits) {
  if (d.final_softcap > 0) logits.div_(d.final_softcap).tanh_().mul_(d.final_softcap);
}

HeadState fresh_state(const at::Tensor& h) {
  auto f32 = h.options().dtype(at::kFloat);
  HeadState st{at::empty({h.size(0)}, f32), at::empty({h.size(0)}, f32), at::empty({h.size(0)}, f32)};
  head_state_reset(st);
  return st;
}

void set_scalars(const BlockDims& d, const at::Tensor& loss_sum, const at::Tensor& valid, const at::Tensor& labels,
                 Scalars scalars, HeadResult& r) {
  r.loss_sum_dev = loss_sum;
  r.valid_tokens_dev = valid;
  if (scalars == Scalars::kOnDevice) return;
  check_labels(d, labels);
  r.loss_sum = loss_sum.item<double>();
  r.valid_tokens = int64_t(valid.item<double>());
}

}  // namespace

void head_state_reset(HeadState& st) {
  st.run_max.fill_(-std::numeric_limits<float>::infinity());
  st.run_sum.zero_();
  st.target.zero_();
}

void head_lse_shard(const BlockDims& d, const at::Tensor& norm, const at::Tensor& x, const at::Tensor& w_rows,
                    int64_t v0, const at::Tensor& labels, int64_t chunk, int64_t token_tile, HeadState& st,
                    const at::Tensor& keep) {
  at::NoGradGuard no_grad;
  const int64_t rows = w_rows.size(0);
  for_tiles(x.size(0), token_tile, [&](int64_t t0, int64_t t1) {
    at::Tensor ht = rms_norm(x.slice(0, t0, t1), norm, d.rms_eps, d.norm), lab = labels.slice(0, t0, t1);
    at::Tensor run_max = st.run_max.slice(0, t0, t1), run_sum = st.run_sum.slice(0, t0, t1);
    at::Tensor target = st.target.slice(0, t0, t1);
    for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
      const int64_t c1 = std::min(rows, c0 + chunk), a = v0 + c0, b = v0 + c1;
      at::Tensor logits = at::matmul(ht, w_rows.slice(0, c0, c1).t());  // [t, c]
      if (d.logits_scaling != 1.0) logits.div_(d.logits_scaling);  // Granite's
      softcap_(d, logits);
      if (keep.defined()) keep.slice(0, t0, t1).slice(1, c0, c1).copy_(logits);
      logits = logits.to(at::kFloat);
      at::Tensor new_max = at::maximum(run_max, std::get<0>(logits.max(1)));
      run_sum.copy_(run_sum * at::exp(run_max - new_max) + at::exp(logits - new_max.unsqueeze(1)).sum(1));
      run_max.copy_(new_max);
      at::Tensor in_chunk = (lab >= a) & (lab < b);
      at::Tensor idx = (lab - a).clamp(0, c1 - c0 - 1).unsqueeze(1);
      target.copy_(at::where(in_chunk, logits.gather(1, idx).squeeze(1), target));
    }
  });
}

at::Tensor head_lse(const HeadState& st) { return st.run_max + at::log(st.run_sum); }

void head_loss_sums(const HeadState& st, const at::Tensor& lse, const at::Tensor& labels, at::Tensor& loss_sum,
                    at::Tensor& valid_tokens) {
  at::NoGradGuard no_grad;
  at::Tensor valid = labels != kIgnore;
  loss_sum.copy_(at::where(valid, lse - st.target, 0.0f).sum(at::kDouble));
  valid_tokens.copy_(valid.sum(at::kDouble));
}

void head_grad_shard(const BlockDims& d, const at::Tensor& norm, const at::Tensor& x, const at::Tensor& w_rows,
                     int64_t v0, const at::Tensor& labels, int64_t chunk, int64_t token_tile, const at::Tensor& lse,
                     double loss_scale, const at::Tensor& grad_h, const at::Tensor& grad_rows,
                     const at::Tensor& kept, const at::Tensor& coef) {
  at::NoGradGuard no_grad;
  const int64_t rows = w_rows.size(0);
  for_tiles(x.size(0), token_tile, [&](int64_t t0, int64_t t1) {
    at::Tensor ht = rms_norm(x.slice(0, t0, t1), norm, d.rms_eps, d.norm);
    at::Tensor lab = labels.slice(0, t0, t1), lse_t = lse.slice(0, t0, t1);
    at::Tensor gh = grad_h.slice(0, t0, t1);
    // d(scale * sum_t (lse_t - logit_t[label]))/d(logit) = scale * (softmax - onehot), valid rows only;
    // an objective's (gpu/blocks/objective.h) d(loss)/d(log p_t) = -coef_t: coef_t * (softmax - onehot).
    // Granite's logits are the product's over logits_scaling: so are their gradients.
    at::Tensor row_scale = coef.defined() ? coef.slice(0, t0, t1) * (1.0 / d.logits_scaling)
                                          : (lab != kIgnore).to(at::kFloat) * (loss_scale / d.logits_scaling);
    for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
      const int64_t c1 = std::min(rows, c0 + chunk), a = v0 + c0, b = v0 + c1;
      at::Tensor wc = w_rows.slice(0, c0, c1);
      at::Tensor logits;
      if (kept.defined()) {
        logits = kept.slice(0, t0, t1).slice(1, c0, c1).to(at::kFloat);  // pass 1's, scaled and capped
      } else {
        logits = at::matmul(ht, wc.t());
        if (d.logits_scaling != 1.0) logits.div_(d.logits_scaling);
        softcap_(d, logits);
        logits = logits.to(at::kFloat);
      }
      at::Tensor g = at::exp(logits - lse_t.unsqueeze(1));
      // Soft-capped logits y = cap tanh(z / cap): dy/dz = 1 - (y / cap)^2 (out of
      // place: `logits` may be the kept buffer). Then the logits are dead (one
      // [tile, chunk] fp32 less at the peak).
      at::Tensor capped_grad;
      if (d.final_softcap > 0) capped_grad = (logits / d.final_softcap).square_().neg_().add_(1.0);
      logits.reset();
      at::Tensor in_chunk = (lab >= a) & (lab < b);
      at::Tensor idx = (lab - a).clamp(0, c1 - c0 - 1).unsqueeze(1);
      g.scatter_add_(1, idx, -in_chunk.to(at::kFloat).unsqueeze(1));
      g.mul_(row_scale.unsqueeze(1));
      if (capped_grad.defined()) g.mul_(capped_grad);
      at::Tensor gc = g.to(ht.scalar_type());
      gh.add_(at::matmul(gc, wc));
      if (grad_rows.defined()) {
        at::Tensor rows = grad_rows.slice(0, c0, c1);
        add_weight_grad(rows, gc.t(), ht);  // gpu/blocks/weight_grad.h: no rounding to the compute dtype
      }
    }
  });
}

at::Tensor head_norm_backward(const BlockDims& d, const at::Tensor& norm, const at::Tensor& x,
                              const at::Tensor& grad_h, const at::Tensor& grad_norm, int64_t token_tile,
                              const at::Tensor& grad_x_out) {
  at::AutoGradMode enable(true);
  // A frozen norm (grad_norm undefined) is no leaf: no gradient of it is computed.
  const bool trains = grad_norm.defined();
  at::Tensor norm_w = trains ? norm.detach().requires_grad_(true) : norm.detach();
  auto grads_of = [&](const at::Tensor& xin, const at::Tensor& normed, const at::Tensor& g_out) {
    std::vector<at::Tensor> leaves{xin};
    if (trains) leaves.push_back(norm_w);
    std::vector<at::Tensor> g = torch::autograd::grad({normed}, leaves, {g_out});
    if (trains) grad_norm.add_(g[1]);
    return g[0];
  };
  const int64_t tokens = x.size(0);
  if (token_tile <= 0 || token_tile >= tokens) {
    at::Tensor xin = x.detach().requires_grad_(true);
    at::Tensor normed = rms_norm(xin, norm_w, d.rms_eps, d.norm);
    at::Tensor gx = grads_of(xin, normed, grad_h.to(normed.scalar_type()));
    if (!grad_x_out.defined()) return gx;
    grad_x_out.copy_(gx);
    return grad_x_out;
  }
  at::Tensor grad_x = grad_x_out.defined() ? grad_x_out : at::empty_like(x);
  for_tiles(tokens, token_tile, [&](int64_t t0, int64_t t1) {
    at::Tensor xin = x.slice(0, t0, t1).detach().requires_grad_(true);
    at::Tensor normed = rms_norm(xin, norm_w, d.rms_eps, d.norm);
    grad_x.slice(0, t0, t1).copy_(grads_of(xin, normed, grad_h.slice(0, t0, t1).to(normed.scalar_type())));
  });
  return grad_x;
}

HeadResult head_loss(const BlockDims& d, const HeadWeights& w, const at::Tensor& x,
                     const at::Tensor& labels, int64_t vocab_chunk, Scalars scalars, int64_t token_tile) {
  at::NoGradGuard no_grad;
  at::Tensor h = x.reshape({-1, d.hidden});
  at::Tensor lab = labels.reshape({-1});
  HeadState st = fresh_state(h);
  head_lse_shard(d, w.norm, h, w.lm_head, 0, lab, chunk_size(d, vocab_chunk), token_tile, st);
  auto f64 = h.options().dtype(at::kDouble);
  at::Tensor loss_sum = at::empty({}, f64), valid = at::empty({}, f64);
  head_loss_sums(st, head_lse(st), lab, loss_sum, valid);
  HeadResult r;
  set_scalars(d, loss_sum, valid, lab, scalars, r);
  return r;
}

HeadResult head_loss_backward(const BlockDims& d, const HeadWeights& w, const at::Tensor& x,
                              const at::Tensor& labels, int64_t vocab_chunk, double loss_scale,
                              HeadGrads& grads, Scalars scalars, int64_t token_tile) {
  const int64_t chunk = chunk_size(d, vocab_chunk);
  at::Tensor h = x.reshape({-1, d.hidden});
  at::Tensor lab = labels.reshape({-1});
  HeadState st = fresh_state(h);
  head_lse_shard(d, w.norm, h, w.lm_head, 0, lab, chunk, token_tile, st);
  at::Tensor lse = head_lse(st);
  auto f64 = h.options().dtype(at::kDouble);
  at::Tensor loss_sum = at::empty({}, f64), valid = at::empty({}, f64);
  head_loss_sums(st, lse, lab, loss_sum, valid);
  HeadResult r;
  set_scalars(d, loss_sum, valid, lab, scalars, r);
  at::Tensor grad_h = at::zeros(h.sizes(), h.options().dtype(at::kFloat));
  head_grad_shard(d, w.norm, h, w.lm_head, 0, lab, chunk, token_tile, lse, loss_scale, grad_h, grads.lm_head);
  r.grad_input = head_norm_backward(d, w.norm, h, grad_h, grads.norm, token_tile).view(x.sizes());
  return r;
}

}  // namespace strider
