// CheckpointSeries: a run's training checkpoints under one root directory,
// the newest `keep` of them kept, so that no single mistake (a bad save, a
// damaged file, a run that went wrong before its last save) loses the run.
//
//   <root>/step-00000040/   a complete training checkpoint (train_checkpoint.h)
//   <root>/step-00000050/
//   <root>/.strider.lock    held by the run writing here (io/run_lock.h)
//
// Each save goes to a new step directory through save_training_checkpoint's
// atomic protocol; only after it is published are the oldest beyond `keep`
// removed. A save first checks the file system's free space against what the
// checkpoint will take and refuses, naming both figures, before writing
// anything: the older checkpoints stay. A directory in the way of a save that
// is not a checkpoint (empty, or foreign) is moved aside, with a warning; the
// removal of old ones touches only checkpoints. Resuming takes the newest checkpoint
// that loads, and says which; a damaged one (a missing or corrupt file) is
// skipped with a warning, while one that does not fit the engine (another
// model, other maths settings: CheckpointMismatch) stops the search, since
// an older one of the same run would not fit either.
// A root that is itself a single checkpoint (a save_training_checkpoint
// directory, as Engine.save writes) is resumed from too.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/checkpoint/train_checkpoint.h"

namespace strider {

class CheckpointSeries {
 public:
  CheckpointSeries(std::filesystem::path root, int keep);

  const std::filesystem::path& root() const { return root_; }
  std::filesystem::path dir_for(int64_t step) const;  // <root>/step-<8 digits>

  // The checkpoints present, newest (highest step they record; their name's
  // where they cannot say) first: step directories (or their ".old" twin left
  // by a save that died between its renames), and the root itself when it is
  // one checkpoint.
  std::vector<std::filesystem::path> list() const;

  // Bytes a checkpoint of `engine` takes on disk (state, and the model when
  // options.write_model), rounded up generously for headers and metadata.
  static uint64_t bytes_needed(const Engine& engine, const TrainCheckpointOptions& options = {});
  // Free bytes for an unprivileged writer on the file system holding `dir`
  // (the nearest existing ancestor).
  static uint64_t free_bytes(const std::filesystem::path& dir);

  // Saves engine's state as dir_for(engine.steps_done()) (see the header for
  // the order of things) and returns that directory.
  std::filesystem::path save(Engine& engine, std::string_view model_config_json, const nlohmann::json& extra,
                             const TrainCheckpointOptions& options = {});

  struct Resumed {
    std::filesystem::path dir;          // the checkpoint loaded
    nlohmann::json extra;
    std::vector<std::string> skipped;   // "<dir>: <why>" for each damaged newer one
  };
  // Loads the newest checkpoint that loads into `engine`, warning on `log`
  // about each one skipped. Throws Error when there is none (naming root and
  // why each failed), CheckpointMismatch as it comes.
  Resumed resume(Engine& engine, const TrainLoadOptions& options, std::FILE* log = stderr);

 private:
  std::filesystem::path root_;
  int keep_;
};

}  // namespace strider
