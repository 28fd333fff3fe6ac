// Passes "prefetch" and "nvme" (compute copies): each visit's load, and the
// reads of compute copies that live on NVMe.
#include <algorithm>

#include "engine/program/passes.h"

namespace strider {

// Visit i's load is issued before visit i - (K - 2) computes (the first K - 1
// loads before the first visit; K = 2: just before its visit), into the unit
// visit i - K released; the operations that wait for their visit's load
// (kVisitLoad) wait for it.
//
// Why not K - 1 ahead, as the window allows: the load waits for its unit's
// release (the visit's gradients off the device), and the h2d stream runs in
// order, so a load issued before visit i - (K - 1) held every copy issued
// after it (that visit's host checkpoints and kept activations in) until
// visit i - K's gradients had left: predicted for Llama-3.1-8B on the rtx4090
// preset, each layer's backward waited ~27 ms for its second micro-batch's
// activations. One visit later the unit is free by the time the stream gets
// there, and with nothing else on the stream the load starts when it did.
//
// Compute copies on NVMe (Placement::at(p).compute_on_nvme): a visit whose
// pieces' compute copies live there reads them into a load staging slot,
// issued right after the load before its own (so the read runs while that
// load's copy does), the slots taken in turn: a slot is read into again
// kComputeLoadSlots reads later, when the load of the read before it has been
// issued at least.
//
// Expects every other device pass done: the loads go just before the first
// operation of the visit they are issued at (after what the visit before
// left behind its release: a kept layer's first activations in).
void pass_prefetch(Draft& d) {
  const Placement& place = d.place;
  const std::vector<Visit>& vs = d.visits;
  const size_t n = vs.size(), K = size_t(d.in.window), ahead = K - 2;
  std::vector<int32_t> start(n, -1), release(n, -1);  // per visit: its first operation, its kRelease
  for (int32_t id : d.in_order()) {
    const StepOp& o = d.op(id);
    if (o.visit < 0) continue;
    if (start[size_t(o.visit)] < 0) start[size_t(o.visit)] = id;
    if (o.kind == StepOpKind::kRelease) release[size_t(o.visit)] = id;
  }
  // Per device: its visits in order (a pool's devices each slide their own window).
  std::vector<std::vector<size_t>> mine(size_t(place.devices));
  std::vector<size_t> nth(n);  // visit i is its device's nth
  for (size_t i = 0; i < n; ++i) {
    nth[i] = mine[size_t(vs[i].device)].size();
    mine[size_t(vs[i].device)].push_back(i);
  }
  std::vector<int32_t> read(n, -1);
  int reads = 0;
  size_t at = 0;  // the visit whose first operation the loads go before
  auto reads_compute = [&](size_t j) { return vs[j].kind != Visit::kHead && place.at(vs[j].piece).compute_on_nvme; };
  auto emit_read = [&](size_t j) {
    StepOp r = d.visit_op(StepOpKind::kReadCompute, Lane::kNvmeRead, int64_t(j));
    r.piece = vs[j].piece;
    r.as<SlotArgs>().slot = reads++ % kComputeLoadSlots;
    read[j] = d.insert_before(start[at], std::move(r));
  };
  auto emit_load = [&](size_t j) {
    const std::vector<size_t>& own = mine[size_t(vs[j].device)];
    std::vector<int32_t> after;
    if (nth[j] >= K) after.push_back(release[own[nth[j] - K]]);
    if (reads_compute(j) && read[j] < 0) emit_read(j);
    if (read[j] >= 0) after.push_back(read[j]);
    StepOp l = d.visit_op(StepOpKind::kLoad, Lane::kH2D, int64_t(j), std::move(after));
    l.piece = vs[j].piece;
    l.shard = vs[j].shard;
    if (read[j] >= 0) l.as<SlotArgs>().slot = d.op(read[j]).as<SlotArgs>().slot;
    d.insert_before(start[at], std::move(l));
    for (size_t k = j + 1; k < n; ++k)
      if (reads_compute(k)) {
        if (read[k] < 0) emit_read(k);
        break;
      }
  };
  std::vector<size_t> done(size_t(place.devices), 0), next(size_t(place.devices), 0);
  for (at = 0; at < n; ++at) {
    if (place.devices > 1) {
      // A pool: each visit's load just before it, into the unit its
      // device's visit K before released. A device's own visits are a round
      // of the pool apart, and the issuing thread runs that far ahead of the
      // devices, so the load still runs while the device computes its
      // previous visit. Issued K-1 of its own visits ahead (K-1 rounds), the
      // step's first loads would wait for updates far down the model (the
      // previous step's, in forward order), and with them what is issued
      // after them: the issuing thread (device_pass.cpp, wait_updated), or
      // on a simulated device the h2d stream's hand-offs.
      emit_load(at);
    } else {
      // Each device's loads up to K-2 of its visits ahead of those it has
      // run, in visit order.
      std::vector<size_t> due;
      for (size_t dv = 0; dv < mine.size(); ++dv)
        for (; next[dv] < mine[dv].size() && next[dv] <= done[dv] + ahead; ++next[dv]) due.push_back(mine[dv][next[dv]]);
      std::sort(due.begin(), due.end());
      for (size_t j : due) emit_load(j);
    }
    ++done[size_t(vs[at].device)];
  }
}

}  // namespace strider
