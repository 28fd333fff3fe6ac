#include "gpu/moe.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <string_view>
#include <vector>

#include "gpu/block_parts.h"
#include "host/error.h"

namespace strider {
namespace {

using block_parts::activate;
using block_parts::activate_backward;
const at::Tensor& moe_weight(const TensorMap& w, std::string_view name) { return block_parts::weight(w, name); }
at::Tensor* moe_grad(TensorMap& grads, std::string_view name) {
  auto it = grads.find(name);
  return it == grads.end() ? nullptr : &it->second;
}

constexpr std::string_view kRouter = "mlp.gate.weight";
constexpr std::string_view kGateUp = "mlp.experts.gate_up_proj";
constexpr std::string_view kDown = "mlp.experts.down_proj";

// The router's choice for each token: fp32 probabilities [n, E], the top_k
// experts [n, k] (int64, by falling probability) and their weights [n, k]
// (fp32, or the compute dtype: MoeDims::scores_fp32).
struct Routing {
  at::Tensor probs, top, scores;
};
// `logits` [n, E] in the compute dtype; with autograd on, the scores and
// probabilities are differentiable in them.
Routing route(const MoeDims& m, const at::Tensor& logits) {
  Routing r;
  r.probs = at::softmax(logits, 1, at::kFloat);
  at::Tensor vals;
  {
    at::NoGradGuard no_grad;
    r.top = std::get<1>(at::topk(r.probs, m.top_k, 1));
  }
  vals = r.probs.gather(1, r.top);
  if (m.norm_topk) vals = vals / vals.sum(1, true);
  r.scores = m.scores_fp32 ? vals : vals.to(logits.scalar_type());
  return r;
}

// The (token, slot) pairs grouped by expert: slot = token * k + j for the
// token's j-th choice; within an expert, tokens ascend. offsets[e] is expert
// e's first pair (E + 1 of them, on the host: the loop over experts needs
// them, as transformers' does).
struct Groups {
  at::Tensor token, slot;
  std::vector<int64_t> offsets;
};
Groups group_by_expert(const at::Tensor& top, int64_t experts) {
  at::NoGradGuard no_grad;
  Groups g;
  const at::Tensor flat = top.reshape({-1});
  g.slot = std::get<1>(at::sort(flat, /*stable=*/true, 0, false));
  g.token = at::div(g.slot, top.size(1), "floor");
  const at::Tensor counts = at::bincount(flat, {}, experts).to(at::kCPU, at::kLong);
  g.offsets.assign(size_t(experts) + 1, 0);
  const int64_t* c = counts.data_ptr<int64_t>();
  for (int64_t e = 0; e < experts; ++e) g.offsets[size_t(e) + 1] = g.offsets[size_t(e)] + c[e];
  return g;
}

// One expert's computation on its tokens' rows x [m, hidden].
struct ExpertPass {
  at::Tensor gate, up, act, y;  // [m, I] x3 (act = act(gate) * up), y = act down_proj^T [m, hidden]
};
ExpertPass expert_forward(const BlockDims& d, const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& x) {
  const int64_t I = d.moe.intermediate;
  ExpertPass p;
  const at::Tensor gu = at::mm(x, gate_up.t());
  p.gate = gu.narrow(1, 0, I);
  p.up = gu.narrow(1, I, I);
  p.act = activate(d, p.gate) * p.up;
  p.y = at::mm(p.act, down.t());
  return p;
}

// y weighted by its tokens' scores s [m] as the reference does: y * s in
// the scores' dtype (fp32 for Mixtral), then back to y's.
at::Tensor weighted(const at::Tensor& y, const at::Tensor& s) {
  return (y * s.unsqueeze(1)).to(y.scalar_type());
}

}  // namespace

at::Tensor moe_forward(const BlockDims& d, const TensorMap& w, const at::Tensor& h, const MoeStep* step) {
  at::NoGradGuard no_grad;
  const MoeDims& m = d.moe;
  STRIDER_CHECK(m.sparse() && h.dim() == 2 && h.size(1) == d.hidden, "moe_forward: h must be [tokens, {}] of a "
                "layer with experts, got {}", d.hidden, c10::str(h.sizes()));
  const at::Tensor& gate_up = moe_weight(w, kGateUp);
  const at::Tensor& down = moe_weight(w, kDown);
  const Routing r = route(m, at::mm(h, moe_weight(w, kRouter).t()));
  if (step && step->stats.defined()) {
    step->stats[0].add_(at::bincount(r.top.reshape({-1}), {}, m.experts).to(at::kFloat));
    step->stats[1].add_(r.probs.sum(0));
  }
  const Groups g = group_by_expert(r.top, m.experts);
  const at::Tensor scores = r.scores.reshape({-1});
  at::Tensor out = at::zeros_like(h);
  for (int64_t e = 0; e < m.experts; ++e) {
    const int64_t a = g.offsets[size_t(e)], b = g.offsets[size_t(e) + 1];
    if (a == b) continue;
    const at::Tensor tok = g.token.slice(0, a, b);
    const ExpertPass p = expert_forward(d, gate_up[e], down[e], h.index_select(0, tok));
    out.index_add_(0, tok, weighted(p.y, scores.index_select(0, g.slot.slice(0, a, b))));
  }
  return out;
}

at::Tensor moe_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const at::Tensor& h,
                        const at::Tensor& gy, const MoeStep* step) {
  const MoeDims& m = d.moe;
  const int64_t n = h.size(0);
  const at::Tensor& router = moe_weight(w, kRouter);
  const at::Tensor& gate_up = moe_weight(w, kGateUp);
  const at::Tensor& down = moe_weight(w, kDown);
  at::Tensor* g_router = moe_grad(grads, kRouter);
  at::Tensor* g_gate_up = moe_grad(grads, kGateUp);
  at::Tensor* g_down = moe_grad(grads, kDown);

  // 1. The routing again, with autograd from the logits.
  at::Tensor logits;
  {
    at::NoGradGuard no_grad;
    logits = at::mm(h, router.t()).detach().requires_grad_(true);
  }
  Routing r;
  {
    at::AutoGradMode enable(true);
    r = route(m, logits);
  }
  at::Tensor dh = at::zeros_like(h);
  at::Tensor dscores = at::zeros({n * m.top_k}, h.options().dtype(at::kFloat));
  {
    at::NoGradGuard no_grad;
    const Groups g = group_by_expert(r.top, m.experts);
    const at::Tensor scores = r.scores.detach().reshape({-1});
    // 2. Each expert with tokens: its output again, d(loss)/d(score), and its
    // weights' and inputs' gradients.
    for (int64_t e = 0; e < m.experts; ++e) {
      const int64_t a = g.offsets[size_t(e)], b = g.offsets[size_t(e) + 1];
      if (a == b) continue;
      const at::Tensor tok = g.token.slice(0, a, b), slot = g.slot.slice(0, a, b);
      const at::Tensor x = h.index_select(0, tok), gyt = gy.index_select(0, tok);
      const at::Tensor s = scores.index_select(0, slot);
      const ExpertPass p = expert_forward(d, gate_up[e], down[e], x);
      dscores.index_copy_(0, slot, (gyt.to(at::kFloat) * p.y.to(at::kFloat)).sum(1));
      const at::Tensor dy = weighted(gyt, s);
      if (g_down) (*g_down)[e].add_(at::mm(dy.t(), p.act));
      const at::Tensor dact = at::mm(dy, down[e]);
      const at::Tensor acted = activate(d, p.gate);
      const at::Tensor dgu = at::cat({activate_backward(d, dact * p.up, p.gate), dact * acted}, 1);
      if (g_gate_up) (*g_gate_up)[e].add_(at::mm(dgu.t(), x));
      dh.index_add_(0, tok, at::mm(dgu, gate_up[e]));
    }
  }
  // 3. The router: the scores' gradients (and the load-balancing loss's, on
  // every probability) back through top-k's normalisation and the softmax.
  at::Tensor dlogits;
  {
    at::AutoGradMode enable(true);
    std::vector<at::Tensor> outs{r.scores};
    std::vector<at::Tensor> gouts{dscores.view({n, m.top_k}).to(r.scores.scalar_type())};
    if (step && step->stats.defined() && step->aux_scale > 0) {
      outs.push_back(r.probs);
      gouts.push_back(moe_aux_grad(step->stats, step->rows, step->aux_scale).view({1, m.experts}).expand({n, m.experts}));
    }
    dlogits = torch::autograd::grad(outs, {logits}, gouts)[0];
  }
  at::NoGradGuard no_grad;
  if (g_router) g_router->add_(at::mm(dlogits.t(), h));
  return dh.add_(at::mm(dlogits, router));
}

at::Tensor moe_aux_loss(const at::Tensor& stats, double rows) {
  const double experts = double(stats.size(1));
  return (stats[0] / rows * (stats[1] / rows)).sum() * experts;
}

at::Tensor moe_aux_grad(const at::Tensor& stats, double rows, double scale) {
  const double experts = double(stats.size(1));
  return stats[0] * (scale * experts / (rows * rows));
}

}  // namespace strider
