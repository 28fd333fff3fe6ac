#include "engine/step_program.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include "host/error.h"

namespace strider {

const char* op_name(StepOpKind k) {
  switch (k) {
    case StepOpKind::kLoad: return "load";
    case StepOpKind::kForward: return "forward";
    case StepOpKind::kHead: return "head";
    case StepOpKind::kBackward: return "backward";
    case StepOpKind::kFetchSaved: return "fetch kept activations";
    case StepOpKind::kLand: return "land";
    case StepOpKind::kSumRanks: return "sum over ranks";
    case StepOpKind::kSumSquares: return "sum of squares";
    case StepOpKind::kSpill: return "spill";
    case StepOpKind::kCheckLoss: return "check loss";
    case StepOpKind::kCheckGrad: return "check gradient";
    case StepOpKind::kNorm: return "norm";
    case StepOpKind::kReadState: return "read state";
    case StepOpKind::kAdamW: return "adamw";
    case StepOpKind::kWriteState: return "write state";
    case StepOpKind::kGather: return "gather";
    case StepOpKind::kUpdated: return "updated";
  }
  return "?";
}

uint64_t state_bytes(StateFormat format, size_t n) {
  uint64_t total = 0;
  for (StateKind k : {StateKind::kMaster, StateKind::kAdamM, StateKind::kAdamV}) total += state_kind_bytes(format, k, n);
  return total;
}

uint64_t adam_bytes(StateFormat format, size_t n, size_t grad_bytes) {
  const uint64_t state = format == StateFormat::kFp32 ? 24 * n : 10 * n + 16 * (n / kQ8GroupElems);
  return state + n * grad_bytes;
}

namespace {

bool keeps(const Placement& place, int64_t b) {
  return b > 0 && b < place.head && place.saved_index[size_t(b)] >= 0;
}

// The pieces a visit loads: its piece, or (the head) the norm and one shard's LM-head rows.
std::vector<int64_t> visit_pieces(const Placement& place, const StepOp& v) {
  if (v.kind != StepOpKind::kHead) return {v.piece};
  return {place.shards.norm_piece, place.shards.lm_piece[size_t(v.shard)]};
}

// Pass "visits": forward (embedding shards, layers), the head's shards (pass 1
// over all, then pass 2 over all; one visit each when there is one shard),
// backward (layers, then embedding shards, each in reverse).
std::vector<StepOp> visits(const Placement& place, bool train) {
  const Sharding& sh = place.shards;
  std::vector<StepOp> out;
  for (int64_t p = 0; p < sh.first_of(place.head); ++p)
    out.push_back({.kind = StepOpKind::kForward, .piece = p, .block = place.piece(p).block});
  auto head = [&](int64_t s, bool lse, bool grad) {
    out.push_back({.kind = StepOpKind::kHead, .block = place.head, .shard = s, .lse = lse, .grad = grad});
  };
  if (!train || sh.shards > 1)
    for (int64_t s = 0; s < sh.shards; ++s) head(s, true, false);
  if (!train) return out;
  for (int64_t s = 0; s < sh.shards; ++s) head(s, sh.shards == 1, true);
  for (int64_t p = sh.first_of(place.head) - 1; p >= 0; --p)
    out.push_back({.kind = StepOpKind::kBackward, .piece = p, .block = place.piece(p).block});
  return out;
}

// Pass "prefetch": visit i's load is issued before visit i - (K - 1) computes
// (the first K loads before the first visit); a layer that kept its
// activations gets its first micro-batch's in during the visit before its
// backward. Returns the device program; visit v's compute op at visit_op[v].
std::vector<StepOp> prefetch(const Placement& place, std::vector<StepOp> vs, int64_t window, bool train,
                             std::vector<int32_t>& visit_op) {
  const size_t n = vs.size(), ahead = size_t(window) - 1;
  std::vector<StepOp> ops;
  std::vector<int32_t> load_op(n, -1);
  visit_op.assign(n, -1);
  size_t next = 0;
  int32_t fetch = -1;  // the kept activations' fetch for visit i, issued during visit i - 1
  for (size_t i = 0; i < n; ++i) {
    for (; next < n && next <= i + ahead; ++next) {
      StepOp l{.kind = StepOpKind::kLoad, .lane = Lane::kH2D, .block = vs[next].block, .visit = int64_t(next)};
      l.piece = vs[next].piece;
      l.shard = vs[next].shard;
      // Its unit is the one visit next - K released.
      if (next >= size_t(window)) l.after.push_back(visit_op[next - size_t(window)]);
      load_op[next] = int32_t(ops.size());
      ops.push_back(l);
    }
    StepOp v = vs[i];
    v.visit = int64_t(i);
    v.after.push_back(load_op[i]);
    if (fetch >= 0) v.after.push_back(fetch);
    fetch = -1;
    visit_op[i] = int32_t(ops.size());
    ops.push_back(v);
    if (train && i + 1 < n && vs[i + 1].kind == StepOpKind::kBackward && keeps(place, vs[i + 1].block)) {
      StepOp f{.kind = StepOpKind::kFetchSaved, .lane = Lane::kH2D, .block = vs[i + 1].block, .visit = int64_t(i + 1)};
      for (size_t j = 0; j < i; ++j)  // the forward that kept them
        if (vs[j].kind == StepOpKind::kForward && vs[j].block == f.block) f.after.push_back(visit_op[j]);
      fetch = int32_t(ops.size());
      ops.push_back(f);
    }
  }
  return ops;
}

// Which compute op sends each piece's gradients out.
std::vector<int32_t> grads_out_op(const Placement& place, const std::vector<StepOp>& ops) {
  std::vector<int32_t> out(size_t(place.num_pieces()), -1);
  const Sharding& sh = place.shards;
  for (size_t i = 0; i < ops.size(); ++i) {
    const StepOp& o = ops[i];
    if (o.kind == StepOpKind::kBackward) out[size_t(o.piece)] = int32_t(i);
    if (o.kind != StepOpKind::kHead || !o.grad) continue;
    if (o.shard + 1 == sh.shards) out[size_t(sh.norm_piece)] = int32_t(i);
    const int64_t lm = sh.lm_piece[size_t(o.shard)];
    if (place.piece(lm).block == place.head) out[size_t(lm)] = int32_t(i);  // untied
  }
  return out;
}

}  // namespace

StepProgram compile_step(const Placement& place, const ProgramInputs& in) {
  STRIDER_CHECK(in.window >= 2, "the window is {} cache units; it needs at least 2", in.window);
  StepProgram prog;
  std::vector<int32_t> visit_op;
  prog.ops = prefetch(place, visits(place, true), in.window, true, visit_op);
  prog.visits = int64_t(visit_op.size());
  const std::vector<int32_t> sent = grads_out_op(place, prog.ops);
  const int64_t P = place.num_pieces();
  const bool clip = in.clip_norm > 0;
  const bool sharded = !place.block_slices.empty() && place.block_slices[0].size() > 2;
  const bool ranks = in.world > 1 || sharded;
  auto add = [&](StepOpKind k, Lane lane, int64_t p, std::vector<int32_t> after) {
    prog.ops.push_back({.kind = k, .lane = lane, .piece = p, .block = p >= 0 ? place.piece(p).block : -1,
                        .after = std::move(after)});
    return int32_t(prog.ops.size()) - 1;
  };
  int32_t loss_op = -1;  // the head visit that computes the loss
  for (size_t i = 0; i < prog.ops.size(); ++i)
    if (prog.ops[i].kind == StepOpKind::kHead && prog.ops[i].lse && prog.ops[i].shard + 1 == place.shards.shards)
      loss_op = int32_t(i);

  // Pass "clipping" decides the update order: with clipping, forward order
  // after the norm; without, each piece as it lands.
  std::vector<int64_t> order = place.landing;
  if (clip)
    for (int64_t p = 0; p < P; ++p) order[size_t(p)] = p;
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
  prog.landed.assign(size_t(P), -1);
  prog.updated.assign(size_t(P), -1);
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
    prog.ops[size_t(last)].over_slices = sharded;
    prog.ops[size_t(last)].shared_copy = in.shared_compute;
    if (place.at(p).on_nvme) write[size_t(p)] = add(StepOpKind::kWriteState, Lane::kNvmeWrite, p, {last});
    if (sharded) {
      last = add(StepOpKind::kGather, Lane::kOptimizer, p, {last});
      prog.ops[size_t(last)].collective = true;
      prog.ops[size_t(last)].shared_copy = in.shared_compute;
    }
    prog.updated[size_t(p)] = add(StepOpKind::kUpdated, Lane::kOptimizer, p, {last});
  };

  // Pass "landing" (with "ranks" and the spills of "nvme"): each piece as it lands.
  for (size_t i = 0; i < place.landing.size(); ++i) {
    const int64_t p = place.landing[i];
    int32_t last = prog.landed[size_t(p)] = add(StepOpKind::kLand, Lane::kOptimizer, p, {sent[size_t(p)]});
    if (ranks) {
      last = add(StepOpKind::kSumRanks, Lane::kOptimizer, p, {last});
      prog.ops[size_t(last)].over_slices = sharded;
      prog.ops[size_t(last)].collective = true;
    }
    last = sumsq[size_t(p)] = add(StepOpKind::kSumSquares, Lane::kOptimizer, p, {last});
    prog.ops[size_t(last)].over_slices = sharded;
    if (clip) {
      if (place.at(p).spills_grads) spill[size_t(p)] = add(StepOpKind::kSpill, Lane::kNvmeWrite, p, {last});
      continue;
    }
    if (i == 0) last = add(StepOpKind::kCheckLoss, Lane::kOptimizer, -1, {loss_op, last});
    last = add(StepOpKind::kCheckGrad, Lane::kOptimizer, p, {last});
    prog.ops[size_t(last)].updated_before = int64_t(i);
    update(i, {last});
  }
  if (clip) {
    std::vector<int32_t> w{add(StepOpKind::kCheckLoss, Lane::kOptimizer, -1, {loss_op})};
    w.insert(w.end(), sumsq.begin(), sumsq.end());
    prog.norm = add(StepOpKind::kNorm, Lane::kOptimizer, -1, std::move(w));
    prog.ops[size_t(prog.norm)].gate = true;
    prog.ops[size_t(prog.norm)].clip = in.clip_norm;
    for (size_t k = 0; k < order.size(); ++k) update(k, {prog.norm});
  } else {
    prog.norm = add(StepOpKind::kNorm, Lane::kOptimizer, -1, prog.updated);  // published once every piece is updated
  }
  // A state read waits for the previous pass's write-back of the same state.
  for (StepOp& o : prog.ops)
    if (o.kind == StepOpKind::kReadState) o.after_previous.push_back(write[size_t(o.piece)]);
  // The loads wait for the previous pass's release of their pieces.
  for (StepOp& o : prog.ops)
    if (o.kind == StepOpKind::kLoad)
      for (int64_t p : visit_pieces(place, prog.ops[size_t(visit_op[size_t(o.visit)])]))
        o.after_previous.push_back(prog.updated[size_t(p)]);
  return prog;
}

StepProgram compile_eval(const Placement& place, int64_t window) {
  StepProgram prog;
  std::vector<int32_t> visit_op;
  prog.ops = prefetch(place, visits(place, false), window, false, visit_op);
  prog.visits = int64_t(visit_op.size());
  return prog;
}

namespace {

std::string what(const StepOp& o, const ModelSpec& spec, const Placement& place) {
  if (o.kind == StepOpKind::kHead)
    return fmt::format("head shard {}{}{}", o.shard, o.lse ? " pass 1" : "", o.grad ? " pass 2" : "");
  if (o.kind == StepOpKind::kFetchSaved) return fmt::format("layer.{} micro-batch 0", o.block - 1);
  if (o.kind == StepOpKind::kLoad && o.shard >= 0) return fmt::format("visit {}: head shard {}", o.visit, o.shard);
  if (o.piece < 0) return "";
  const std::string name = place.shards.name(spec, o.piece);
  return o.kind == StepOpKind::kLoad ? fmt::format("visit {}: {}", o.visit, name) : name;
}

}  // namespace

std::string describe(const StepProgram& program, const ModelSpec& spec, const Placement& place) {
  std::string out;
  for (size_t i = 0; i < program.ops.size(); ++i) {
    const StepOp& o = program.ops[i];
    std::string waits;
    if (!o.after.empty()) waits = fmt::format("after {}", fmt::join(o.after, ","));
    if (!o.after_previous.empty())
      waits += fmt::format("{}after {} of the previous step", waits.empty() ? "" : "; ",
                           fmt::join(o.after_previous, ","));
    std::string attrs;
    if (o.over_slices) attrs += " [this rank's slice]";
    if (o.kind == StepOpKind::kGather && o.shared_copy) attrs += " [barrier: shared copy]";
    if (o.gate) attrs += fmt::format(" [gates the updates; clip {}]", o.clip);
    out += fmt::format("{:5} {:<10} {:<22} {:<28}{} {}\n", i, lane_name(o.lane), op_name(o.kind),
                       what(o, spec, place), attrs, waits);
  }
  return out;
}

nlohmann::json to_json(const StepProgram& program, const ModelSpec& spec, const Placement& place) {
  nlohmann::json ops = nlohmann::json::array();
  for (const StepOp& o : program.ops) {
    nlohmann::json j{{"lane", std::string(lane_name(o.lane))}, {"op", op_name(o.kind)},
                     {"what", what(o, spec, place)}, {"after", o.after}};
    if (o.piece >= 0) j["piece"] = o.piece;
    if (o.block >= 0) j["block"] = o.block;
    if (!o.after_previous.empty()) j["after_previous_step"] = o.after_previous;
    if (o.over_slices) j["slice"] = true;
    if (o.gate) j["clip"] = o.clip;
    ops.push_back(std::move(j));
  }
  return ops;
}

}  // namespace strider
