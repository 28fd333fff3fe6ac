// The step program as text and JSON (engine/program/step_program.h: op_name,
// describe, to_json), for `strider plan --schedule` and the tests.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iterator>

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

OpSide op_side(StepOpKind k) {
  switch (k) {
    STRIDER_DEVICE_OP_KINDS:
      return OpSide::kDevice;
    STRIDER_HOST_OP_KINDS:
      return OpSide::kHost;
  }
  return OpSide::kHost;
}

namespace {

std::string what(const StepOp& o, const ModelSpec& spec, const Placement& place) {
  std::string w;
  if (o.piece >= 0 && o.kind != StepOpKind::kCheckpointOut && o.kind != StepOpKind::kCheckpointIn &&
      o.kind != StepOpKind::kSaveOut && o.kind != StepOpKind::kFetchSaved)
    w = place.shards.name(spec, o.piece);
  else if (o.shard >= 0)
    w = fmt::format("head shard {}", o.shard);
  else if (o.block == place.head)
    w = "head";
  else if (o.block >= 1)
    w = fmt::format("layer.{}", o.block - 1);
  else if (o.kind == StepOpKind::kHandOut || o.kind == StepOpKind::kHandIn)
    w = "embedding";
  if (o.kind == StepOpKind::kHandOut || o.kind == StepOpKind::kHandIn) {
    static const char* const carries[kHandKinds] = {" input", " state", " log-sum-exp", " hidden gradient"};
    w += o.hand == Hand::kBlock && o.grads ? " output gradient" : carries[int(o.hand)];
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
    std::string attrs;
    if (o.keep) attrs += o.kind == StepOpKind::kHeadLse || o.kind == StepOpKind::kHeadGrad ? " [kept logits]" : " [kept activations]";
    if (o.recompute) attrs += " [recompute the MLP's input]";
    if (o.wait_ring) attrs += " [after its checkpoint set left]";
    if (place.devices > 1 && o.on_device()) attrs += fmt::format(" [device {}]", o.device);
    if (o.peer >= 0) attrs += fmt::format(" [from device {}]", o.peer);
    if (o.over_slices) attrs += " [this rank's slice]";
    if (o.kind == StepOpKind::kGather && o.shared_copy) attrs += " [barrier: shared copy]";
    if (o.slot >= 0) attrs += fmt::format(" [staging slot {}]", o.slot);
    if (o.gate) attrs += fmt::format(" [gates the updates; clip {}{}]", o.clip, o.unscale ? "; unscales" : "");
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
    if (o.visit >= 0) j["visit"] = o.visit;
    if (o.micro_batch >= 0) j["micro_batch"] = o.micro_batch;
    if (o.on_device()) j["device"] = o.device;
    if (o.peer >= 0) j["from_device"] = o.peer;
    if (o.keep) j["keep"] = true;
    if (o.recompute) j["recompute"] = true;
    if (!o.after_previous.empty()) j["after_previous_step"] = o.after_previous;
    if (o.over_slices) j["slice"] = true;
    if (o.gate) j["clip"] = o.clip;
    if (o.unscale) j["unscale"] = true;
    if (o.slot >= 0) j["staging_slot"] = o.slot;
    ops.push_back(std::move(j));
  }
  return ops;
}

}  // namespace strider
