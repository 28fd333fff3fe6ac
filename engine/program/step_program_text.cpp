// The step program as text and JSON (engine/program/step_program.h: op_name,
// describe, to_json), for `strider plan --schedule` and the tests.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iterator>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "engine/program/step_program.h"

namespace strider {

namespace {

// One row per kind, in the enum's order: its name.
struct KindRow {
  StepOpKind kind;
  const char* name;
};
constexpr KindRow kKinds[] = {
    {StepOpKind::kReadCompute, "read compute copy"},
    {StepOpKind::kLoad, "load"},
    {StepOpKind::kDequantize, "dequantize base"},
    {StepOpKind::kZeroGrads, "zero grads"},
    {StepOpKind::kTiedGradIn, "tied grads in"},
    {StepOpKind::kCheckpointIn, "checkpoint in"},
    {StepOpKind::kForward, "forward"},
    {StepOpKind::kSaveOut, "kept activations out"},
    {StepOpKind::kCheckpointOut, "checkpoint out"},
    {StepOpKind::kHandOut, "hand out"},
    {StepOpKind::kHandIn, "hand in"},
    {StepOpKind::kHeadLse, "head log-sum-exp"},
    {StepOpKind::kObjective, "objective"},
    {StepOpKind::kLossOut, "loss out"},
    {StepOpKind::kHeadGrad, "head backward"},
    {StepOpKind::kHeadNormBackward, "head norm backward"},
    {StepOpKind::kFetchSaved, "kept activations in"},
    {StepOpKind::kBackward, "backward"},
    {StepOpKind::kGradsToSend, "grads to send"},
    {StepOpKind::kGradsOut, "grads out"},
    {StepOpKind::kTiedGradOut, "tied grads out"},
    {StepOpKind::kRelease, "release"},
    {StepOpKind::kLand, "land"},
    {StepOpKind::kSumRanks, "sum over ranks"},
    {StepOpKind::kSumSquares, "sum of squares"},
    {StepOpKind::kSpill, "spill"},
    {StepOpKind::kCheckLoss, "check loss"},
    {StepOpKind::kCheckGrad, "check gradient"},
    {StepOpKind::kNorm, "norm"},
    {StepOpKind::kReadState, "read state"},
    {StepOpKind::kAdamW, "adamw"},
    {StepOpKind::kWriteState, "write state"},
    {StepOpKind::kGather, "gather"},
    {StepOpKind::kUpdated, "updated"},
};
static_assert(std::size(kKinds) == size_t(kOpKinds), "a StepOpKind without its row in kKinds");

constexpr bool rows_in_order() {
  for (size_t i = 0; i < std::size(kKinds); ++i)
    if (size_t(kKinds[i].kind) != i) return false;
  return true;
}
static_assert(rows_in_order(), "kKinds' rows must follow StepOpKind's order");

}  // namespace

const char* op_name(StepOpKind k) { return size_t(k) < std::size(kKinds) ? kKinds[size_t(k)].name : "?"; }

std::optional<StepOpKind> op_kind_named(std::string_view name) {
  for (const auto& row : kKinds)
    if (name == row.name) return row.kind;
  return std::nullopt;
}

OpArgs op_args(StepOpKind k) {
  switch (k) {
    case StepOpKind::kForward:
    case StepOpKind::kBackward:
    case StepOpKind::kHeadLse:
    case StepOpKind::kHeadGrad: return ComputeArgs{};
    case StepOpKind::kCheckpointIn:
    case StepOpKind::kCheckpointOut:
    case StepOpKind::kSaveOut: return CopyArgs{};
    case StepOpKind::kHandOut:
    case StepOpKind::kHandIn: return HandArgs{};
    case StepOpKind::kReadCompute:
    case StepOpKind::kLoad: return SlotArgs{};
    case StepOpKind::kRelease: return ReleaseArgs{};
    case StepOpKind::kSumRanks:
    case StepOpKind::kSumSquares:
    case StepOpKind::kAdamW:
    case StepOpKind::kGather: return SliceArgs{};
    case StepOpKind::kNorm: return NormArgs{};
    case StepOpKind::kCheckGrad: return CheckArgs{};
    case StepOpKind::kDequantize:
    case StepOpKind::kZeroGrads:
    case StepOpKind::kTiedGradIn:
    case StepOpKind::kLossOut:
    case StepOpKind::kObjective:
    case StepOpKind::kHeadNormBackward:
    case StepOpKind::kFetchSaved:
    case StepOpKind::kGradsToSend:
    case StepOpKind::kGradsOut:
    case StepOpKind::kTiedGradOut:
    case StepOpKind::kLand:
    case StepOpKind::kSpill:
    case StepOpKind::kCheckLoss:
    case StepOpKind::kReadState:
    case StepOpKind::kWriteState:
    case StepOpKind::kUpdated: return std::monostate{};
  }
  return std::monostate{};
}

OpSide op_side(StepOpKind k) {
  switch (k) {
    STRIDER_DEVICE_OP_KINDS:
      return OpSide::kDevice;
    STRIDER_HOST_OP_KINDS:
      return OpSide::kHost;
  }
  return OpSide::kHost;
}

OpFields fields(const StepOp& op) {
  OpFields f;
  std::visit(
      [&](const auto& a) {
        using T = std::decay_t<decltype(a)>;
        if constexpr (std::is_same_v<T, ComputeArgs>) static_cast<ComputeArgs&>(f) = a;
        if constexpr (std::is_same_v<T, SliceArgs>) static_cast<SliceArgs&>(f) = a;
        if constexpr (std::is_same_v<T, NormArgs>) static_cast<NormArgs&>(f) = a;
        if constexpr (std::is_same_v<T, CheckArgs>) static_cast<CheckArgs&>(f) = a;
        if constexpr (std::is_same_v<T, ReleaseArgs>) static_cast<ReleaseArgs&>(f) = a;
        if constexpr (std::is_same_v<T, SlotArgs>) static_cast<SlotArgs&>(f) = a;
        if constexpr (std::is_same_v<T, CopyArgs>) {
          f.first = a.first;
          f.last = a.last;
          f.peer = a.peer;
        }
        if constexpr (std::is_same_v<T, HandArgs>) {
          f.hand = a.hand;
          f.grads = a.grads;
          f.first = a.first;
          f.peer = a.peer;
          f.wait_ring = a.wait_ring;
        }
      },
      op.args);
  return f;
}

namespace {

std::string what(const StepOp& o, const ModelSpec& spec, const Placement& place) {
  std::string w;
  if (o.piece >= 0 && o.kind != StepOpKind::kCheckpointOut && o.kind != StepOpKind::kCheckpointIn &&
      o.kind != StepOpKind::kSaveOut && o.kind != StepOpKind::kFetchSaved)
    w = place.shards().name(spec, o.piece);
  else if (o.shard >= 0)
    w = fmt::format("head shard {}", o.shard);
  else if (o.block == place.head)
    w = "head";
  else if (o.block >= 1)
    w = fmt::format("layer.{}", o.block - 1);
  else if (o.kind == StepOpKind::kHandOut || o.kind == StepOpKind::kHandIn)
    w = "embedding";
  if (const auto* h = std::get_if<HandArgs>(&o.args)) {
    static const char* const carries[kHandKinds] = {" input", " state", " log-sum-exp", " hidden gradient"};
    w += h->hand == Hand::kBlock && h->grads ? " output gradient" : carries[int(h->hand)];
  }
  // A layer's visit works on the whole layer, whatever pieces cut it; its gradients leave piece by piece.
  if (o.on_device() && o.kind != StepOpKind::kGradsOut && o.piece >= 0 && !place.piece(o.piece).rows() &&
      o.block >= 1 && o.block < place.head)
    w = spec.block_name(o.block);
  if (o.kind == StepOpKind::kLoad || o.kind == StepOpKind::kRelease || o.kind == StepOpKind::kReadCompute)
    w = fmt::format("visit {}: {}", o.visit, w);
  if (o.micro_batch >= 0) w += fmt::format(" m{}", o.micro_batch);
  return w;
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
    const OpFields f = fields(o);
    std::string attrs;
    if (f.keep) attrs += o.kind == StepOpKind::kHeadLse || o.kind == StepOpKind::kHeadGrad ? " [kept logits]" : " [kept activations]";
    if (f.recompute) attrs += " [recompute the MLP's input]";
    if (f.wait_ring) attrs += " [after its checkpoint set left]";
    if (place.devices > 1 && o.on_device()) attrs += fmt::format(" [device {}]", o.device);
    if (f.peer >= 0) attrs += fmt::format(" [from device {}]", f.peer);
    if (f.over_slices) attrs += " [this rank's slice]";
    if (o.kind == StepOpKind::kGather && f.shared_copy) attrs += " [barrier: shared copy]";
    if (f.slot >= 0) attrs += fmt::format(" [staging slot {}]", f.slot);
    if (f.gate) attrs += fmt::format(" [gates the updates; clip {}{}]", f.clip, f.unscale ? "; unscales" : "");
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
    const OpFields f = fields(o);
    if (o.piece >= 0) j["piece"] = o.piece;
    if (o.block >= 0) j["block"] = o.block;
    if (o.visit >= 0) j["visit"] = o.visit;
    if (o.micro_batch >= 0) j["micro_batch"] = o.micro_batch;
    if (o.on_device()) j["device"] = o.device;
    if (f.peer >= 0) j["from_device"] = f.peer;
    if (f.keep) j["keep"] = true;
    if (f.recompute) j["recompute"] = true;
    if (!o.after_previous.empty()) j["after_previous_step"] = o.after_previous;
    if (f.over_slices) j["slice"] = true;
    if (f.gate) j["clip"] = f.clip;
    if (f.unscale) j["unscale"] = true;
    if (f.slot >= 0) j["staging_slot"] = f.slot;
    ops.push_back(std::move(j));
  }
  return ops;
}

}  // namespace strider
