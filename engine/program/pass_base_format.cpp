// Pass "base format": a layer visit whose pieces include a quantized LoRA
// base (Piece::quantized, host/base_format.h) starts by dequantizing it, landed
// with the load, into the unit's parameters, before anything computes with them.
#include "engine/program/passes.h"

namespace strider {

// Expects the visits' operations in place (before pass "prefetch"): its
// operations go before each visit's first.
void pass_base_format(Draft& d) {
  std::vector<bool> seen(d.visits.size(), false);
  for (int32_t id : d.in_order()) {
    const int64_t v = d.op(id).visit;
    if (v < 0 || seen[size_t(v)]) continue;
    seen[size_t(v)] = true;
    if (d.visits[size_t(v)].kind == Visit::kHead) continue;
    for (int64_t q : d.visit_pieces(v))
      if (d.place.piece(q).quantized) {
        StepOp o = d.visit_op(StepOpKind::kDequantize, Lane::kCompute, v, {kVisitLoad});
        o.piece = q;
        o.block = d.place.piece(q).block;
        d.insert_before(id, std::move(o));
      }
  }
}

}  // namespace strider
