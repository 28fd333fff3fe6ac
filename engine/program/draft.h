// The step program while its passes build it (engine/program/passes.h):
// operations by id in an order the passes insert into, and the visits of the
// sliding window they belong to. Draft::finish numbers them in that order.
//
// Why a list of ids and not StepProgram::ops itself: a pass adds operations
// beside others (a hand-off just before the compute it feeds, a copy just
// after the compute that made it), and the ids `after` holds must survive
// every insertion. std::list keeps each id's position valid through them.
#pragma once

#include <cstdint>
#include <list>
#include <vector>

#include "engine/program/step_program.h"

namespace strider {

// One visit of the sliding window: a piece's forward or backward, or the
// head's visit of one vocabulary shard (pass 1, pass 2, or both). A layer cut
// into sub-layer pieces has one more in backward, kRecompute: its attention
// half again before its MLP slices' backward, for the MLP's input (the
// slices' checkpoint), so that the device holds that input for one layer at a
// time, not for every layer from forward to backward.
struct Visit {
  enum Kind { kForward, kHead, kBackward, kRecompute } kind = kForward;
  int64_t piece = -1, shard = -1;  // its first piece (not the head's); the head's shard
  bool lse = false, grad = false;  // the head's: pass 1, pass 2
  int64_t block = -1;              // its block (the head's: Placement::head)
  int device = 0;                  // the pool's device it runs on
};

// In an operation's `after` while the passes run: its visit's kLoad, which
// pass "prefetch" places last.
inline constexpr int32_t kVisitLoad = -2;

class Draft {
 public:
  Draft(const Placement& place, const ProgramInputs& in, bool train) : place(place), in(in), train(train) {}

  const Placement& place;
  const ProgramInputs& in;
  const bool train;  // a training pass (else evaluation: forward and pass 1 only)
  std::vector<Visit> visits;

  int32_t add(StepOp op);  // at the end
  int32_t insert_before(int32_t at, StepOp op);
  int32_t insert_after(int32_t at, StepOp op);
  StepOp& op(int32_t id) { return ops_[size_t(id)]; }
  const StepOp& op(int32_t id) const { return ops_[size_t(id)]; }
  // The ids in the program's order (a copy: a pass may insert while it walks it).
  std::vector<int32_t> in_order() const { return {order_.begin(), order_.end()}; }
  // The pieces visit v loads (Sharding::visit_pieces): an embedding shard, a
  // layer's pieces, or (the head) the norm and one shard's LM-head rows.
  std::vector<int64_t> visit_pieces(int64_t v) const;
  // An operation of visit v (kind, lane; its block and device the visit's).
  StepOp visit_op(StepOpKind kind, Lane lane, int64_t v, std::vector<int32_t> after = {}) const;

  // Per piece, set by the host passes: its kLand and kUpdated (-1: frozen).
  std::vector<int32_t> landed, updated;
  int32_t norm = -1;  // the kNorm

  // The program: the operations in order, renumbered; kVisitLoad resolved;
  // each visit's first operation after its load marked; the visits' layouts.
  StepProgram finish() const;

 private:
  std::vector<StepOp> ops_;
  std::list<int32_t> order_;
  std::vector<std::list<int32_t>::iterator> where_;
};

// A host operation on piece p (-1: none) and its block.
StepOp host_op(const Placement& place, StepOpKind kind, Lane lane, int64_t p, std::vector<int32_t> after);

// Layer b keeps its activations for backward (EngineConfig::saved_blocks).
bool keeps_activations(const Placement& place, int64_t b);

}  // namespace strider
