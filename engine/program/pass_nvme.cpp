// Pass "nvme" (state on NVMe, Placement::at(p).on_nvme; gradients spilled,
// spills_grads): under clipping a ring piece's gradients parked on NVMe
// after their sum of squares, until the norm; an NVMe piece's state read
// into one of two staging slots during the update of the NVMe piece before
// it (the first one's just before its own), and written back after its
// update; a slot is read into again once its last write-back has left.
#include "engine/program/passes.h"

namespace strider {

// Expects passes "landing", "clipping" and "ranks": the kSumSquares, and the
// kAdamW in update order (a write-back goes right after it, before a gather).
void pass_nvme(Draft& d) {
  const Placement& place = d.place;
  const bool clip = d.in.clip_norm > 0 || d.in.loss_scaled;
  const int64_t P = place.num_pieces();
  std::vector<int32_t> spill(size_t(P), -1), write(size_t(P), -1);
  std::vector<int32_t> updates;  // the kAdamW, in update order
  for (int32_t id : d.in_order()) {
    const StepOp o = d.op(id);  // a copy: inserting moves the operations
    if (o.kind == StepOpKind::kAdamW) updates.push_back(id);
    if (o.kind == StepOpKind::kSumSquares && clip && place.at(o.piece).spills_grads)
      spill[size_t(o.piece)] = d.insert_after(id, host_op(place, StepOpKind::kSpill, Lane::kNvmeWrite, o.piece, {id}));
  }
  std::vector<size_t> nvme_at;  // the updates of NVMe pieces
  for (size_t k = 0; k < updates.size(); ++k)
    if (place.at(d.op(updates[k]).piece).on_nvme) nvme_at.push_back(k);
  std::vector<std::vector<int64_t>> reads_before(updates.size());  // per update: the reads issued just before it
  for (size_t j = 0; j < nvme_at.size(); ++j)
    reads_before[j == 0 ? nvme_at[0] : nvme_at[j - 1]].push_back(d.op(updates[nvme_at[j]]).piece);
  std::vector<int32_t> read(size_t(P), -1);
  std::vector<int64_t> done;  // NVMe pieces whose reads were issued, in order
  for (size_t k = 0; k < updates.size(); ++k) {
    const int32_t adam = updates[k];
    for (int64_t q : reads_before[k]) {
      std::vector<int32_t> w;
      if (spill[size_t(q)] >= 0) w.push_back(spill[size_t(q)]);
      if (done.size() >= 2) w.push_back(write[size_t(done[done.size() - 2])]);  // its slot's last write
      read[size_t(q)] = d.insert_before(adam, host_op(place, StepOpKind::kReadState, Lane::kNvmeRead, q, std::move(w)));
      done.push_back(q);
    }
    const int64_t p = d.op(adam).piece;
    if (read[size_t(p)] >= 0) d.op(adam).after.push_back(read[size_t(p)]);
    if (place.at(p).on_nvme)
      write[size_t(p)] = d.insert_after(adam, host_op(place, StepOpKind::kWriteState, Lane::kNvmeWrite, p, {adam}));
  }
}

// What the next pass waits for of this one: a state read for the write-back
// of the same state; a load for the update of each of its pieces (a frozen
// one's is never updated), and a compute copy's read from NVMe for its
// write-back too.
void pass_previous_step(Draft& d) {
  std::vector<int32_t> write(size_t(d.place.num_pieces()), -1);
  for (int32_t id : d.in_order())
    if (d.op(id).kind == StepOpKind::kWriteState) write[size_t(d.op(id).piece)] = id;
  for (int32_t id : d.in_order()) {
    StepOp& o = d.op(id);
    if (o.kind == StepOpKind::kReadState) o.after_previous.push_back(write[size_t(o.piece)]);
    if (o.kind == StepOpKind::kLoad || o.kind == StepOpKind::kReadCompute)
      for (int64_t p : d.place.shards().visit_pieces(o.piece, o.shard)) {
        if (d.updated[size_t(p)] >= 0) o.after_previous.push_back(d.updated[size_t(p)]);
        if (o.kind == StepOpKind::kReadCompute && write[size_t(p)] >= 0) o.after_previous.push_back(write[size_t(p)]);
      }
  }
}

}  // namespace strider
