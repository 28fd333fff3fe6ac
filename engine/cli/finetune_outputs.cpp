#include "engine/cli/finetune_outputs.h"

#include <cerrno>
#include <filesystem>
#include <vector>

#include "engine/cli/run_outputs.h"
#include "engine/cli/training_run.h"  // base_format_option
#include "host/error.h"

namespace strider::cli {

void open_outputs(const FinetuneOptions& o, bool writes, RunOutputs& w) {
  namespace fs = std::filesystem;
  STRIDER_CHECK(!o.resume || !o.checkpoint_dir.empty(), "--resume needs --checkpoint-dir");
  // An adapter names its base (base_model_name_or_path); the built-in model,
  // initialised from the seed, is no checkpoint it could name.
  STRIDER_CHECK(o.train.lora.empty() || o.train.model != "builtin",
                "--lora {}: LoRA adapts a pretrained model; give --model (a Hugging Face checkpoint folder or Hub id)",
                o.train.lora);
  STRIDER_CHECK(!o.merge || !o.train.lora.empty(), "--merge folds LoRA adapters into their base: it needs --lora");
  // An input nothing reads is a mistake in the command, not a choice.
  STRIDER_CHECK(o.eval_data.empty() || o.eval_batches > 0, "--eval-data {} is given but --eval-batches is 0, so "
                "nothing would read it: give --eval-batches N (batches per evaluation), or leave --eval-data out",
                o.eval_data);
  base_format_option(o.train.base_format, o.train.lora);
  if (writes) {
    // No output may overwrite what the run reads, another output, or the
    // files of a directory the run prunes (the checkpoints, the NVMe state).
    std::vector<RunPath> inputs, outputs;
    if (o.train.model != "builtin" && fs::exists(o.train.model)) inputs.push_back({"--model", o.train.model});
    if (o.train.data != "builtin" && !o.train.data.empty()) inputs.push_back({"--data", o.train.data});
    if (!o.eval_data.empty()) inputs.push_back({"--eval-data", o.eval_data});
    if (!o.config_file.empty()) inputs.push_back({"--config", o.config_file});
    outputs.push_back({"--out", o.out});
    for (const RunPath& p : {RunPath{"--trace", o.trace}, RunPath{"--metrics", o.metrics},
                             RunPath{"--checkpoint-dir", o.checkpoint_dir}, RunPath{"--nvme", o.train.nvme}})
      if (!p.path.empty()) outputs.push_back(p);
    if (o.train.data == "builtin") outputs.push_back({"--work-dir", o.train.work_dir});  // the generated data
    // --out is replaced as a whole by the final save (out_folder.h): nothing
    // else may live inside it.
    check_paths_apart(inputs, outputs, {"--checkpoint-dir", "--nvme", "--out"});
    check_output_dir(o.out, "--out");
    // One run per --out: two would both save there, and after a signal both
    // into OUT/strider-checkpoints, where a later --resume takes either's.
    w.out_lock.emplace(o.out, "--out", "", DirLock::Mark::kDirectory);
    // What the final save will replace, and whether it may: said now, not
    // found out at the end (under the lock: the folder beside --out is this run's).
    w.out.emplace(o.out, o.overwrite_out);
    if (w.out->switched_at_start()) {  // the lock is on the folder switched out: take it on --out again
      w.out_lock.reset();
      w.out_lock.emplace(o.out, "--out", "", DirLock::Mark::kDirectory);
    }
    if (!o.trace.empty()) check_output_file(o.trace, "--trace");
    if (!o.metrics.empty()) check_output_file(o.metrics, "--metrics");
  }
  // Saves go to --checkpoint-dir; a run stopped by a signal or by the numerics
  // guard without one saves under --out.
  w.ckpt_root = o.checkpoint_dir.empty() ? (fs::path(o.out) / kOutCheckpoints).string() : o.checkpoint_dir;
  if (!o.checkpoint_dir.empty() && writes) {
    check_output_dir(o.checkpoint_dir, "--checkpoint-dir");
    w.ckpt_lock.emplace(o.checkpoint_dir, "--checkpoint-dir");
  }
  if (!o.metrics.empty() && writes) {
    w.metrics.open(o.metrics, std::ios::app);
    STRIDER_CHECK(w.metrics.is_open(), "--metrics {}: cannot open it for appending: {}", o.metrics, errno_text(errno));
  }
}

}  // namespace strider::cli
