// Pass "ranks" (data parallel: ProgramInputs::world > 1, or sharded state):
// each piece's gradients summed over the ranks on the collective lane right
// after they land (a reduce-scatter of this rank's slice when the state is
// sharded, whose sum of squares and update then cover that slice only), and,
// sharded, the other ranks' slices of the new compute copy gathered after its
// update (a barrier where the machine's ranks share one compute copy).
#include "engine/program/passes.h"

namespace strider {

// Expects passes "landing" and "clipping": each piece's kLand, kSumSquares,
// kAdamW and kUpdated.
void pass_ranks(Draft& d) {
  const Placement& place = d.place;
  const bool sharded = !place.block_slices.empty() && place.block_slices[0].size() > 2;
  const bool ranks = d.in.world > 1 || sharded;
  std::vector<int32_t> summed(size_t(place.num_pieces()), -1), gathered(size_t(place.num_pieces()), -1);
  for (int32_t id : d.in_order()) {
    const StepOp o = d.op(id);  // a copy: inserting moves the operations
    if (o.kind == StepOpKind::kLand && ranks) {
      StepOp s = host_op(place, StepOpKind::kSumRanks, Lane::kCollective, o.piece, {id});
      s.as<SliceArgs>().over_slices = sharded;
      summed[size_t(o.piece)] = d.insert_after(id, std::move(s));
    } else if (o.kind == StepOpKind::kSumSquares) {
      d.op(id).as<SliceArgs>().over_slices = sharded;
      if (ranks) d.op(id).after = {summed[size_t(o.piece)]};
    } else if (o.kind == StepOpKind::kAdamW) {
      d.op(id).as<SliceArgs>() = {.over_slices = sharded, .shared_copy = d.in.shared_compute};
      if (!sharded) continue;
      StepOp g = host_op(place, StepOpKind::kGather, Lane::kCollective, o.piece, {id});
      g.as<SliceArgs>().shared_copy = d.in.shared_compute;
      gathered[size_t(o.piece)] = d.insert_after(id, std::move(g));
    } else if (o.kind == StepOpKind::kUpdated && sharded) {
      d.op(id).after = {gathered[size_t(o.piece)]};
    }
  }
}

}  // namespace strider
