// Passes "visits" and "micro-batches": the base program the others add to.
#include <algorithm>

#include "engine/program/passes.h"

namespace strider {

// Forward (embedding shards, layers), the head's shards (pass 1 over all,
// then pass 2 over all; one visit each when there is one shard), backward
// (layers, then embedding shards, in reverse, to the first trained block). A
// layer is one visit however many pieces cut it (named by its first), unless
// they are sub-layer pieces: each of those is a visit. Each visit runs on its
// block's device (Placement::block_device; the head's shards on head_device).
void pass_visits(Draft& d) {
  const Placement& place = d.place;
  const Sharding& sh = place.shards();
  std::vector<int64_t> forward;  // each visit's first piece
  for (int64_t p = 0; p < sh.first_of(place.head); ++p)
    if (place.piece(p).rows() || place.piece(p).sub_layer || p == sh.first_of(place.piece(p).block)) forward.push_back(p);
  auto layer = [&](Visit::Kind kind, int64_t p) {
    const int64_t b = place.piece(p).block;
    d.visits.push_back({.kind = kind, .piece = p, .block = b, .device = place.block_device(b)});
  };
  auto head = [&](int64_t s, bool lse, bool grad) {
    d.visits.push_back(
        {.kind = Visit::kHead, .shard = s, .lse = lse, .grad = grad, .block = place.head, .device = place.head_device(s)});
  };
  for (int64_t p : forward) layer(Visit::kForward, p);
  if (!d.train || sh.shards > 1)
    for (int64_t s = 0; s < sh.shards; ++s) head(s, true, false);
  if (!d.train) return;
  for (int64_t s = 0; s < sh.shards; ++s) head(s, sh.shards == 1, true);
  const int64_t first = place.first_trained_block();
  for (auto p = forward.rbegin(); p != forward.rend(); ++p) {
    const int64_t b = place.piece(*p).block;
    if (b < first) continue;
    if (place.piece(*p).sub_layer && *p + 1 == sh.end_of(b)) layer(Visit::kRecompute, sh.first_of(b));
    layer(Visit::kBackward, *p);
  }
}

namespace {

// The head's visit of shard s: pass 1 per micro-batch, then the loss figures
// out (the last shard's); pass 2 per micro-batch, the last shard's norm
// backward after each; the gradients out. Returns what the release waits for.
// `loss`: the kLossOut, the last shard's, which pass 2 of every shard waits for.
std::vector<int32_t> head_visit(Draft& d, int64_t v, bool& grads, int32_t& loss) {
  const Placement& place = d.place;
  const Sharding& sh = place.shards();
  const Visit& vis = d.visits[size_t(v)];
  const int64_t M = d.in.micro_batches, s = vis.shard;
  const bool last_shard = s + 1 == sh.shards;
  auto shard_op = [&](StepOpKind kind, Lane lane, std::vector<int32_t> after, int64_t m = -1) {
    StepOp o = d.visit_op(kind, lane, v, std::move(after));
    o.shard = s;
    o.micro_batch = m;
    return d.add(std::move(o));
  };
  int32_t last = -1;
  if (vis.lse) {
    for (int64_t m = 0; m < M; ++m) last = shard_op(StepOpKind::kHeadLse, Lane::kCompute, {kVisitLoad}, m);
    // An objective past SFT maps every micro-batch's log-probabilities to
    // their coefficients and the loss before any pass 2 (a training pass).
    if (last_shard && d.train && d.in.objective) last = shard_op(StepOpKind::kObjective, Lane::kCompute, {last});
    if (last_shard) loss = d.add(d.visit_op(StepOpKind::kLossOut, Lane::kD2H, v, {last}));
  }
  std::vector<int32_t> out;
  if (!d.train || !vis.grad) return out;
  const int64_t lm = sh.lm_piece[size_t(s)];
  const bool norm_trained = last_shard && !place.piece(sh.norm_piece).frozen, lm_trained = !place.piece(lm).frozen;
  grads = norm_trained || lm_trained;  // else frozen: no accumulators, nothing sent
  if (grads) shard_op(StepOpKind::kZeroGrads, Lane::kCompute, {kVisitLoad});
  // The last shard's norm backward follows each micro-batch's gradient, so
  // the next block's backward starts after the first.
  for (int64_t m = 0; m < M; ++m) {
    shard_op(StepOpKind::kHeadGrad, Lane::kCompute, {kVisitLoad, loss}, m);
    if (last_shard) shard_op(StepOpKind::kHeadNormBackward, Lane::kCompute, {}, m);
  }
  if (!grads) return out;
  const int32_t send = shard_op(StepOpKind::kGradsToSend, Lane::kCompute, {});
  for (int64_t p : {norm_trained ? sh.norm_piece : int64_t(-1), lm_trained ? lm : int64_t(-1)}) {
    if (p < 0) continue;
    StepOp o = d.visit_op(StepOpKind::kGradsOut, Lane::kD2H, v, {send});  // a tied LM head's: pass "tied"
    o.piece = p;
    o.block = place.piece(p).block;
    out.push_back(d.add(std::move(o)));
  }
  return out;
}

// A layer's (or an embedding shard's) visit: forward, the recompute of a
// sub-layer attention half, or backward with its gradients out.
std::vector<int32_t> layer_visit(Draft& d, int64_t v, bool& grads) {
  const Visit& vis = d.visits[size_t(v)];
  const int64_t M = d.in.micro_batches;
  const std::vector<int64_t> loads = d.visit_pieces(v);
  const StepOpKind compute = vis.kind == Visit::kBackward ? StepOpKind::kBackward : StepOpKind::kForward;
  auto piece_op = [&](StepOpKind kind, std::vector<int32_t> after, int64_t m = -1) {
    StepOp o = d.visit_op(kind, Lane::kCompute, v, std::move(after));
    o.piece = vis.piece;
    o.micro_batch = m;
    return d.add(std::move(o));
  };
  // A frozen block's backward computes the input gradient only: no accumulators.
  grads = vis.kind == Visit::kBackward &&
          std::any_of(loads.begin(), loads.end(), [&](int64_t q) { return !d.place.piece(q).frozen; });
  if (grads) piece_op(StepOpKind::kZeroGrads, {kVisitLoad});  // a tied embedding's: pass "tied"
  int32_t last = -1;
  for (int64_t m = 0; m < M; ++m) {
    last = piece_op(compute, {kVisitLoad}, m);
    ComputeArgs& a = d.op(last).as<ComputeArgs>();
    a.recompute = vis.kind == Visit::kRecompute;
    a.packed = d.in.packed_documents && vis.block >= 1 && vis.block < d.place.head;  // a decoder layer
  }
  std::vector<int32_t> out;
  if (!grads) return out;
  const int32_t send = piece_op(StepOpKind::kGradsToSend, {last});
  // In landing order (a layer's pieces in reverse): the ring's slots are handed out in it.
  for (auto q = loads.rbegin(); q != loads.rend(); ++q) {
    if (d.place.piece(*q).frozen) continue;
    StepOp o = d.visit_op(StepOpKind::kGradsOut, Lane::kD2H, v, {send});
    o.piece = *q;
    out.push_back(d.add(std::move(o)));
  }
  return out;
}

}  // namespace

// Each visit's compute per micro-batch, its gradients out (training), and its
// release, waiting for the gradients on the d2h stream.
void pass_micro_batches(Draft& d) {
  int32_t loss = -1;
  for (int64_t v = 0; v < int64_t(d.visits.size()); ++v) {
    const Visit& vis = d.visits[size_t(v)];
    bool grads = false;
    std::vector<int32_t> out = vis.kind == Visit::kHead ? head_visit(d, v, grads, loss) : layer_visit(d, v, grads);
    StepOp r = d.visit_op(StepOpKind::kRelease, Lane::kCompute, v, std::move(out));
    r.as<ReleaseArgs>().d2h = grads;
    r.piece = vis.piece;
    r.shard = vis.shard;
    d.add(std::move(r));
  }
}

}  // namespace strider
