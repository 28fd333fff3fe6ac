// The reference copy of full fine-tuning (EngineConfig::keep_reference) in a
// training checkpoint: saved beside the state, checked and loaded with it
// (engine/checkpoint/reference_copy.cpp).
#pragma once

#include <filesystem>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/run/engine.h"
#include "io/safetensors.h"

namespace strider::train_checkpoint_parts {

inline constexpr const char* kReferenceBase = "reference";

// Writes reference.safetensors into `dir` when the engine keeps a reference
// copy; returns trainer_state.json's "reference" record (null without one).
nlohmann::json save_reference_copy(const std::filesystem::path& dir, Engine& engine);

// A checkpoint's reference copy, checked (every tensor, in the compute
// dtype, its blocks' checksums) and not yet in the engine.
struct ReferenceRead {
  std::unique_ptr<SafetensorsCheckpoint> file;  // null: nothing to load (the engine keeps none)
  std::vector<std::vector<TensorView>> views;  // per block, its layout's slots in order
  ReferenceRead();
  ~ReferenceRead();
  ReferenceRead(ReferenceRead&&) noexcept;
};

// Refuses (CheckpointMismatch) a checkpoint without a reference copy when the
// engine keeps one: its reference would be the trained weights.
ReferenceRead check_reference_copy(const std::filesystem::path& dir, const nlohmann::json& trainer_state,
                                   const Engine& engine, bool verify_checksums);
void load_reference_copy(const ReferenceRead& read, Engine& engine);

}  // namespace strider::train_checkpoint_parts
