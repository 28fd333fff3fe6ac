// Shared by the step program's tests (test_step_program*.cpp): the tiny
// model, a configuration, and what every program must hold.
#pragma once

#include "tests/catch_torch.h"

#include <algorithm>

#include "engine/program/step_program.h"
#include "engine/run/engine.h"
#include "tests/engine/tiny_model.h"

namespace strider::test {

using K = StepOpKind;

inline ModelSpec tiny(bool tied = false) { return ModelSpec::from_json(test::tiny_config(tied), "tiny"); }

inline EngineConfig config(double clip) {
  EngineConfig cfg;
  cfg.seq = 16;
  cfg.micro_batch = 1;
  cfg.accumulation = 2;
  cfg.clip_norm = clip;
  cfg.compute.dtype = at::kFloat;
  cfg.vocab_shard_rows = 40;  // 3 vocabulary shards
  return cfg;
}

// Index of the operation of kind k on piece p (-1: none); it must be unique.
inline int index_of(const StepProgram& prog, K k, int64_t p) {
  int found = -1;
  for (size_t i = 0; i < prog.ops.size(); ++i)
    if (prog.ops[i].kind == k && prog.ops[i].piece == p) {
      REQUIRE(found < 0);
      found = int(i);
    }
  return found;
}

inline int count(const StepProgram& prog, K k) {
  return int(std::count_if(prog.ops.begin(), prog.ops.end(), [&](const StepOp& o) { return o.kind == k; }));
}

// Every dependency points backwards: a program runs in order.
inline void check_order(const StepProgram& prog) {
  for (size_t i = 0; i < prog.ops.size(); ++i)
    for (int32_t a : prog.ops[i].after)
      if (a >= 0) CHECK(size_t(a) < i);
}

}  // namespace strider::test
