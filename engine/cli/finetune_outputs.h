// What `strider finetune` writes to, checked and locked before the model is
// loaded: --out (out_folder.h) and its lock, the checkpoint directory, the
// metrics file; and the command's own consistency checks that come first.
#pragma once

#include <fstream>
#include <optional>
#include <string>

#include "engine/cli/finetune_options.h"
#include "engine/cli/out_folder.h"
#include "io/run_lock.h"

namespace strider::cli {

// What a run writes to, checked and locked before anything else: --out (and
// its lock), the checkpoint directory (locked here when given, else when
// first used), the metrics file. Only the writing rank opens them.
struct RunOutputs {
  std::optional<OutFolder> out;  // rank 0's: the final save's folder, switched in whole
  std::optional<DirLock> out_lock, ckpt_lock;
  std::string ckpt_root;
  std::ofstream metrics;
};

// Checks the command (an option that needs another, an input nothing reads)
// and every output against the inputs and each other, then opens and locks
// what `writes` (rank 0) writes. Throws Error naming the option.
void open_outputs(const FinetuneOptions& o, bool writes, RunOutputs& w);

}  // namespace strider::cli
