// Pass "host checkpoints" (ProgramInputs::checkpoints_on_host): each layer's
// input for every micro-batch out to the host after the forward of the block
// before it, and back in before the layer's backward (or, cut into sub-layer
// pieces, before its attention half's recompute); the forward that writes a
// checkpoint ring set first waits for that set's last copy out.
#include "engine/program/passes.h"

namespace strider {

// Expects pass "micro-batches" only: its copies go just before the forward
// visit's release and just before a backward visit's first compute, so the
// passes after it (devices, kept activations) place theirs inside them.
void pass_host_checkpoints(Draft& d) {
  if (!d.in.checkpoints_on_host) return;
  const Placement& place = d.place;
  const Sharding& sh = place.shards();
  const int64_t M = d.in.micro_batches;
  std::vector<int32_t> out(size_t(place.head + 1), -1);  // per block: its input's latest kCheckpointOut
  int32_t last = -1;  // the latest forward
  int32_t back = -1;  // the visit's last kCheckpointIn
  for (int32_t id : d.in_order()) {
    const StepOp o = d.op(id);  // a copy: inserting moves the operations
    if (o.visit < 0) continue;
    const Visit& vis = d.visits[size_t(o.visit)];
    const int64_t b = vis.block;
    if (vis.kind == Visit::kForward && o.kind == StepOpKind::kForward) {
      last = id;
      const std::vector<int64_t> loads = d.visit_pieces(o.visit);
      if (loads.front() != sh.first_of(b) || o.micro_batch != 0) continue;
      d.op(id).as<ComputeArgs>().wait_ring = true;
      if (b >= 1 && out[size_t(b)] >= 0) d.op(id).after.push_back(out[size_t(b)]);
    } else if (vis.kind == Visit::kForward && o.kind == StepOpKind::kRelease) {
      const std::vector<int64_t> loads = d.visit_pieces(o.visit);
      if (loads.back() + 1 != sh.end_of(b) || b + 1 >= place.head) continue;
      for (int64_t m = 0; m < M; ++m) {
        StepOp c = d.visit_op(StepOpKind::kCheckpointOut, Lane::kD2H, o.visit, {last});
        c.block = b + 1;
        c.micro_batch = m;
        c.as<CopyArgs>() = {.first = m == 0, .last = m + 1 == M};
        out[size_t(b + 1)] = d.insert_before(id, std::move(c));
      }
    } else if ((vis.kind == Visit::kRecompute && o.kind == StepOpKind::kForward) ||
               (vis.kind == Visit::kBackward && o.kind == StepOpKind::kBackward && !place.piece(vis.piece).sub_layer)) {
      if (b < 1 || b >= place.head) continue;
      if (o.micro_batch == 0) {
        const int from = place.block_device(b - 1);
        for (int64_t m = 0; m < M; ++m) {
          StepOp c = d.visit_op(StepOpKind::kCheckpointIn, Lane::kH2D, o.visit, {out[size_t(b)]});
          c.micro_batch = m;
          c.as<CopyArgs>() = {.first = m == 0, .last = m + 1 == M, .peer = from == place.block_device(b) ? -1 : from};
          back = d.insert_before(id, std::move(c));
        }
      }
      d.op(id).after.push_back(back);
    }
  }
}

}  // namespace strider
