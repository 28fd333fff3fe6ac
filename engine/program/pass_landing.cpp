// Pass "landing": each trained piece's gradients in host staging (`land`,
// after their D2H) and their sum of squares, in landing order.
#include "engine/program/passes.h"

namespace strider {

// Expects the device passes done: each trained piece's kGradsOut.
void pass_landing(Draft& d) {
  const Placement& place = d.place;
  std::vector<int32_t> sent(size_t(place.num_pieces()), -1);  // per piece: its kGradsOut
  for (int32_t id : d.in_order())
    if (d.op(id).kind == StepOpKind::kGradsOut) sent[size_t(d.op(id).piece)] = id;
  d.landed.assign(size_t(place.num_pieces()), -1);
  for (int64_t p : place.landing) {
    d.landed[size_t(p)] = d.add(host_op(place, StepOpKind::kLand, Lane::kOptimizer, p, {sent[size_t(p)]}));
    d.add(host_op(place, StepOpKind::kSumSquares, Lane::kOptimizer, p, {d.landed[size_t(p)]}));
  }
}

}  // namespace strider
