// Pass "tied": an LM head tied to the embedding sends its share of the
// embedding's gradient (fp32) instead of gradients of its own, and each
// embedding shard's backward starts from it instead of from zero.
#include "engine/program/passes.h"

namespace strider {

// Expects pass "micro-batches": the head's kGradsOut of the LM-head piece
// (an embedding shard's, when tied) and the embedding's kZeroGrads.
void pass_tied(Draft& d) {
  const Placement& place = d.place;
  const Sharding& sh = place.shards();
  if (place.piece(sh.lm_piece[0]).block != 0) return;
  std::vector<int32_t> shares;  // per vocabulary shard: its kTiedGradOut, in order
  for (int32_t id : d.in_order()) {
    StepOp& o = d.op(id);
    if (o.visit < 0) continue;
    const Visit& vis = d.visits[size_t(o.visit)];
    if (o.kind == StepOpKind::kGradsOut && vis.kind == Visit::kHead && o.piece == sh.lm_piece[size_t(vis.shard)]) {
      o.kind = StepOpKind::kTiedGradOut;
      o.args = op_args(o.kind);
      o.block = place.head;
      o.shard = vis.shard;
      shares.push_back(id);
    } else if (o.kind == StepOpKind::kZeroGrads && vis.kind == Visit::kBackward && vis.block == 0) {
      o.kind = StepOpKind::kTiedGradIn;
      o.args = op_args(o.kind);
      o.lane = Lane::kH2D;
      o.after = shares;
    }
  }
}

}  // namespace strider
