// strider finetune's options (finetune_options.cpp binds them to the
// command line) and its run (finetune.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/cli/training_run.h"  // TrainOptions

namespace strider::cli {

struct FinetuneOptions {
  TrainOptions train;
  std::string eval_data, out = "strider-out", trace, metrics, checkpoint_dir, save_dtype = "auto";
  std::string config_file;  // --config, if given
  int64_t checkpoint_every = 0, steps = 120, eval_every = 30, eval_batches = 2, keep_checkpoints = 2,
          max_skipped_steps = 3;
  std::vector<std::string> allow_changed;
  bool resume = false, merge = false, overwrite_out = false;
  int64_t dist_timeout_s = 300;
  double epochs = 0;  // --epochs: the run's length in passes over the data, in --steps' place
};

// The run; returns its exit code.
int run_finetune(FinetuneOptions& o);

// What the command line does not do with an objective past SFT, refused
// before anything is written: grpo (its rollouts come from outside: the
// Python API).
void check_objective_run(const FinetuneOptions& o);

}  // namespace strider::cli
