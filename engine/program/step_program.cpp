#include "engine/program/step_program.h"

#include "engine/config/engine_config.h"
#include "engine/program/passes.h"
#include "host/error.h"

namespace strider {

uint64_t state_bytes(StateFormat format, size_t n) {
  uint64_t total = 0;
  for (StateKind k : {StateKind::kMaster, StateKind::kAdamM, StateKind::kAdamV}) total += state_kind_bytes(format, k, n);
  return total;
}

uint64_t adam_bytes(StateFormat format, size_t n, size_t grad_bytes) {
  const uint64_t state = format == StateFormat::kFp32 ? 24 * n : 10 * n + 16 * (n / kQ8GroupElems);
  return state + n * grad_bytes;
}

uint64_t state_read_bytes(const Placement& place, StateFormat format, int64_t p, size_t n) {
  const PiecePlace& at = place.at(p);
  return state_bytes(format, n) + (at.spills_grads ? n * place.grad_bytes : 0) +
         (at.compute_on_nvme && state_uses_compute_copy(format) ? place.piece(p).elems() * place.compute_bytes : 0);
}

uint64_t state_write_bytes(const Placement& place, StateFormat format, int64_t p, size_t n) {
  return state_bytes(format, n) + (place.at(p).compute_on_nvme ? place.piece(p).elems() * place.compute_bytes : 0);
}


ProgramInputs program_inputs(const EngineConfig& c, int world) {
  return {.window = c.window, .micro_batches = c.accumulation, .checkpoints_on_host = c.checkpoints_on_host,
          .keep_logits = c.keep_logits, .clip_norm = c.clip_norm, .loss_scaled = c.loss_scaled(),
          .packed_documents = c.packed_documents, .objective = !c.objective.sft(), .world = world, .shared_compute = !c.shared_compute_file.empty()};
}

bool takes_positions(const StepProgram& program) {
  return std::any_of(program.ops.begin(), program.ops.end(), [](const StepOp& o) {
    return std::holds_alternative<ComputeArgs>(o.args) && o.as<ComputeArgs>().packed;
  });
}

bool keeps_logits(const StepProgram& program, int device) {
  return std::any_of(program.ops.begin(), program.ops.end(), [&](const StepOp& o) {
    return o.kind == StepOpKind::kHeadGrad && o.device == device && o.as<ComputeArgs>().keep;
  });
}

StepProgram compile_step(const Placement& place, const ProgramInputs& in) {
  STRIDER_CHECK(in.window >= 2, "the window is {} cache units; it needs at least 2", in.window);
  Draft d(place, in, true);
  pass_visits(d);
  pass_micro_batches(d);
  pass_tied(d);
  pass_host_checkpoints(d);
  pass_devices(d);
  pass_kept_activations(d);
  pass_kept_logits(d);
  pass_base_format(d);
  pass_prefetch(d);
  pass_landing(d);
  pass_clipping(d);
  pass_ranks(d);
  pass_nvme(d);
  pass_previous_step(d);
  return d.finish();
}

StepProgram compile_eval(const Placement& place, const ProgramInputs& in) {
  Draft d(place, in, false);
  pass_visits(d);
  pass_micro_batches(d);
  pass_host_checkpoints(d);
  pass_devices(d);
  pass_kept_logits(d);
  pass_base_format(d);
  pass_prefetch(d);
  return d.finish();
}

}  // namespace strider
