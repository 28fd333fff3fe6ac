// Pass "clipping": the checks, the norm and the updates, in the order
// clipping decides. With clipping (or fp16's loss scaling, which gates the
// updates as clipping does): the loss checked, then the norm over every
// piece's sum of squares gates every update (its scale set by the clipping
// norm, the loss scale divided out), the updates in forward order after it.
// Without: each piece's update right after its sum of squares, its gradient
// checked first (the loss too, before the first), the norm published once
// every trained piece is updated.
#include <algorithm>
#include <iterator>

#include "engine/program/passes.h"

namespace strider {

namespace {

// Piece p's update once `after` is done: AdamW, then `updated` (its next
// load may go). Returns the kAdamW.
int32_t update(Draft& d, int32_t at, int64_t p, std::vector<int32_t> after) {
  const int32_t adam = d.insert_after(at, host_op(d.place, StepOpKind::kAdamW, Lane::kOptimizer, p, std::move(after)));
  d.updated[size_t(p)] = d.insert_after(adam, host_op(d.place, StepOpKind::kUpdated, Lane::kOptimizer, p, {adam}));
  return d.updated[size_t(p)];
}

}  // namespace

// Expects pass "landing": each trained piece's kSumSquares.
void pass_clipping(Draft& d) {
  const Placement& place = d.place;
  const bool clip = d.in.clip_norm > 0 || d.in.loss_scaled;
  std::vector<int32_t> sumsq(size_t(place.num_pieces()), -1);
  int32_t loss = -1;  // the loss figures' D2H
  for (int32_t id : d.in_order()) {
    if (d.op(id).kind == StepOpKind::kSumSquares) sumsq[size_t(d.op(id).piece)] = id;
    if (d.op(id).kind == StepOpKind::kLossOut) loss = id;
  }
  d.updated.assign(size_t(place.num_pieces()), -1);
  if (!clip) {
    for (size_t i = 0; i < place.landing.size(); ++i) {
      const int64_t p = place.landing[i];
      int32_t at = sumsq[size_t(p)];
      if (i == 0) at = d.insert_after(at, host_op(place, StepOpKind::kCheckLoss, Lane::kOptimizer, -1, {loss, at}));
      StepOp check = host_op(place, StepOpKind::kCheckGrad, Lane::kOptimizer, p, {at});
      check.as<CheckArgs>().updated_before = int64_t(i);
      at = d.insert_after(at, std::move(check));
      update(d, at, p, {at});
    }
    std::vector<int32_t> w;  // published once every trained piece is updated
    std::copy_if(d.updated.begin(), d.updated.end(), std::back_inserter(w), [](int32_t u) { return u >= 0; });
    d.norm = d.add(host_op(place, StepOpKind::kNorm, Lane::kOptimizer, -1, std::move(w)));
    return;
  }
  std::vector<int32_t> w{d.add(host_op(place, StepOpKind::kCheckLoss, Lane::kOptimizer, -1, {loss}))};
  w.insert(w.end(), sumsq.begin(), sumsq.end());
  StepOp norm = host_op(place, StepOpKind::kNorm, Lane::kOptimizer, -1, std::move(w));
  norm.as<NormArgs>() = {.gate = true, .clip = d.in.clip_norm, .unscale = d.in.loss_scaled};
  int32_t at = d.norm = d.add(std::move(norm));
  std::vector<int64_t> order = place.landing;
  std::sort(order.begin(), order.end());
  for (int64_t p : order) at = update(d, at, p, {d.norm});
}

}  // namespace strider
