#include "gpu/blocks/moe.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <atomic>
#include <cstdio>
#include <string_view>
#include <vector>

#include "gpu/blocks/block_parts.h"
#include "gpu/blocks/moe_cut.h"
#include "gpu/blocks/weight_grad.h"
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
constexpr std::string_view kSharedGate = "mlp.shared_expert.gate_proj.weight";
constexpr std::string_view kSharedUp = "mlp.shared_expert.up_proj.weight";
constexpr std::string_view kSharedDown = "mlp.shared_expert.down_proj.weight";
constexpr std::string_view kSharedWeight = "mlp.shared_expert_gate.weight";

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
// token's j-th choice; within an expert, tokens ascend. The GEMMs run on the
// groups' rows in "group space": offsets[e] is expert e's first row there
// (E + 1 of them, on the host: a loop over experts needs them), ends the same
// as ATen's grouped GEMM takes them (int32 [E], each expert's end), on the
// device.
//
// On the CPU in bf16, group space pads each expert's rows with zero rows up
// to a bucket (padded_rows): oneDNN compiles a GEMM kernel for every shape it
// meets and keeps 1024, and an expert's row count changes with every
// micro-batch, so unpadded counts (six GEMM shapes per count) evict each
// other and the experts spend their time compiling. Buckets of at least 16
// and at most 1/8 of the rows keep the shapes few: about 8 per octave.
// pos[i] is the pair i's row in group space (undefined: no padding).
struct Groups {
  at::Tensor token, slot, ends, pos;
  std::vector<int64_t> offsets;
  int64_t rows = 0;  // in group space
};
int64_t padded_rows(int64_t m) {
  if (m == 0) return 0;
  int64_t step = 16;
  while (step * 16 <= m) step *= 2;  // from 256 rows on, step <= m / 8
  return (m + step - 1) / step * step;
}
// Experts [e0, e1) of `experts` only (a group, gpu/blocks/moe_cut.h): their pairs,
// the group's first expert at row 0 of group space.
Groups group_by_expert(const at::Tensor& top, int64_t experts, bool pad, int64_t e0, int64_t e1) {
  at::NoGradGuard no_grad;
  Groups g;
  const at::Tensor flat = top.reshape({-1});
  const at::Tensor counts = at::bincount(flat, {}, experts).to(at::kCPU, at::kLong);
  const int64_t* c = counts.data_ptr<int64_t>();
  int64_t first = 0, last = 0;
  for (int64_t e = 0; e < e1; ++e) (e < e0 ? first : last) += c[e];
  g.slot = std::get<1>(at::sort(flat, /*stable=*/true, 0, false));
  if (e0 > 0 || e1 < experts) g.slot = g.slot.slice(0, first, first + last);
  g.token = at::div(g.slot, top.size(1), "floor");
  g.offsets.assign(size_t(e1 - e0) + 1, 0);
  std::vector<int64_t> pos;
  for (int64_t e = e0; e < e1; ++e) {
    const size_t i = size_t(e - e0);
    const int64_t rows = pad ? padded_rows(c[e]) : c[e];
    for (int64_t j = 0; pad && j < c[e]; ++j) pos.push_back(g.offsets[i] + j);
    g.offsets[i + 1] = g.offsets[i] + rows;
  }
  g.rows = g.offsets.back();
  const at::TensorOptions on = top.options().dtype(at::kLong);
  g.ends = at::tensor(std::vector<int64_t>(g.offsets.begin() + 1, g.offsets.end()), on.device(at::kCPU))
               .to(top.device(), at::kInt);
  if (pad) g.pos = at::tensor(pos, on.device(at::kCPU)).to(top.device());
  return g;
}
// Pairs' rows [pairs, X] into group space (zero rows between), and back.
at::Tensor to_groups(const at::Tensor& rows, const Groups& g) {
  if (!g.pos.defined()) return rows;
  return at::zeros({g.rows, rows.size(1)}, rows.options()).index_copy_(0, g.pos, rows);
}
at::Tensor from_groups(const at::Tensor& rows, const Groups& g) {
  return g.pos.defined() ? rows.index_select(0, g.pos) : rows;
}
// Where the pairs' GEMMs pad (see Groups): the CPU, below fp32.
bool pads(const at::Tensor& h) { return h.is_cpu() && h.scalar_type() != at::kFloat; }

// ATen's grouped GEMM takes rows whose strides are multiples of 16 bytes; on
// CUDA, bf16 only (torch 2.9 - 2.15).
bool groupable(const at::Tensor& t) {
  if (t.is_cuda() && t.scalar_type() != at::kBFloat16) return false;
  for (int64_t i = 0; i < t.dim(); ++i)
    if (t.size(i) > 1 && (t.stride(i) * int64_t(t.element_size())) % 16 != 0 && t.stride(i) != 1) return false;
  return true;
}

// Rows x [S, K] grouped by expert (g), times each group's w[e] ([E, K, N],
// any strides): [S, N]. ATen's grouped GEMM where it takes the operands (one
// call for every expert, as transformers' grouped_mm experts make), else a
// GEMM per expert with rows; an expert with none is not computed. Both
// compute each row from its expert's GEMM alone.
at::Tensor grouped_mm(const at::Tensor& x, const at::Tensor& w, const Groups& g) {
  // CUDA's grouped GEMM has layout rules of its own by version and card, not
  // yet run here (no GPU has run this): one it refuses is said once, and the
  // loop computes instead. The CPU's is tested; its errors propagate.
  static std::atomic<bool> cuda_refused{false};
  if (groupable(x) && groupable(w) && !(x.is_cuda() && cuda_refused.load())) {
    try {
      return at::_grouped_mm(x, w, g.ends);
    } catch (const c10::Error& e) {
      if (!x.is_cuda()) throw;
      if (!cuda_refused.exchange(true))
        std::fprintf(stderr, "strider: at::_grouped_mm refused the experts' GEMM on %s (%s); computing one GEMM "
                     "per expert instead\n", c10::str(x.device()).c_str(), e.what_without_backtrace());
    }
  }
  at::Tensor out = at::empty({x.size(0), w.size(2)}, x.options());
  for (int64_t e = 0; e + 1 < int64_t(g.offsets.size()); ++e) {
    const int64_t a = g.offsets[size_t(e)], b = g.offsets[size_t(e) + 1];
    if (a == b) continue;
    at::Tensor rows = out.slice(0, a, b);
    at::mm_out(rows, x.slice(0, a, b), w[e]);
  }
  return out;
}

// Adds the grouped rows [S, hidden] into out [tokens, hidden], each token's
// in its experts' order: a token's rows are copied to k places of its own
// (distinct indices: deterministic on every device, where one index_add_ of
// rows that share tokens is not on CUDA), then added one choice rank at a
// time, so out[t] = ((out[t] + y_e1) + y_e2) ... for its experts e1 < e2 < ...
// (`descending`: ... + y_e2) + y_e1, as backward adds d(loss)/dh, whose
// groups of experts come in reverse). The rows of a group of some experts
// only (`partial`) leave +0 at the other experts' places (gpu/blocks/moe_cut.h:
// adding them changes nothing).
void add_by_token(at::Tensor& out, const at::Tensor& rows, const at::Tensor& top, const Groups& g, bool partial,
                  bool descending) {
  const int64_t n = top.size(0), k = top.size(1);
  const at::Tensor order = std::get<1>(top.sort(/*stable=*/true, 1, false));
  at::Tensor rank = at::empty_like(order);
  rank.scatter_(1, order, at::arange(k, order.options()).expand_as(order).contiguous());
  const at::Tensor place = g.token * k + rank.reshape({-1}).index_select(0, g.slot);
  at::Tensor buf = partial ? at::zeros({n * k, out.size(1)}, rows.options())
                           : at::empty({n * k, out.size(1)}, rows.options());
  buf.index_copy_(0, place, rows);
  const at::Tensor v = buf.view({n, k, out.size(1)});
  for (int64_t i = 0; i < k; ++i) out.add_(v.select(1, descending ? k - 1 - i : i));
}

// Each expert's weight gradient from its rows: acc[e] += a_e^T b_e (a [S, M],
// b [S, N] grouped by g; acc fp32 [E, M, N]), one expert at a time, with no
// rounding to the compute dtype (gpu/blocks/weight_grad.h).
void add_weight_grads(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, const Groups& g) {
  for (int64_t e = 0; e + 1 < int64_t(g.offsets.size()); ++e) {
    const int64_t lo = g.offsets[size_t(e)], hi = g.offsets[size_t(e) + 1];
    at::Tensor expert = acc[e];
    if (lo < hi) add_weight_grad(expert, a.slice(0, lo, hi).t(), b.slice(0, lo, hi));
  }
}

// The experts on their grouped rows xs [S, hidden]: gate and up, act(gate) x up.
struct ExpertPass {
  at::Tensor gate, up, act;  // [S, I] x3
};
ExpertPass experts_up(const BlockDims& d, const at::Tensor& gate_up, const at::Tensor& xs, const Groups& g) {
  const int64_t I = d.moe.intermediate;
  ExpertPass p;
  const at::Tensor gu = grouped_mm(xs, gate_up.transpose(1, 2), g);
  p.gate = gu.narrow(1, 0, I);
  p.up = gu.narrow(1, I, I);
  p.act = activate(d, p.gate) * p.up;
  return p;
}

// y weighted by its tokens' scores s [m] as the reference does: y * s in
// the scores' dtype (fp32 for Mixtral), then back to y's.
at::Tensor weighted(const at::Tensor& y, const at::Tensor& s) {
  return (y * s.unsqueeze(1)).to(y.scalar_type());
}

// The tokens' routing into the load-balancing loss's statistics: every
// token's, or (with padding) the valid ones' as transformers' masked means
// take them; counts of 0 and 1 add exactly in fp32, in any order.
void add_routing_stats(const MoeStep& step, const Routing& r, const MoeDims& m) {
  if (!step.valid.defined()) {
    step.stats[0].add_(at::bincount(r.top.reshape({-1}), {}, m.experts).to(at::kFloat));
    step.stats[1].add_(r.probs.sum(0));
    return;
  }
  const at::Tensor per_choice = step.valid.unsqueeze(1).expand({-1, m.top_k}).reshape({-1});
  step.stats[0].index_add_(0, r.top.reshape({-1}), per_choice);
  step.stats[1].add_((r.probs * step.valid.unsqueeze(1)).sum(0));
}

// Qwen2-MoE's shared expert on every token, as transformers'
// Qwen2MoeSparseMoeBlock computes it in the compute dtype: a SwiGLU MLP,
// down(act(h Wg^T) x h Wu^T), weighted by sigmoid(h w^T) ([n, 1]).
at::Tensor shared_expert(const BlockDims& d, const TensorMap& w, const at::Tensor& h) {
  at::Tensor gate = at::mm(h, moe_weight(w, kSharedGate).t());
  at::Tensor up = at::mm(h, moe_weight(w, kSharedUp).t());
  at::Tensor act = activate(d, gate) * up;
  gate = up = at::Tensor();
  const at::Tensor y = at::mm(act, moe_weight(w, kSharedDown).t());
  act = at::Tensor();
  return at::sigmoid(at::mm(h, moe_weight(w, kSharedWeight).t())) * y;
}

// Its backward for gy = d(loss)/d(output): the four weights' gradients into
// `grads` (fp32, as the experts'), d(loss)/dh added into dh. The weight's
// gradient is sum over hidden of gy x y (autograd's reduction of the
// broadcast product) through the sigmoid.
void shared_expert_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const at::Tensor& h,
                            const at::Tensor& gy, at::Tensor& dh) {
  const at::Tensor& wg = moe_weight(w, kSharedGate);
  const at::Tensor& wu = moe_weight(w, kSharedUp);
  const at::Tensor& wd = moe_weight(w, kSharedDown);
  const at::Tensor& ws = moe_weight(w, kSharedWeight);
  const at::Tensor gate = at::mm(h, wg.t()), up = at::mm(h, wu.t());
  at::Tensor acted = activate(d, gate);
  at::Tensor act = acted * up;
  const at::Tensor s = at::sigmoid(at::mm(h, ws.t()));
  {
    const at::Tensor dz = at::sigmoid_backward((gy * at::mm(act, wd.t())).sum(1, true), s);
    if (at::Tensor* g = moe_grad(grads, kSharedWeight)) add_weight_grad(*g, dz.t(), h);
    dh.add_(at::mm(dz, ws));
  }
  const at::Tensor dy = gy * s;
  if (at::Tensor* g = moe_grad(grads, kSharedDown)) add_weight_grad(*g, dy.t(), act);
  act = at::Tensor();
  at::Tensor dact = at::mm(dy, wd);
  const at::Tensor du = dact * acted;
  acted = at::Tensor();
  const at::Tensor dg = activate_backward(d, dact.mul_(up), gate);
  dact = at::Tensor();
  if (at::Tensor* g = moe_grad(grads, kSharedGate)) add_weight_grad(*g, dg.t(), h);
  if (at::Tensor* g = moe_grad(grads, kSharedUp)) add_weight_grad(*g, du.t(), h);
  dh.add_(at::mm(dg, wg)).add_(at::mm(du, wu));
}

// A group's experts [e0, e1) of a fused expert tensor that holds every
// expert or only the group's (gpu/blocks/moe_cut.h).
at::Tensor group_experts(const at::Tensor& t, const MoeDims& m, int64_t e0, int64_t e1, std::string_view name) {
  if (t.size(0) == m.experts) return t.slice(0, e0, e1);
  STRIDER_CHECK(t.size(0) == e1 - e0, "{}: {} experts, expected {} (every expert) or {} (experts [{}, {}))", name,
                t.size(0), m.experts, e1 - e0, e0, e1);
  return t;
}

void check_group(const BlockDims& d, const at::Tensor& h, int64_t e0, int64_t e1, const char* what) {
  STRIDER_CHECK(d.moe.sparse() && h.dim() == 2 && h.size(1) == d.hidden, "{}: h must be [tokens, {}] of a layer "
                "with experts, got {}", what, d.hidden, c10::str(h.sizes()));
  STRIDER_CHECK(0 <= e0 && e0 < e1 && e1 <= d.moe.experts, "{}: experts [{}, {}) of {}", what, e0, e1,
                d.moe.experts);
}

// The experts of g (gate_up and down: the group's [E', 2I, H] and [E', H, I])
// on h's routed rows, their weighted outputs added into out.
void experts_forward(const BlockDims& d, const at::Tensor& gate_up, const at::Tensor& down, const Groups& g,
                     const at::Tensor& h, const at::Tensor& top, const at::Tensor& scores, at::Tensor& out,
                     bool partial) {
  at::Tensor xs = to_groups(h.index_select(0, g.token), g);
  at::Tensor act = experts_up(d, gate_up, xs, g).act;
  xs = at::Tensor();
  at::Tensor y = from_groups(grouped_mm(act, down.transpose(1, 2), g), g);
  act = at::Tensor();
  add_by_token(out, weighted(y, scores.reshape({-1}).index_select(0, g.slot)), top, g, partial, false);
}

// Their backward (scores without autograd): the output again for
// d(loss)/d(score) into dscores, the weights' gradients into g_gate_up and
// g_down (the group's; undefined: not computed), d(loss)/dh added into dh.
void experts_backward(const BlockDims& d, const at::Tensor& gate_up, const at::Tensor& down, at::Tensor g_gate_up,
                      at::Tensor g_down, const Groups& g, const at::Tensor& h, const at::Tensor& gy,
                      const at::Tensor& top, const at::Tensor& scores, at::Tensor& dh, at::Tensor& dscores,
                      bool partial) {
  const at::Tensor xs = to_groups(h.index_select(0, g.token), g);
  at::Tensor gys = gy.index_select(0, g.token);
  ExpertPass p = experts_up(d, gate_up, xs, g);
  {
    const at::Tensor y = from_groups(grouped_mm(p.act, down.transpose(1, 2), g), g);
    dscores.index_copy_(0, g.slot, (gys.to(at::kFloat) * y.to(at::kFloat)).sum(1));
  }
  const at::Tensor dy = to_groups(weighted(gys, scores.reshape({-1}).index_select(0, g.slot)), g);
  gys = at::Tensor();
  if (g_down.defined()) add_weight_grads(g_down, dy, p.act, g);
  p.act = at::Tensor();
  at::Tensor dact = grouped_mm(dy, down, g);
  const at::Tensor acted = activate(d, p.gate);
  at::Tensor dgu = at::cat({activate_backward(d, dact * p.up, p.gate), dact * acted}, 1);
  dact = at::Tensor();
  p = {};
  if (g_gate_up.defined()) add_weight_grads(g_gate_up, dgu, xs, g);
  add_by_token(dh, from_groups(grouped_mm(dgu, gate_up, g), g), top, g, partial, /*descending=*/true);
}

// The routing with autograd from logits (requires_grad) back to them:
// d(loss)/d(score) (dscores, fp32 [n x k]) and, with the load-balancing loss
// in the step, its gradient on every probability.
at::Tensor logits_grad(const MoeDims& m, const Routing& r, const at::Tensor& logits, const at::Tensor& dscores,
                       const MoeStep* step) {
  const int64_t n = logits.size(0);
  at::AutoGradMode enable(true);
  std::vector<at::Tensor> outs{r.scores};
  std::vector<at::Tensor> gouts{dscores.view({n, m.top_k}).to(r.scores.scalar_type())};
  if (step && step->stats.defined() && step->aux_scale > 0) {
    outs.push_back(r.probs);
    const at::Tensor g = moe_aux_grad(step->stats, step->rows, step->aux_scale).view({1, m.experts});
    gouts.push_back(step->valid.defined() ? g * step->valid.unsqueeze(1) : g.expand({n, m.experts}));
  }
  return torch::autograd::grad(outs, {logits}, gouts)[0];
}

// The logits, detached, as the leaf of the router's autograd.
at::Tensor logits_leaf(const TensorMap& w, const at::Tensor& h) {
  at::NoGradGuard no_grad;
  return at::mm(h, moe_weight(w, kRouter).t()).detach().requires_grad_(true);
}

// The router's gradient and its share of d(loss)/dh, from d(loss)/d(logits).
void router_grads(const TensorMap& w, TensorMap& grads, const at::Tensor& h, const at::Tensor& dlogits,
                  at::Tensor& dh) {
  at::NoGradGuard no_grad;
  if (at::Tensor* g = moe_grad(grads, kRouter)) g->add_(at::mm(dlogits.t(), h));
  dh.add_(at::mm(dlogits, moe_weight(w, kRouter)));
}

}  // namespace

MoeRoute moe_route(const BlockDims& d, const TensorMap& w, const at::Tensor& h, const MoeStep* step) {
  at::NoGradGuard no_grad;
  check_group(d, h, 0, d.moe.experts, "moe_route");
  const Routing r = route(d.moe, at::mm(h, moe_weight(w, kRouter).t()));
  if (step && step->stats.defined()) add_routing_stats(*step, r, d.moe);
  if (step && step->routes) step->routes->push_back(r.top.clone());
  return {r.top, r.scores};
}

void moe_experts_forward(const BlockDims& d, const TensorMap& w, int64_t e0, int64_t e1, const at::Tensor& h,
                         const MoeRoute& r, at::Tensor& out) {
  at::NoGradGuard no_grad;
  check_group(d, h, e0, e1, "moe_experts_forward");
  const MoeDims& m = d.moe;
  const Groups g = group_by_expert(r.top, m.experts, pads(h), e0, e1);
  experts_forward(d, group_experts(moe_weight(w, kGateUp), m, e0, e1, kGateUp),
                  group_experts(moe_weight(w, kDown), m, e0, e1, kDown), g, h, r.top, r.scores, out,
                  e0 > 0 || e1 < m.experts);
}

void moe_experts_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, int64_t e0, int64_t e1,
                          const at::Tensor& h, const at::Tensor& gy, const MoeRoute& r, at::Tensor& dh,
                          at::Tensor& dscores) {
  at::NoGradGuard no_grad;
  check_group(d, h, e0, e1, "moe_experts_backward");
  const MoeDims& m = d.moe;
  const Groups g = group_by_expert(r.top, m.experts, pads(h), e0, e1);
  auto group_grad = [&](std::string_view name) {
    at::Tensor* t = moe_grad(grads, name);
    return t ? group_experts(*t, m, e0, e1, name) : at::Tensor();
  };
  experts_backward(d, group_experts(moe_weight(w, kGateUp), m, e0, e1, kGateUp),
                   group_experts(moe_weight(w, kDown), m, e0, e1, kDown), group_grad(kGateUp), group_grad(kDown), g,
                   h, gy, r.top, r.scores, dh, dscores, e0 > 0 || e1 < m.experts);
}

at::Tensor moe_shared_forward(const BlockDims& d, const TensorMap& w, const at::Tensor& h) {
  at::NoGradGuard no_grad;
  return shared_expert(d, w, h);
}

void moe_shared_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const at::Tensor& h,
                         const at::Tensor& gy, at::Tensor& dh) {
  at::NoGradGuard no_grad;
  shared_expert_backward(d, w, grads, h, gy, dh);
}

void moe_router_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const at::Tensor& h,
                         const at::Tensor& dscores, at::Tensor& dh, const MoeStep* step) {
  check_group(d, h, 0, d.moe.experts, "moe_router_backward");
  const at::Tensor logits = logits_leaf(w, h);
  Routing r;
  {
    at::AutoGradMode enable(true);
    r = route(d.moe, logits);
  }
  router_grads(w, grads, h, logits_grad(d.moe, r, logits, dscores, step), dh);
}

// The whole layer: the groups' functions over one group of every expert.
at::Tensor moe_forward(const BlockDims& d, const TensorMap& w, const at::Tensor& h, const MoeStep* step) {
  at::NoGradGuard no_grad;
  const MoeRoute r = moe_route(d, w, h, step);
  at::Tensor out = at::zeros_like(h);
  moe_experts_forward(d, w, 0, d.moe.experts, h, r, out);  // its rows gone before the shared expert's buffers come
  if (d.moe.shared_intermediate > 0) out.add_(shared_expert(d, w, h));
  return out;
}

at::Tensor moe_backward(const BlockDims& d, const TensorMap& w, TensorMap& grads, const at::Tensor& h,
                        const at::Tensor& gy, const MoeStep* step) {
  const MoeDims& m = d.moe;
  check_group(d, h, 0, m.experts, "moe_backward");
  // 1. The routing again, with autograd from the logits.
  const at::Tensor logits = logits_leaf(w, h);
  Routing r;
  {
    at::AutoGradMode enable(true);
    r = route(m, logits);
  }
  at::NoGradGuard no_grad;
  // 2. The experts on their grouped rows: the output again, d(loss)/d(score),
  // and the weights' and inputs' gradients; then the shared expert's.
  at::Tensor dh = at::zeros_like(h);
  at::Tensor dscores = at::zeros({h.size(0) * m.top_k}, h.options().dtype(at::kFloat));
  moe_experts_backward(d, w, grads, 0, m.experts, h, gy, {r.top, r.scores.detach()}, dh, dscores);
  if (m.shared_intermediate > 0) shared_expert_backward(d, w, grads, h, gy, dh);
  // 3. The router: the scores' gradients (and the load-balancing loss's, on
  // every probability) back through top-k's normalisation and the softmax.
  router_grads(w, grads, h, logits_grad(m, r, logits, dscores, step), dh);
  return dh;
}

at::Tensor moe_aux_loss(const at::Tensor& stats, double rows) {
  const double experts = double(stats.size(1));
  if (rows == 0) return at::zeros({}, stats.options());
  return (stats[0] / rows * (stats[1] / rows)).sum() * experts;
}

at::Tensor moe_aux_grad(const at::Tensor& stats, double rows, double scale) {
  const double experts = double(stats.size(1));
  if (rows == 0) return at::zeros_like(stats[0]);
  return stats[0] * (scale * experts / (rows * rows));
}

}  // namespace strider
