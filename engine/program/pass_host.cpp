// The host passes: "landing", "ranks", "clipping" and "nvme" (state and
// spills), each piece's gradients from their D2H to its update.
#include <algorithm>
#include <iterator>

#include "engine/program/passes.h"

namespace strider {

// Expects the device passes done: each trained piece's kGradsOut, the kLossOut.
void pass_host(Draft& d) {
  const Placement& place = d.place;
  const ProgramInputs& in = d.in;
  const int64_t P = place.num_pieces();
  std::vector<int32_t> sent(size_t(P), -1);  // per piece: its kGradsOut
  int32_t loss_op = -1;                      // the loss figures' D2H
  for (int32_t id : d.in_order()) {
    if (d.op(id).kind == StepOpKind::kGradsOut) sent[size_t(d.op(id).piece)] = id;
    if (d.op(id).kind == StepOpKind::kLossOut) loss_op = id;
  }
  const bool clip = in.clip_norm > 0 || in.loss_scaled;  // loss scaling gates the updates as clipping does
  const bool sharded = !place.block_slices.empty() && place.block_slices[0].size() > 2;
  const bool ranks = in.world > 1 || sharded;
  auto add = [&](StepOpKind k, Lane lane, int64_t p, std::vector<int32_t> after) {
    return d.add({.kind = k, .lane = lane, .piece = p, .block = p >= 0 ? place.piece(p).block : -1,
                  .after = std::move(after)});
  };

  // Pass "clipping" decides the update order: with clipping, forward order
  // after the norm; without, each piece as it lands.
  std::vector<int64_t> order = place.landing;
  if (clip) std::sort(order.begin(), order.end());
  // Pass "nvme": an NVMe-tier piece's state is read into one of two staging
  // slots during the update of the NVMe piece before it (the first one's just
  // before its own), and written back after its update; a slot is read into
  // again once its last write-back has left.
  std::vector<std::vector<int64_t>> reads_before(order.size());
  std::vector<size_t> nvme_at;
  for (size_t k = 0; k < order.size(); ++k)
    if (place.at(order[k]).on_nvme) nvme_at.push_back(k);
  for (size_t j = 0; j < nvme_at.size(); ++j) reads_before[j == 0 ? nvme_at[0] : nvme_at[j - 1]].push_back(order[nvme_at[j]]);

  std::vector<int32_t> sumsq(size_t(P), -1), spill(size_t(P), -1), read(size_t(P), -1), write(size_t(P), -1);
  std::vector<int64_t> nvme_done;  // NVMe pieces whose reads were issued, in order
  d.landed.assign(size_t(P), -1);
  d.updated.assign(size_t(P), -1);
  // The update of order[k] once `after` is done: reads ahead, AdamW, the
  // write-back, the gather (pass "ranks"), the release.
  auto update = [&](size_t k, std::vector<int32_t> after) {
    for (int64_t q : reads_before[k]) {
      std::vector<int32_t> w;
      if (spill[size_t(q)] >= 0) w.push_back(spill[size_t(q)]);
      if (nvme_done.size() >= 2) w.push_back(write[size_t(nvme_done[nvme_done.size() - 2])]);  // its slot's last write
      read[size_t(q)] = add(StepOpKind::kReadState, Lane::kNvmeRead, q, std::move(w));
      nvme_done.push_back(q);
    }
    const int64_t p = order[k];
    if (read[size_t(p)] >= 0) after.push_back(read[size_t(p)]);
    int32_t last = add(StepOpKind::kAdamW, Lane::kOptimizer, p, std::move(after));
    d.op(last).over_slices = sharded;
    d.op(last).shared_copy = in.shared_compute;
    if (place.at(p).on_nvme) write[size_t(p)] = add(StepOpKind::kWriteState, Lane::kNvmeWrite, p, {last});
    if (sharded) {
      last = add(StepOpKind::kGather, Lane::kCollective, p, {last});
      d.op(last).shared_copy = in.shared_compute;
    }
    d.updated[size_t(p)] = add(StepOpKind::kUpdated, Lane::kOptimizer, p, {last});
  };

  // Pass "landing" (with "ranks" and the spills of "nvme"): each piece as it lands.
  for (size_t i = 0; i < place.landing.size(); ++i) {
    const int64_t p = place.landing[i];
    int32_t last = d.landed[size_t(p)] = add(StepOpKind::kLand, Lane::kOptimizer, p, {sent[size_t(p)]});
    if (ranks) {
      last = add(StepOpKind::kSumRanks, Lane::kCollective, p, {last});
      d.op(last).over_slices = sharded;
    }
    last = sumsq[size_t(p)] = add(StepOpKind::kSumSquares, Lane::kOptimizer, p, {last});
    d.op(last).over_slices = sharded;
    if (clip) {
      if (place.at(p).spills_grads) spill[size_t(p)] = add(StepOpKind::kSpill, Lane::kNvmeWrite, p, {last});
      continue;
    }
    if (i == 0) last = add(StepOpKind::kCheckLoss, Lane::kOptimizer, -1, {loss_op, last});
    last = add(StepOpKind::kCheckGrad, Lane::kOptimizer, p, {last});
    d.op(last).updated_before = int64_t(i);
    update(i, {last});
  }
  if (clip) {
    std::vector<int32_t> w{add(StepOpKind::kCheckLoss, Lane::kOptimizer, -1, {loss_op})};
    w.insert(w.end(), sumsq.begin(), sumsq.end());
    d.norm = add(StepOpKind::kNorm, Lane::kOptimizer, -1, std::move(w));
    d.op(d.norm).gate = true;
    d.op(d.norm).clip = in.clip_norm;
    d.op(d.norm).unscale = in.loss_scaled;
    for (size_t k = 0; k < order.size(); ++k) update(k, {d.norm});
  } else {
    std::vector<int32_t> w;  // published once every trained piece is updated
    std::copy_if(d.updated.begin(), d.updated.end(), std::back_inserter(w), [](int32_t u) { return u >= 0; });
    d.norm = add(StepOpKind::kNorm, Lane::kOptimizer, -1, std::move(w));
  }
  // A state read waits for the previous pass's write-back of the same state.
  // The loads wait for the previous pass's release of their pieces (a frozen
  // one's is never updated); a compute copy's read from NVMe for its
  // write-back too.
  for (int32_t id : d.in_order()) {
    StepOp& o = d.op(id);
    if (o.kind == StepOpKind::kReadState) o.after_previous.push_back(write[size_t(o.piece)]);
    if (o.kind == StepOpKind::kLoad || o.kind == StepOpKind::kReadCompute)
      for (int64_t p : place.shards.visit_pieces(o.piece, o.shard)) {
        if (d.updated[size_t(p)] >= 0) o.after_previous.push_back(d.updated[size_t(p)]);
        if (o.kind == StepOpKind::kReadCompute && write[size_t(p)] >= 0) o.after_previous.push_back(write[size_t(p)]);
      }
  }
}

}  // namespace strider
