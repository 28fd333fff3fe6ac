// DPO from the command line: the reference log-probabilities. TRL's
// precompute_ref_log_probs: every sequence of the preference file (each
// pair's chosen and rejected one) scored once, before the first step, under
// the starting weights (a LoRA run: its frozen base, the adapters skipped),
// so that no second copy of the model is kept. Each checkpoint records them
// (with the data's checksum beside them), and a resume takes them from there:
// never recomputed from trained weights.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/run/engine.h"
#include "gpu/blocks/objective.h"
#include "io/token_data.h"

namespace strider::cli {

// Each window's summed log-probability of its targets (a pair's chosen
// sequence at window 2i, its rejected one at 2i + 1), by Engine::logprobs
// over batches of the engine's rows in file order; `reference`: the LoRA
// base's (Engine::logprobs's reference). Data parallel: every rank scores
// every window (the same calls on each: the same values), so that each has
// the reference of whichever rows the loader gives it. `stop` is asked
// between batches (a signal: the same answer on every rank); once it says
// yes, the scoring ends and returns nothing (the run ends before its first step).
std::vector<float> score_windows(Engine& engine, const TokenFile& file, bool reference,
                                 const std::function<bool()>& stop);

// As a checkpoint's extra JSON records them: the fp32 values' bytes in hex
// (exact), and back, checked: `where` names the checkpoint in a refusal.
std::string reference_record(std::span<const float> logps);
std::vector<float> reference_from_record(const nlohmann::json& extra, const std::string& key, uint64_t windows,
                                         const std::string& where);

// The step's DPO inputs for this rank's rows: each row's reference sum, by
// the window the loader took it from (TokenLoader::last_windows).
struct PairInputs {
  std::vector<float> row;
  ObjectiveInputs inputs;
  const ObjectiveInputs* next(std::span<const float> reference, std::span<const uint64_t> windows);
};

}  // namespace strider::cli
