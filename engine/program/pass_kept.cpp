// Passes "kept activations" and "kept logits".
#include "engine/program/passes.h"

namespace strider {

// A kept layer's forward (Placement::saved_index, training) keeps what its
// backward needs and copies it out per micro-batch right after computing it;
// it comes back one micro-batch ahead of its backward: micro-batch 0 right
// after the release of the visit before the layer's backward visit, m + 1
// just before m's backward. Expects passes "devices" and "host checkpoints":
// the copy out goes before a hand-out, the copy in after a hand-in.
void pass_kept_activations(Draft& d) {
  if (!d.train) return;
  const Placement& place = d.place;
  const int64_t M = d.in.micro_batches;
  std::vector<int32_t> saved(size_t(place.head + 1), -1);  // per block: its latest kSaveOut
  std::vector<int32_t> fetched(size_t(M), -1);            // per micro-batch: the latest kFetchSaved
  auto fetch = [&](int32_t id, bool before, int64_t b, int64_t m) {
    StepOp f = d.visit_op(StepOpKind::kFetchSaved, Lane::kH2D, d.op(id).visit, {saved[size_t(b)]});
    f.block = b;
    f.micro_batch = m;
    f.device = place.block_device(b);  // where its backward runs
    fetched[size_t(m)] = before ? d.insert_before(id, std::move(f)) : d.insert_after(id, std::move(f));
  };
  for (int32_t id : d.in_order()) {
    const StepOp o = d.op(id);  // a copy: inserting moves the operations
    if (o.visit < 0) continue;
    const Visit& vis = d.visits[size_t(o.visit)];
    const int64_t m = o.micro_batch;
    if (o.kind == StepOpKind::kForward && vis.kind == Visit::kForward && keeps_activations(place, vis.block)) {
      d.op(id).as<ComputeArgs>().keep = true;
      StepOp s = d.visit_op(StepOpKind::kSaveOut, Lane::kD2H, o.visit, {id});
      s.micro_batch = m;
      s.as<CopyArgs>().last = m + 1 == M;
      saved[size_t(vis.block)] = d.insert_after(id, std::move(s));
    } else if (o.kind == StepOpKind::kBackward && keeps_activations(place, vis.block)) {
      d.op(id).as<ComputeArgs>().keep = true;
      if (m + 1 < M) fetch(id, true, vis.block, m + 1);
      d.op(id).after.push_back(fetched[size_t(m)]);
    } else if (o.kind == StepOpKind::kRelease && size_t(o.visit) + 1 < d.visits.size()) {
      const Visit& next = d.visits[size_t(o.visit) + 1];
      if (next.kind == Visit::kBackward && keeps_activations(place, next.block)) fetch(id, false, next.block, 0);
    }
  }
}

// ProgramInputs::keep_logits: the head's pass 1 keeps every micro-batch's
// logits for pass 2 (training), which then computes two of the three logits
// GEMMs.
void pass_kept_logits(Draft& d) {
  if (!d.in.keep_logits) return;
  for (int32_t id : d.in_order()) {
    StepOp& o = d.op(id);
    if (o.kind == StepOpKind::kHeadLse) o.as<ComputeArgs>().keep = d.train;
    if (o.kind == StepOpKind::kHeadGrad) o.as<ComputeArgs>().keep = true;
  }
}

}  // namespace strider
