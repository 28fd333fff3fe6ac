#include "gpu/blocks/objective.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>

namespace strider {
namespace {

at::Tensor logsigmoid(const at::Tensor& x) { return at::log_sigmoid(x); }

// log(1 - exp(x)) for x < 0 without cancellation, as TRL's orpo_trainer.py log1mexp.
at::Tensor log1mexp(const at::Tensor& x) {
  return at::where(x < -0.6931471805599453, at::log1p(-at::exp(x)), at::log(-at::expm1(x)));
}

struct PairRewards {
  at::Tensor loss, chosen, rejected;  // the local loss (a mean over the pairs); the rewards, detached
  at::Tensor logps;                   // the rows' log-probabilities as the objective takes them, detached
  at::Tensor nll, log_odds;           // ORPO's cross-entropy term and log odds ratios, detached
};

// DPO, SimPO and ORPO over the rows' sums (and counts) of log-probabilities:
// rows [0, N) chosen, [N, 2N) rejected.
PairRewards pair_loss(const ObjectiveSettings& o, const at::Tensor& lp, const at::Tensor& m, const ObjectiveBatch& in) {
  const int64_t n = lp.size(0) / 2;
  at::Tensor sums = (lp * m).sum(1), counts = m.sum(1);
  const double beta = o.beta;
  PairRewards r;
  if (o.kind == ObjectiveKind::kDpo) {
    // dpo_trainer.py: chosen/rejected log-ratios against the reference, delta = chosen - rejected.
    at::Tensor ratios = sums - in.row.slice(0, 0, 2 * n);
    at::Tensor c = ratios.slice(0, 0, n), j = ratios.slice(0, n, 2 * n), delta = c - j;
    at::Tensor per;
    switch (o.loss) {
      case ObjectiveLoss::kHinge: per = at::relu(1 - beta * delta); break;
      case ObjectiveLoss::kIpo: {
        // Each log-ratio divided by its completion's length (at least 1).
        at::Tensor len = counts.clamp_min(1.0);
        at::Tensor ipo = c / len.slice(0, 0, n) - j / len.slice(0, n, 2 * n);
        per = (ipo - 1 / (2 * beta)).square();
        break;
      }
      case ObjectiveLoss::kRobust: {
        const double eps = o.label_smoothing;
        per = (-(1 - eps) * logsigmoid(beta * delta) + eps * logsigmoid(-beta * delta)) / (1 - 2 * eps);
        break;
      }
      default: per = -logsigmoid(beta * delta); break;  // sigmoid
    }
    r.loss = per.mean();
    r.chosen = beta * c.detach();
    r.rejected = beta * j.detach();
    r.logps = sums.detach();
    return r;
  }
  // SimPO and ORPO: each row's mean log-probability (cpo/orpo get_batch_logps, average_log_prob).
  at::Tensor avg = sums / counts;
  at::Tensor c = avg.slice(0, 0, n), j = avg.slice(0, n, 2 * n);
  if (o.kind == ObjectiveKind::kSimpo) {
    at::Tensor logits = (c - j) - o.simpo_gamma / beta;
    const double eps = o.label_smoothing;
    r.loss = (-logsigmoid(beta * logits) * (1 - eps) - logsigmoid(-beta * logits) * eps).mean();
  } else {
    // ORPO: the chosen rows' cross-entropy (a mean over their target tokens)
    // minus beta times the mean log-sigmoid of the log odds ratio.
    at::Tensor log_odds = (c - j) - (log1mexp(c) - log1mexp(j));
    at::Tensor nll = -sums.slice(0, 0, n).sum() / counts.slice(0, 0, n).sum();
    r.loss = nll - (beta * logsigmoid(log_odds)).mean();
    r.nll = nll.detach();
    r.log_odds = log_odds.detach();
  }
  r.chosen = beta * c.detach();
  r.rejected = beta * j.detach();
  r.logps = avg.detach();
  return r;
}

}  // namespace

at::Tensor objective_grad(const ObjectiveSettings& o, const at::Tensor& logp, const at::Tensor& mask,
                          const ObjectiveBatch& in, const at::Tensor& stats) {
  at::AutoGradMode enable(true);
  const int64_t rows = in.rows;
  at::Tensor lp = logp.slice(0, 0, rows).detach().requires_grad_(true);
  at::Tensor mb = mask.slice(0, 0, rows), m = mb.to(at::kFloat);
  stats.zero_();
  at::Tensor local;  // this rank's loss share
  if (o.pairs()) {
    PairRewards r = pair_loss(o, lp, m, in);
    local = r.loss * in.rank_share;
    stats[kStatPairs].fill_(double(rows / 2));
    stats[kStatChosen].copy_(r.chosen.sum());
    stats[kStatRejected].copy_(r.rejected.sum());
    stats[kStatAccurate].copy_((r.chosen > r.rejected).sum());
    const int64_t n = rows / 2;
    stats[kStatLogpsChosen].copy_(r.logps.slice(0, 0, n).sum());
    stats[kStatLogpsRejected].copy_(r.logps.slice(0, n, 2 * n).sum());
    if (r.nll.defined()) {
      stats[kStatNll].copy_(r.nll * double(n));
      stats[kStatLogOddsRatio].copy_(at::log_sigmoid(r.log_odds).sum());
      stats[kStatLogOdds].copy_(r.log_odds.sum());
    }
  } else {
    // GRPO (grpo_trainer.py _compute_loss, token-level importance sampling).
    // Where there is no target the inputs are the policy's own values, so
    // the ratio is 1 and the KL 0 there whatever the caller sent.
    at::Tensor adv = in.row.slice(0, 0, rows).unsqueeze(1);
    at::Tensor fixed = lp.detach();
    at::Tensor old = in.old_logp.defined() ? at::where(mb, in.old_logp.slice(0, 0, rows), fixed) : fixed;
    at::Tensor ratio = at::exp(lp - old);
    at::Tensor clipped = at::clamp(ratio, 1 - o.epsilon, 1 + o.epsilon_high);
    at::Tensor per = -at::minimum(ratio * adv, clipped * adv);
    at::Tensor kl;
    if (o.beta != 0) {
      at::Tensor ref = at::where(mb, in.ref_logp.slice(0, 0, rows), fixed);
      kl = at::exp(ref - lp) - (ref - lp) - 1;
      per = per + o.beta * kl;
    }
    at::Tensor masked = per * m;
    switch (o.loss) {
      case ObjectiveLoss::kGrpo: local = (masked.sum(1) / m.sum(1).clamp_min(1.0)).mean() * in.rank_share; break;
      case ObjectiveLoss::kBnpo: local = masked.sum() / m.sum().clamp_min(1.0) * in.rank_share; break;
      case ObjectiveLoss::kDrGrpo:
        local = masked.sum() / double(rows * o.max_completion_length) * in.rank_share;
        break;
      default: local = masked.sum() / std::max(in.global_tokens, 1.0); break;  // dapo: every rank's tokens
    }
    at::NoGradGuard no_grad;
    at::Tensor low = (ratio < 1 - o.epsilon) & (adv < 0), high = (ratio > 1 + o.epsilon_high) & (adv > 0);
    stats[kStatTokens].copy_(m.sum());
    stats[kStatClipLow].copy_((low.to(at::kFloat) * m).sum());
    stats[kStatClipHigh].copy_((high.to(at::kFloat) * m).sum());
    stats[kStatClipRegion].copy_(((low | high).to(at::kFloat) * m).sum());
    if (kl.defined()) stats[kStatKl].copy_((kl * m).sum());
  }
  stats[kStatLoss].copy_(local.detach());
  at::Tensor g = torch::autograd::grad({local}, {lp})[0];
  at::Tensor out = at::zeros_like(logp);
  out.slice(0, 0, rows).copy_(g.masked_fill(~mb, 0.0f));
  return out;
}

}  // namespace strider
