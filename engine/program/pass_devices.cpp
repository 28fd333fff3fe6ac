// Pass "devices" (a pool, Placement::devices > 1): what a visit on one device
// hands to a visit on another, per micro-batch, each kind in its own host
// buffers (Hand): a block's input (or output gradient) out right after the
// compute that made it, so the next device starts on it while this one
// computes the next micro-batch, and in just before the compute that takes
// it; the head's per-token state (pass 1) and hidden gradient (pass 2) from
// shard to shard, and the log-sum-exp from the last shard to the others
// (with an objective past SFT, after it, with its coefficients).
#include "engine/program/passes.h"

namespace strider {

namespace {

class Hands {
 public:
  explicit Hands(Draft& d) : d_(d), pl_(d.place) {}

  void run() {
    const Sharding& sh = pl_.shards();
    const int64_t h = pl_.head, first_trained = pl_.first_trained_block();
    bool handed_to_embedding = false;  // the embedding's shards share one device: the first takes its gradient
    int64_t visit = -1;
    for (int32_t id : d_.in_order()) {
      const StepOp o = d_.op(id);  // a copy: inserting moves the operations
      if (o.visit < 0) continue;
      if (o.visit != visit) handed_in_ = false;
      visit = o.visit;
      const Visit& vis = d_.visits[size_t(o.visit)];
      dev_ = vis.device;
      const int64_t b = vis.block;
      if (o.kind == StepOpKind::kForward && vis.kind == Visit::kForward) {
        const std::vector<int64_t> loads = d_.visit_pieces(o.visit);
        if (loads.front() == sh.first_of(b) && b >= 1) hand_in(id, Hand::kBlock, b, false, pl_.block_device(b - 1));
        if (loads.back() + 1 == sh.end_of(b) && takes_elsewhere(b + 1)) hand_out(id, id, Hand::kBlock, b + 1, false);
      } else if (o.kind == StepOpKind::kHeadLse || o.kind == StepOpKind::kHeadGrad) {
        const int64_t s = vis.shard;
        const bool last_shard = s + 1 == sh.shards, first_here = pl_.first_head_shard_on_device(s);
        const int prev = s > 0 ? pl_.head_device(s - 1) : dev_, next = last_shard ? dev_ : pl_.head_device(s + 1);
        const Hand state = o.kind == StepOpKind::kHeadLse ? Hand::kHeadState : Hand::kHeadGrad;
        if (o.kind == StepOpKind::kHeadLse && first_here) hand_in(id, Hand::kBlock, h, false, pl_.block_device(h - 1));
        if (o.kind == StepOpKind::kHeadGrad && !vis.lse && first_here) hand_in(id, Hand::kLse, h, false, pl_.last_head_device());
        hand_in(id, state, h, false, prev);
        int32_t at = id;
        if (next != dev_) at = hand_out(id, at, state, h, false);
        if (o.kind == StepOpKind::kHeadLse && last_shard && d_.train && pl_.head_spread() && !d_.in.objective)
          hand_out(id, at, Hand::kLse, h, false);
      } else if (o.kind == StepOpKind::kObjective && pl_.head_spread()) {
        // An objective's coefficients exist once it has run over every
        // micro-batch: each micro-batch's log-sum-exp goes with them, after it.
        int32_t at = id;
        for (int64_t m = 0; m < d_.in.micro_batches; ++m) at = hand_out(id, at, Hand::kLse, h, false, m);
      } else if (o.kind == StepOpKind::kHeadNormBackward) {
        if (h - 1 >= first_trained && takes_elsewhere(h - 1, true)) hand_out(id, id, Hand::kBlock, h - 1, true);
      } else if (o.kind == StepOpKind::kBackward) {
        // A layer cut into sub-layer pieces: its first backward visit (its
        // last piece) takes the output gradient, its attention half (its
        // first) hands on the input's gradient.
        const int64_t p = vis.piece;
        const bool sub = pl_.piece(p).sub_layer;
        const bool hands_on = !sub || p == sh.first_of(b), takes_grad = !sub || p + 1 == sh.end_of(b);
        const int from = b + 1 == h ? pl_.last_head_device() : pl_.block_device(b + 1);
        if (takes_grad && !(b == 0 && handed_to_embedding)) hand_in(id, Hand::kBlock, b, true, from);
        if (hands_on && b - 1 >= first_trained && takes_elsewhere(b - 1, true)) hand_out(id, id, Hand::kBlock, b - 1, true);
      } else if (o.kind == StepOpKind::kRelease && vis.kind == Visit::kBackward && b == 0) {
        handed_to_embedding = true;
      }
    }
  }

 private:
  // Whether a device other than this visit's takes block b's input (the
  // head's: any of its shards' devices), or (`grads`) its output gradient.
  bool takes_elsewhere(int64_t b, bool grads = false) const {
    if (grads || b < pl_.head) return pl_.block_device(b) != dev_;
    return pl_.head_spread() || pl_.head_device(0) != dev_;  // spread: its shards' devices are several
  }
  // What `hand` carries for block b (`grads`: its output gradient) for the
  // micro-batch of `compute`, which made it: out right after `at` (that
  // compute, or a hand-out after it).
  int32_t hand_out(int32_t compute, int32_t at, Hand hand, int64_t b, bool grads, int64_t m = -1) {
    StepOp o = d_.visit_op(StepOpKind::kHandOut, Lane::kD2H, d_.op(compute).visit, {compute});
    o.block = b;
    o.micro_batch = m >= 0 ? m : d_.op(compute).micro_batch;  // m: of a compute over every micro-batch
    o.as<HandArgs>() = {.hand = hand, .grads = grads};
    const int32_t id = d_.insert_after(at, std::move(o));
    std::vector<int32_t>& outs = out_[size_t(hand)];
    outs.resize(size_t(d_.in.micro_batches), -1);
    outs[size_t(d_.op(id).micro_batch)] = id;
    return id;
  }
  // ...and in on this visit's device from device `from`, just before the
  // compute `at`; nothing when `from` is this device.
  void hand_in(int32_t at, Hand hand, int64_t b, bool grads, int from) {
    if (from == dev_) return;
    const int64_t m = d_.op(at).micro_batch;
    StepOp o = d_.visit_op(StepOpKind::kHandIn, Lane::kH2D, d_.op(at).visit, {out_[size_t(hand)][size_t(m)]});
    o.block = b;
    o.micro_batch = m;
    // The visit's first waits for this device's compute so far, and (host
    // checkpoints) a block input's for its ring set to have left.
    o.as<HandArgs>() = {.hand = hand, .grads = grads, .first = !handed_in_, .peer = from,
                        .wait_ring = !handed_in_ && d_.in.checkpoints_on_host && hand == Hand::kBlock && !grads};
    handed_in_ = true;
    d_.insert_before(at, std::move(o));
  }

  Draft& d_;
  const Placement& pl_;
  int dev_ = 0;             // the device of the visit being walked
  bool handed_in_ = false;  // the visit being walked has a kHandIn already
  std::vector<int32_t> out_[kHandKinds];  // per kind, per micro-batch: its latest kHandOut
};

}  // namespace

// Expects passes "micro-batches" and "host checkpoints": a hand-in goes just
// before its compute (after the visit's checkpoints in), a hand-out just after.
void pass_devices(Draft& d) { Hands(d).run(); }

}  // namespace strider
