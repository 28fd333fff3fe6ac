// Training checkpoints: everything a run needs to continue bit-identically
// (every block's fp32 master, Adam m and v, the step count, the engine and
// model configs, the caller's data-loader state), published atomically.
//
// A checkpoint is a directory:
//   trainer_state.json    format, step, model config, engine config, per-block
//                         checksums of the state, the caller's "extra"; written
//                         last, so a directory without it was never complete
//   state.safetensors     fp32 tensors "<param>", "<param>.exp_avg",
//                         "<param>.exp_avg_sq" (torch.optim.AdamW's names), or
//                         shards state-0000i-of-0000n.safetensors + index
//   config.json, model.safetensors   the model as transformers loads it
//                         (bf16 by default; optional)
//   reference.safetensors with EngineConfig::keep_reference: the starting
//                         weights in the compute dtype, by model name
//                         (engine/checkpoint/reference_copy.h); an engine
//                         that keeps a reference refuses a checkpoint without
// With LoRA (engine/model/lora.h) the state is the trained tensors' only (the
// adapters, and the modules trained in full); the frozen base is the
// engine's, from the model it was built on, and trainer_state.json keeps its
// per-block fingerprint ("base_checksums"), so adapters never load over
// another base. The model files are then the adapter as PEFT saves it
// (adapter_config.json, adapter_model.safetensors; fp32).
// Per-tensor names rather than flat per-block buffers: the file reads without
// strider (safetensors.torch.load_file gives an optimizer state by name), and
// it survives a change of the flat layout's alignment. The layout's padding is
// zero in every kind, so nothing is lost.
//
// Crash safety. A save writes into a hidden sibling ".<name>.tmp-<pid>-<n>",
// makes every file and the directory durable, then publishes:
//   1. if <dir> exists: remove a stale <dir>.old, rename <dir> -> <dir>.old
//   2. rename the temp directory -> <dir>, fsync the parent
//   3. remove <dir>.old
// <dir> only ever appears by the rename of a complete, durable directory.
// Recovery rule (the loader applies it): use <dir> if it exists, else
// <dir>.old (the process died between 1 and 2); temp directories are never
// read, and the next save to the same <dir> removes them. One saver per <dir>
// at a time. A failed save (a full disk) removes its temp directory, leaves
// the previous checkpoint untouched and throws naming the file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/run/engine.h"
#include "host/dtype.h"
#include "host/error.h"

namespace strider {

inline constexpr int kTrainCheckpointVersion = 1;

struct TrainCheckpointOptions {
  bool write_model = true;                   // config.json + model.safetensors too
  DType model_dtype = DType::kBF16;          // kBF16 or kF32
  uint64_t model_shard_bytes = 0;            // 0: one model.safetensors
  uint64_t state_shard_bytes = uint64_t{4} << 30;  // 0: one state.safetensors
  std::string base_model;                    // LoRA: the adapter's base_model_name_or_path
};

// Saves `engine`'s full training state into `dir` (waits for pending updates;
// call between steps). `model_config_json`: the model's config.json text (it
// must describe engine.spec()). `extra`: the caller's own state (data loader
// position, seed, ...), returned as is by load_training_checkpoint.
void save_training_checkpoint(const std::filesystem::path& dir, Engine& engine,
                              std::string_view model_config_json, const nlohmann::json& extra = {},
                              const TrainCheckpointOptions& options = {});

// Data parallel with sharded state (EngineConfig::state_shards > 1), a save
// is a collective: rank 0 calls save_training_checkpoint while every other
// rank calls this, which sends it the rank's slices block by block (and
// throws as rank 0 does on a non-finite state). The checkpoint is whole and
// the same as one process's: it loads into any number of ranks, each taking
// its slice. A rank that dies mid-save fails rank 0's save, which leaves the
// previous checkpoint as it was. With replicated state, a no-op.
void serve_training_checkpoint(Engine& engine);

// What a checkpoint says about itself, without touching an engine: enough to
// build the engine to resume into. Applies the recovery rule; validates
// trainer_state.json only (not the tensors).
struct TrainCheckpointInfo {
  std::filesystem::path path;      // the directory actually used (<dir> or <dir>.old)
  int64_t step = 0;                // optimizer steps done
  std::string model_config_json;   // the saved config.json (as JSON text, keys sorted)
  nlohmann::json engine_config;    // engine_config_to_json() at save time
  nlohmann::json extra;
  nlohmann::json trainer_state;    // the whole file
};
TrainCheckpointInfo inspect_training_checkpoint(const std::filesystem::path& dir);

// The exportable model files (config.json's weights, written when
// TrainCheckpointOptions::write_model) against the checksums their save
// recorded: one line per file that is missing or differs; empty when all
// match, or for a checkpoint from before they were recorded. The training
// state is checked apart (load_training_checkpoint): a damaged model copy
// does not make the state unusable, so this reports rather than refuses.
std::vector<std::string> check_model_files(const TrainCheckpointInfo& info);

// The engine config fields that change the maths of a step: those
// engine/config/config_fields.json declares of scope "maths", so a new field
// is compared as soon as it is declared. They must match between checkpoint
// and engine unless named in LoadOptions::allow_changed. Every other field
// (window, checkpoints_on_host, optimizer_threads, the NVMe tier) is
// placement and may differ: offload changes nothing.
const std::vector<std::string>& maths_config_fields();
// The maths fields in which `now` (engine_config_to_json) differs from a
// checkpoint's engine config, each with both values, less those in
// `allow_changed`; `source` names the checkpoint's file in errors (a field
// missing there that every checkpoint has).
std::vector<std::string> maths_changes(const nlohmann::json& saved_config, const nlohmann::json& now,
                                       const std::vector<std::string>& allow_changed, const std::string& source);

// What load_training_checkpoint throws when the checkpoint is sound but does
// not fit the engine: another model, or a run whose maths settings differ.
// An older checkpoint of the same run would not fit better, so a caller that
// falls back past damaged checkpoints (CheckpointSeries) stops at this one.
// `allowable`: a change of the engine config's maths settings, which
// TrainLoadOptions::allow_changed may accept; not: of the model itself (its
// architecture, config.json's fields, LoRA adapters, the base under them),
// which no option accepts.
class CheckpointMismatch : public Error {
 public:
  explicit CheckpointMismatch(const std::string& what, bool allowable = true) : Error(what), allowable_(allowable) {}
  bool allowable() const { return allowable_; }

 private:
  bool allowable_;
};

struct TrainLoadOptions {
  std::vector<std::string> allow_changed;  // e.g. {"lr", "total_steps"} to extend a run
  bool verify_checksums = true;            // one extra pass over the state before loading
};

// Loads a checkpoint into `engine` and returns its "extra". Everything is
// validated first (model, layouts, maths config, every tensor's presence,
// dtype, shape and checksum); a failed load throws naming the file and field
// (CheckpointMismatch for another model or other maths settings, Error for
// damage) and leaves the engine untouched. Then write_state for every block and kind,
// and set_steps_done. With LoRA the engine must hold the base the adapters
// were trained on (checked against its fingerprint, CheckpointMismatch
// otherwise); its base stays as it is.
nlohmann::json load_training_checkpoint(const std::filesystem::path& dir, Engine& engine,
                                        const TrainLoadOptions& options = {});

}  // namespace strider
