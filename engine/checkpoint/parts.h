// What the save (checkpoint/save.cpp) and the load (checkpoint/load.cpp)
// of a training checkpoint share: its file and tensor names, the recovery
// rule's paths, how two models are compared, and what of a model it holds.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/model/model_spec.h"
#include "host/param_layout.h"
#include "io/nvme_store.h"

namespace strider::train_checkpoint_parts {

namespace fs = std::filesystem;

inline constexpr const char* kFormat = "strider-train-checkpoint";
inline constexpr const char* kTrainerState = "trainer_state.json";
inline constexpr const char* kStateBase = "state";
inline constexpr ExtentKind kKinds[3] = {ExtentKind::kMaster, ExtentKind::kAdamM, ExtentKind::kAdamV};
inline constexpr const char* kSuffix[3] = {"", ".exp_avg", ".exp_avg_sq"};  // torch.optim.AdamW's names
inline constexpr const char* kKindKey[3] = {"master", "exp_avg", "exp_avg_sq"};

// "ckpt/" and "ckpt" name the same checkpoint; ".old" and the temp names hang off the last component.
fs::path normalise(const fs::path& dir);
fs::path old_of(const fs::path& dir);
std::string hex64(uint64_t x);
std::string join(const std::vector<std::string>& items, std::string_view sep);

// Every difference between two models that changes which tensors exist or
// what they compute (adapters included); empty when they are the same model.
// `source` names where `ckpt` came from ("checkpoint", "config given").
std::vector<std::string> spec_differences(const ModelSpec& ckpt, const ModelSpec& engine, const char* source);

// The model a checkpoint holds the state of: its config.json with the
// adapters its engine config names (LoRA), as the engine that saved it had it.
ModelSpec saved_model(const nlohmann::json& model_config, const nlohmann::json& engine_config, std::string_view source);

// The tensors whose state (master, m, v) a checkpoint holds: the trained
// ones, every tensor in full training. A LoRA base (TensorSlot::trainable
// false) never changes: the engine has it from the model it was built on,
// and the checkpoint keeps its fingerprint (frozen_checksum) to refuse
// adapters over another base.
inline bool holds_state(const TensorSlot& s) { return s.trainable; }
// xxh3-64 of a block's frozen tensors' values (fp32, layout order), from its
// master buffer; 0 for a block without any.
uint64_t frozen_checksum(const ParamLayout& l, std::span<const float> master);

}  // namespace strider::train_checkpoint_parts
