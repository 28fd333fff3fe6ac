#include "engine/program/draft.h"

#include "host/error.h"

namespace strider {

int32_t Draft::add(StepOp op) {
  ops_.push_back(std::move(op));
  where_.push_back(order_.insert(order_.end(), int32_t(ops_.size()) - 1));
  return int32_t(ops_.size()) - 1;
}

int32_t Draft::insert_before(int32_t at, StepOp op) {
  ops_.push_back(std::move(op));
  where_.push_back(order_.insert(where_[size_t(at)], int32_t(ops_.size()) - 1));
  return int32_t(ops_.size()) - 1;
}

int32_t Draft::insert_after(int32_t at, StepOp op) {
  ops_.push_back(std::move(op));
  where_.push_back(order_.insert(std::next(where_[size_t(at)]), int32_t(ops_.size()) - 1));
  return int32_t(ops_.size()) - 1;
}

std::vector<int64_t> Draft::visit_pieces(int64_t v) const {
  const Visit& vis = visits[size_t(v)];
  return place.shards().visit_pieces(vis.piece, vis.kind == Visit::kHead ? vis.shard : -1);
}

StepOp Draft::visit_op(StepOpKind kind, Lane lane, int64_t v, std::vector<int32_t> after) const {
  StepOp o = StepOp::of(kind, lane, std::move(after));
  o.block = visits[size_t(v)].block;
  o.visit = v;
  o.device = visits[size_t(v)].device;
  return o;
}

StepOp host_op(const Placement& place, StepOpKind kind, Lane lane, int64_t p, std::vector<int32_t> after) {
  StepOp o = StepOp::of(kind, lane, std::move(after));
  o.piece = p;
  o.block = p >= 0 ? place.piece(p).block : -1;
  return o;
}

bool keeps_activations(const Placement& place, int64_t b) {
  return b > 0 && b < place.head && place.saved_index[size_t(b)] >= 0;
}

StepProgram Draft::finish() const {
  std::vector<int32_t> index(ops_.size(), -1), load(visits.size(), -1);
  int32_t n = 0;
  for (int32_t id : order_) {
    index[size_t(id)] = n++;
    if (ops_[size_t(id)].kind == StepOpKind::kLoad) load[size_t(ops_[size_t(id)].visit)] = index[size_t(id)];
  }
  auto renumber = [&](int32_t id) { return id >= 0 ? index[size_t(id)] : id; };
  StepProgram prog;
  prog.visits = int64_t(visits.size());
  std::vector<bool> started(visits.size(), false);
  for (int32_t id : order_) {
    StepOp o = ops_[size_t(id)];
    for (int32_t& a : o.after) {
      STRIDER_CHECK(a != kVisitLoad || o.visit >= 0, "step program: a {} waits for its visit's load but has no visit",
                    op_name(o.kind));
      a = a == kVisitLoad ? load[size_t(o.visit)] : renumber(a);
    }
    for (int32_t& a : o.after_previous) a = renumber(a);
    // The visit's first operation after its load (and its compute copies' read) waits for the load.
    o.first_of_visit = o.visit >= 0 && o.kind != StepOpKind::kLoad && o.kind != StepOpKind::kReadCompute &&
                       !started[size_t(o.visit)];
    if (o.first_of_visit) started[size_t(o.visit)] = true;
    prog.ops.push_back(std::move(o));
  }
  for (int32_t i : landed) prog.landed.push_back(renumber(i));
  for (int32_t i : updated) prog.updated.push_back(renumber(i));
  prog.norm = renumber(norm);
  prog.layouts.assign(visits.size(), {});
  for (const StepOp& o : prog.ops)
    if (o.kind == StepOpKind::kLoad)
      prog.layouts[size_t(o.visit)] = place.shards().unit_layout(place.shards().visit_pieces(o.piece, o.shard));
  return prog;
}

}  // namespace strider
