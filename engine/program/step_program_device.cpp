// The step program's device operations (engine/program/step_program_device.h): the
// passes "visits", "micro-batches", "prefetch", "base format", "host
// checkpoints", "devices", "kept activations", "tied", and the compute
// copies' reads of "nvme" (engine/program/step_program.h lists what each adds).
#include "engine/program/step_program_device.h"

#include <algorithm>
#include <iterator>

#include <fmt/format.h>

#include "host/error.h"

namespace strider {

namespace {

bool keeps(const Placement& place, int64_t b) {
  return b > 0 && b < place.head && place.saved_index[size_t(b)] >= 0;
}

// One visit of the sliding window: a piece's forward or backward, or the
// head's visit of one vocabulary shard (pass 1, pass 2, or both).
// A layer cut into sub-layer pieces has one more in backward, kRecompute:
// its attention half again before its MLP slices' backward, for the MLP's
// input (the slices' checkpoint), so that the device holds that input for
// one layer at a time, not for every layer from forward to backward.
struct Visit {
  enum Kind { kForward, kHead, kBackward, kRecompute } kind;
  int64_t piece = -1, shard = -1;
  bool lse = false, grad = false;
};

// The pieces a visit loads (Sharding::visit_pieces): an embedding shard, a
// layer's pieces, or (the head) the norm and one shard's LM-head rows.
std::vector<int64_t> visit_pieces(const Placement& place, const Visit& v) {
  return place.shards.visit_pieces(v.piece, v.kind == Visit::kHead ? v.shard : -1);
}

// Pass "visits": forward (embedding shards, layers), the head's shards (pass 1
// over all, then pass 2 over all; one visit each when there is one shard),
// backward (layers, then embedding shards, in reverse, to the first trained
// block). A layer is one visit however many pieces cut it (named by its
// first), unless they are sub-layer pieces: each of those is a visit.
std::vector<Visit> visits(const Placement& place, bool train) {
  const Sharding& sh = place.shards;
  std::vector<int64_t> forward;  // each visit's first piece
  for (int64_t p = 0; p < sh.first_of(place.head); ++p)
    if (place.piece(p).rows() || place.piece(p).sub_layer || p == sh.first_of(place.piece(p).block)) forward.push_back(p);
  std::vector<Visit> out;
  for (int64_t p : forward) out.push_back({Visit::kForward, p});
  if (!train || sh.shards > 1)
    for (int64_t s = 0; s < sh.shards; ++s) out.push_back({Visit::kHead, -1, s, true, false});
  if (!train) return out;
  for (int64_t s = 0; s < sh.shards; ++s) out.push_back({Visit::kHead, -1, s, sh.shards == 1, true});
  const int64_t first = place.first_trained_block();
  for (auto p = forward.rbegin(); p != forward.rend(); ++p) {
    const int64_t b = place.piece(*p).block;
    if (b < first) continue;
    if (place.piece(*p).sub_layer && *p + 1 == sh.end_of(b)) out.push_back({Visit::kRecompute, sh.first_of(b)});
    out.push_back({Visit::kBackward, *p});
  }
  return out;
}

// Builds the device operations, remembering where the cross-lane ones are.
class DeviceBuilder {
 public:
  DeviceBuilder(const Placement& place, const ProgramInputs& in, bool train, std::vector<StepOp>& ops)
      : tied_out_(size_t(place.shards.shards), -1), pl_(place), in_(in), train_(train), ops_(ops),
        ckpt_out_(size_t(place.head + 1), -1), saved_out_(size_t(place.head + 1), -1),
        first_trained_(place.first_trained_block()) {}

  int32_t add(StepOpKind k, Lane lane, int64_t v, int64_t block, std::vector<int32_t> after = {}) {
    StepOp o{.kind = k, .lane = lane, .block = block, .visit = v, .device = dev_, .after = std::move(after)};
    if (v >= 0 && v != visit_) {
      visit_ = v;
      o.first_of_visit = k != StepOpKind::kLoad;
    }
    ops_.push_back(std::move(o));
    return int32_t(ops_.size()) - 1;
  }
  StepOp& op(int32_t i) { return ops_[size_t(i)]; }

  // Pass "micro-batches", with "host checkpoints", "kept activations",
  // "kept logits" and "tied" inside each visit: visit v's operations after its load.
  void expand(const Visit& vis, int64_t v, int32_t load) {
    const int64_t M = in_.micro_batches;
    const Sharding& sh = pl_.shards;
    visit_ = -1;
    handed_in_ = false;
    dev_ = vis.kind == Visit::kHead ? pl_.head_device(vis.shard) : pl_.block_device(pl_.piece(vis.piece).block);
    int32_t last = -1;  // the latest compute operation of the visit
    std::vector<int32_t> out;  // what the release waits for on the d2h stream
    bool grads = false;
    // Pass "base format": a quantized base, landed with the load, becomes
    // the unit's parameters before anything computes with them.
    if (vis.kind != Visit::kHead)
      for (int64_t q : visit_pieces(pl_, vis))
        if (pl_.piece(q).quantized) {
          last = add(StepOpKind::kDequantize, Lane::kCompute, v, pl_.piece(q).block, {load});
          op(last).piece = q;
        }
    if (vis.kind == Visit::kForward) {
      const std::vector<int64_t> loads = visit_pieces(pl_, vis);
      const int64_t p = vis.piece, b = pl_.piece(p).block;
      const bool first_piece = loads.front() == sh.first_of(b), last_piece = loads.back() + 1 == sh.end_of(b);
      const bool keep = train_ && keeps(pl_, b);
      for (int64_t m = 0; m < M; ++m) {
        if (first_piece && b >= 1) hand_in(v, Hand::kBlock, b, false, pl_.block_device(b - 1), m);
        std::vector<int32_t> after{load};
        const bool wait_ring = in_.checkpoints_on_host && first_piece && m == 0;
        if (wait_ring && b >= 1 && ckpt_out_[size_t(b)] >= 0) after.push_back(ckpt_out_[size_t(b)]);
        last = add(StepOpKind::kForward, Lane::kCompute, v, b, std::move(after));
        op(last).piece = p;
        op(last).micro_batch = m;
        op(last).keep = keep;
        op(last).wait_ring = wait_ring;
        if (keep) {
          const int32_t save = add(StepOpKind::kSaveOut, Lane::kD2H, v, b, {last});
          op(save).micro_batch = m;
          op(save).last = m + 1 == M;
          saved_out_[size_t(b)] = save;
        }
        if (last_piece && takes_elsewhere(b + 1)) hand_out(v, Hand::kBlock, b + 1, false, last, m);
      }
      if (in_.checkpoints_on_host && last_piece && b + 1 < pl_.head)
        for (int64_t m = 0; m < M; ++m) {
          const int32_t c = add(StepOpKind::kCheckpointOut, Lane::kD2H, v, b + 1, {last});
          op(c).micro_batch = m;
          op(c).first = m == 0;
          op(c).last = m + 1 == M;
          ckpt_out_[size_t(b + 1)] = c;
        }
    } else if (vis.kind == Visit::kHead) {
      // Pass "devices" here: shard s runs on head_device(s); the head's
      // input comes in where a device runs its first shard; the per-token
      // state (pass 1) and the hidden gradient (pass 2) pass from shard to
      // shard, and the log-sum-exp from the last shard to the others.
      const int64_t s = vis.shard, h = pl_.head;
      const bool last_shard = s + 1 == sh.shards, grad = train_ && vis.grad;
      const int prev = s > 0 ? pl_.head_device(s - 1) : dev_, next = last_shard ? dev_ : pl_.head_device(s + 1);
      const int lse_from = pl_.last_head_device();
      const bool first_here = pl_.first_head_shard_on_device(s);
      if (vis.lse) {
        for (int64_t m = 0; m < M; ++m) {
          if (first_here) hand_in(v, Hand::kBlock, h, false, pl_.block_device(h - 1), m);
          hand_in(v, Hand::kHeadState, h, false, prev, m);
          last = add(StepOpKind::kHeadLse, Lane::kCompute, v, h, {load});
          op(last).shard = s;
          op(last).micro_batch = m;
          op(last).keep = train_ && in_.keep_logits;
          if (next != dev_) hand_out(v, Hand::kHeadState, h, false, last, m);
          if (last_shard && train_ && pl_.head_spread()) hand_out(v, Hand::kLse, h, false, last, m);
        }
        if (last_shard) loss_ = add(StepOpKind::kLossOut, Lane::kD2H, v, h, {last});
      }
      const int64_t lm = sh.lm_piece[size_t(s)];
      const bool norm_trained = last_shard && !pl_.piece(sh.norm_piece).frozen, lm_trained = !pl_.piece(lm).frozen;
      if (grad) {
        grads = norm_trained || lm_trained;  // else frozen: no accumulators, nothing sent
        if (grads) {
          last = add(StepOpKind::kZeroGrads, Lane::kCompute, v, h, {load});
          op(last).shard = s;
        }
        // The last shard's norm backward follows each micro-batch's
        // gradient, so the next block's backward starts after the first.
        for (int64_t m = 0; m < M; ++m) {
          if (!vis.lse && first_here) hand_in(v, Hand::kLse, h, false, lse_from, m);
          hand_in(v, Hand::kHeadGrad, h, false, prev, m);
          last = add(StepOpKind::kHeadGrad, Lane::kCompute, v, h, {load, loss_});
          op(last).shard = s;
          op(last).micro_batch = m;
          op(last).keep = in_.keep_logits;
          if (next != dev_) hand_out(v, Hand::kHeadGrad, h, false, last, m);
          if (!last_shard) continue;
          last = add(StepOpKind::kHeadNormBackward, Lane::kCompute, v, h);
          op(last).micro_batch = m;
          op(last).shard = s;
          if (h - 1 >= first_trained_ && takes_elsewhere(h - 1, true)) hand_out(v, Hand::kBlock, h - 1, true, last, m);
        }
        const int32_t send = grads ? add(StepOpKind::kGradsToSend, Lane::kCompute, v, h) : -1;
        if (grads) op(send).shard = s;
        if (norm_trained) out.push_back(grads_out(v, sh.norm_piece, send));
        if (lm_trained && pl_.piece(lm).block == h) {
          out.push_back(grads_out(v, lm, send));
        } else if (lm_trained) {  // tied: the head's share of the embedding's gradient, in fp32
          out.push_back(tied_out_[size_t(s)] = add(StepOpKind::kTiedGradOut, Lane::kD2H, v, h, {send}));
          op(out.back()).shard = s;
          op(out.back()).piece = lm;
        }
      }
    } else if (vis.kind == Visit::kRecompute) {
      // Its input (back from the host, or from the device that made it),
      // then the attention half's forward again, micro-batch by micro-batch.
      const int64_t b = pl_.piece(vis.piece).block;
      const int32_t back = checkpoints_in(v, b);
      for (int64_t m = 0; m < M; ++m) {
        std::vector<int32_t> after{load};
        if (back >= 0) after.push_back(back);
        last = add(StepOpKind::kForward, Lane::kCompute, v, b, std::move(after));
        op(last).piece = vis.piece;
        op(last).micro_batch = m;
        op(last).recompute = true;
      }
    } else {
      const int64_t p = vis.piece, b = pl_.piece(p).block;
      const std::vector<int64_t> loads = visit_pieces(pl_, vis);
      grads = std::any_of(loads.begin(), loads.end(), [&](int64_t q) { return !pl_.piece(q).frozen; });
      // A layer cut into sub-layer pieces: its first backward visit (its last
      // piece) takes the output gradient, its attention half (its first)
      // hands on the input's gradient; the input came in for the recompute
      // visit before its slices, and stays.
      const bool sub = pl_.piece(p).sub_layer;
      const bool hands_on = !sub || p == sh.first_of(b), takes_grad = !sub || p + 1 == sh.end_of(b);
      // A frozen block's backward computes the input gradient only: no accumulators.
      if (grads && b == 0 && pl_.piece(sh.lm_piece[0]).block == 0) {  // tied: starts from the head's share
        std::vector<int32_t> after;
        for (int32_t t : tied_out_)
          if (t >= 0) after.push_back(t);
        last = add(StepOpKind::kTiedGradIn, Lane::kH2D, v, b, std::move(after));
        op(last).piece = p;
      } else if (grads) {
        last = add(StepOpKind::kZeroGrads, Lane::kCompute, v, b, {load});
        op(last).piece = p;
      }
      const int32_t back = sub ? -1 : checkpoints_in(v, b);
      const bool keep = keeps(pl_, b);
      for (int64_t m = 0; m < M; ++m) {
        // A pool: micro-batch m's output gradient comes in before m + 1's
        // kept activations, which wait for a slot that m - 1's backward
        // frees (two slots): behind them on the h2d stream the hand-in, and
        // with it m's backward, waited for m - 1's end and a fetch's copy.
        if (takes_grad && !(b == 0 && handed_grads_to_embedding_))  // the embedding's shards share one device: the first takes it
          hand_in(v, Hand::kBlock, b, true, grad_from(b), m);
        if (keep && m + 1 < M) fetch(b, m + 1, v);
        std::vector<int32_t> after{load};
        if (back >= 0) after.push_back(back);
        if (keep) after.push_back(fetched_[size_t(m)]);
        last = add(StepOpKind::kBackward, Lane::kCompute, v, b, std::move(after));
        op(last).piece = p;
        op(last).micro_batch = m;
        op(last).keep = keep;
        if (hands_on && b - 1 >= first_trained_ && takes_elsewhere(b - 1, true))
          hand_out(v, Hand::kBlock, b - 1, true, last, m);
      }
      if (b == 0) handed_grads_to_embedding_ = true;  // its shards share one device: the first took it
      if (grads) {
        const int32_t send = add(StepOpKind::kGradsToSend, Lane::kCompute, v, b, {last});
        op(send).piece = p;
        // In landing order (a layer's pieces in reverse): the ring's slots are handed out in it.
        for (auto q = loads.rbegin(); q != loads.rend(); ++q)
          if (!pl_.piece(*q).frozen) out.push_back(grads_out(v, *q, send));
      }
    }
    const int32_t r = add(StepOpKind::kRelease, Lane::kCompute, v, vis.kind == Visit::kHead ? pl_.head : pl_.piece(vis.piece).block, out);
    op(r).d2h = grads;
    if (vis.kind != Visit::kHead) op(r).piece = vis.piece;
    op(r).shard = vis.shard;
  }

  // Pass "host checkpoints": layer b's inputs back in during visit v (the
  // last: what its compute waits for; -1: none, they live on the device).
  int32_t checkpoints_in(int64_t v, int64_t b) {
    int32_t back = -1;
    if (in_.checkpoints_on_host && b >= 1 && b < pl_.head)
      for (int64_t m = 0; m < in_.micro_batches; ++m) {
        back = add(StepOpKind::kCheckpointIn, Lane::kH2D, v, b, {ckpt_out_[size_t(b)]});
        op(back).micro_batch = m;
        op(back).peer = peer(b - 1, b);
        op(back).first = m == 0;
        op(back).last = m + 1 == in_.micro_batches;
      }
    return back;
  }

  // Pass "kept activations": micro-batch m of layer b's kept activations, in
  // during visit v (for m = 0: the visit before its backward).
  void fetch(int64_t b, int64_t m, int64_t v) {
    fetched_.resize(size_t(in_.micro_batches), -1);
    fetched_[size_t(m)] = add(StepOpKind::kFetchSaved, Lane::kH2D, v, b, {saved_out_[size_t(b)]});
    op(fetched_[size_t(m)]).micro_batch = m;
    op(fetched_[size_t(m)]).device = pl_.block_device(b);  // where its backward runs
  }

  // Pass "devices": the device that made what block `to` takes (its input:
  // block to - 1's; its output gradient: block to + 1's, or the head's last
  // shard's), when another.
  int peer(int64_t from, int64_t to) const { return pl_.block_device(from) == pl_.block_device(to) ? -1 : pl_.block_device(from); }
  int grad_from(int64_t b) const { return b + 1 == pl_.head ? pl_.last_head_device() : pl_.block_device(b + 1); }
  // Whether a device other than this visit's takes block b's input (the
  // head's: any of its shards' devices), or (`grads`) its output gradient.
  bool takes_elsewhere(int64_t b, bool grads = false) const {
    if (grads || b < pl_.head) return pl_.block_device(b) != dev_;
    return pl_.head_spread() || pl_.head_device(0) != dev_;  // spread: its shards' devices are several
  }
  // What `hand` carries for block b (`grads`: its output gradient) for
  // micro-batch m, out of this visit's device right after `last` (its
  // compute), so the next device starts on it while this one computes the
  // next micro-batch. (With host checkpoints too: the checkpoints leave
  // after the visit's last micro-batch.)
  void hand_out(int64_t v, Hand hand, int64_t b, bool grads, int32_t last, int64_t m) {
    const int32_t h = add(StepOpKind::kHandOut, Lane::kD2H, v, b, {last});
    op(h).micro_batch = m;
    op(h).grads = grads;
    op(h).hand = hand;
    std::vector<int32_t>& outs = hand_out_[size_t(hand)];
    outs.resize(size_t(in_.micro_batches), -1);
    outs[size_t(m)] = h;
  }
  // ...and in on this visit's device from device `from`, before its compute
  // of micro-batch m; nothing when `from` is this device.
  void hand_in(int64_t v, Hand hand, int64_t b, bool grads, int from, int64_t m) {
    if (from == dev_) return;
    const int32_t h = add(StepOpKind::kHandIn, Lane::kH2D, v, b, {hand_out_[size_t(hand)][size_t(m)]});
    op(h).micro_batch = m;
    op(h).grads = grads;
    op(h).hand = hand;
    op(h).peer = from;
    op(h).first = !handed_in_;  // the visit's first: it waits for this device's compute so far
    handed_in_ = true;
  }
  int32_t grads_out(int64_t v, int64_t p, int32_t send) {
    const int32_t g = add(StepOpKind::kGradsOut, Lane::kD2H, v, pl_.piece(p).block, {send});
    op(g).piece = p;
    grads_out_.resize(size_t(pl_.num_pieces()), -1);
    grads_out_[size_t(p)] = g;
    return g;
  }

  int32_t loss_ = -1;                // the kLossOut
  std::vector<int32_t> grads_out_;   // per piece: its kGradsOut
  std::vector<int32_t> tied_out_;    // per vocabulary shard: its kTiedGradOut

 private:
  const Placement& pl_;
  const ProgramInputs& in_;
  bool train_;
  std::vector<StepOp>& ops_;
  int64_t visit_ = -1;
  std::vector<int32_t> fetched_;  // per micro-batch: the latest layer's kFetchSaved
  std::vector<int32_t> ckpt_out_, saved_out_;  // per block: its latest kCheckpointOut (its input), kSaveOut
  int dev_ = 0;                   // the device of the visit being expanded
  std::vector<int32_t> hand_out_[kHandKinds];  // per kind, per micro-batch: its latest kHandOut
  bool handed_in_ = false;        // the visit being expanded has a kHandIn already
  bool handed_grads_to_embedding_ = false;
  int64_t first_trained_ = 0;     // Placement::first_trained_block: no gradient is handed to a block before it
};

// Pass "prefetch": visit i's load is issued before visit i - (K - 2) computes
// (the first K - 1 loads before the first visit; K = 2: just before its
// visit), into the unit visit i - K released; a kept layer's first
// micro-batch comes in during the visit before its backward. Returns the
// visits; fills `ops`.
//
// Why not K - 1 ahead, as the window allows: the load waits for its unit's
// release (the visit's gradients off the device), and the h2d stream runs in
// order, so a load issued before visit i - (K - 1) held every copy issued
// after it (that visit's host checkpoints and kept activations in) until
// visit i - K's gradients had left: predicted for Llama-3.1-8B on the rtx4090
// preset, each layer's backward waited ~27 ms for its second micro-batch's
// activations. One visit later the unit is free by the time the stream gets
// there, and with nothing else on the stream the load starts when it did.
std::vector<Visit> device_program(const Placement& place, const ProgramInputs& in, bool train,
                                  std::vector<StepOp>& ops, DeviceBuilder& d) {
  std::vector<Visit> vs = visits(place, train);
  const size_t n = vs.size(), ahead = size_t(in.window) - 2, K = size_t(in.window);
  auto device_of = [&](size_t i) {
    return vs[i].kind == Visit::kHead ? place.head_device(vs[i].shard)
                                      : place.block_device(place.piece(vs[i].piece).block);
  };
  // Per device: its visits in order (a pool's devices each slide their own window).
  std::vector<std::vector<size_t>> mine(size_t(place.devices));
  std::vector<size_t> nth(n);  // visit i is its device's nth
  for (size_t i = 0; i < n; ++i) {
    nth[i] = mine[size_t(device_of(i))].size();
    mine[size_t(device_of(i))].push_back(i);
  }
  std::vector<int32_t> load(n, -1), release(n, -1), read(n, -1);
  std::vector<size_t> done(size_t(place.devices), 0), next(size_t(place.devices), 0);
  // Pass "nvme" (compute copies): a visit whose pieces' compute copies live
  // on NVMe reads them into a load staging slot, issued right after the load
  // before its own (so the read runs while that load's copy does), the
  // slots taken in turn: a slot is read into again kComputeLoadSlots reads
  // later, when the load of the read before it has been issued at least.
  auto reads_compute = [&](size_t j) {
    return vs[j].kind != Visit::kHead && place.at(vs[j].piece).compute_on_nvme;
  };
  int reads = 0;
  auto emit_read = [&](size_t j) {
    const int64_t b = place.piece(vs[j].piece).block;
    read[j] = d.add(StepOpKind::kReadCompute, Lane::kNvmeRead, int64_t(j), b);
    StepOp& r = d.op(read[j]);
    r.first_of_visit = false;
    r.piece = vs[j].piece;
    r.device = device_of(j);
    r.slot = reads++ % kComputeLoadSlots;
  };
  auto emit_load = [&](size_t j) {
    const std::vector<size_t>& own = mine[size_t(device_of(j))];
    std::vector<int32_t> after;
    if (nth[j] >= K) after.push_back(release[own[nth[j] - K]]);
    if (reads_compute(j) && read[j] < 0) emit_read(j);
    if (read[j] >= 0) after.push_back(read[j]);
    load[j] = d.add(StepOpKind::kLoad, Lane::kH2D, int64_t(j), -1, std::move(after));
    StepOp& l = d.op(load[j]);
    l.piece = vs[j].piece;
    l.shard = vs[j].shard;
    l.block = vs[j].kind == Visit::kHead ? place.head : place.piece(vs[j].piece).block;
    l.device = device_of(j);
    if (read[j] >= 0) l.slot = d.op(read[j]).slot;
    for (size_t k = j + 1; k < n; ++k)
      if (reads_compute(k)) {
        if (read[k] < 0) emit_read(k);
        break;
      }
  };
  for (size_t i = 0; i < n; ++i) {
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
      emit_load(i);
    } else {
      // Each device's loads up to K-2 of its visits ahead of those it has
      // run, in visit order.
      std::vector<size_t> due;
      for (size_t dv = 0; dv < mine.size(); ++dv)
        for (; next[dv] < mine[dv].size() && next[dv] <= done[dv] + ahead; ++next[dv]) due.push_back(mine[dv][next[dv]]);
      std::sort(due.begin(), due.end());
      for (size_t j : due) emit_load(j);
    }
    d.expand(vs[i], int64_t(i), load[i]);
    release[i] = int32_t(ops.size()) - 1;
    ++done[size_t(device_of(i))];
    if (train && i + 1 < n && vs[i + 1].kind == Visit::kBackward) {
      const int64_t b = place.piece(vs[i + 1].piece).block;
      if (keeps(place, b)) d.fetch(b, 0, int64_t(i));
    }
  }
  return vs;
}

// Each visit's unit layout, from its load (which names the visit's first piece, or the head's shard).
void lay_out_visits(const Placement& place, StepProgram& prog) {
  prog.layouts.assign(size_t(prog.visits), {});
  for (const StepOp& o : prog.ops)
    if (o.kind == StepOpKind::kLoad)
      prog.layouts[size_t(o.visit)] = place.shards.unit_layout(place.shards.visit_pieces(o.piece, o.shard));
}

}  // namespace

DeviceOps compile_device(const Placement& place, const ProgramInputs& in, bool train, StepProgram& prog) {
  DeviceBuilder dev(place, in, train, prog.ops);
  prog.visits = int64_t(device_program(place, in, train, prog.ops, dev).size());
  lay_out_visits(place, prog);
  return {std::move(dev.grads_out_), dev.loss_};
}

}  // namespace strider
