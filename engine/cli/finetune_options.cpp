// strider finetune's command line: each option bound to FinetuneOptions
// (finetune_options.h); finetune.cpp runs them.
#include <algorithm>
#include <fmt/ranges.h>
#include <memory>

#include "engine/checkpoint/train_checkpoint.h"  // maths_config_fields
#include "engine/cli/cli.h"
#include "engine/cli/finetune_options.h"
#include "engine/config/config_fields.h"
#include "host/error.h"

namespace strider::cli {
namespace {

// The engine config's maths fields a resume may change: all but those fixed
// on resume (engine/config/config_fields.json: their other value is another model).
std::vector<std::string> changeable_maths() {
  std::vector<std::string> s = maths_config_fields();
  std::erase_if(s, [](const std::string& name) { return config_field(name).fixed_on_resume; });
  return s;
}

// What --allow-changed may name: those, the data, and the world size.
std::vector<std::string> changeable_settings() {
  std::vector<std::string> s = changeable_maths();
  s.push_back("data");
  s.push_back("world");
  return s;
}

}  // namespace

std::function<int()> add_finetune(CLI::App& app) {
  auto o = std::make_shared<FinetuneOptions>();
  CLI::App* c = app.add_subcommand("finetune", "fine-tune a model (with no options: the built-in demo)");
  CLI::Option* config = app.get_config_ptr();
  add_model_options(*c, o->train);
  c->add_option("--eval-data", o->eval_data, "held-out token file, evaluated every --eval-every steps and after the last");
  c->add_option("--eval-every", o->eval_every, "steps between evaluations")
      ->capture_default_str()
      ->check(in_range<int64_t>(1, kMaxSteps));
  c->add_option("--eval-batches", o->eval_batches, "batches per evaluation (0: no evaluation)")
      ->capture_default_str()
      ->check(in_range<int64_t>(0, 1000000));
  c->add_option("--out", o->out, "where the final transformers checkpoint goes (with --lora: the PEFT adapter)")->capture_default_str();
  c->add_option("--save-dtype", o->save_dtype,
                "the final checkpoint's dtype: auto (the --model checkpoint's own; fp16 is kept exactly in fp32; "
                "the built-in model's bf16), bf16 (what the model computes with) or fp32 (the trained masters); "
                "a LoRA adapter is fp32 unless bf16 is asked")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "bf16", "fp32"}));
  c->add_flag("--overwrite-out", o->overwrite_out,
              "let the final save replace an --out that holds files strider did not write there (it replaces --out "
              "as a whole: the folder then holds exactly what this run wrote)");
  c->add_flag("--merge", o->merge,
              "with --lora: also write the merged model (each adapted weight W + scale B A) under --out/merged, a "
              "transformers checkpoint without adapters");
  add_placement_options(*c, o->train);
  CLI::Option* steps =
      c->add_option("--steps", o->steps, "optimizer steps")->capture_default_str()->check(in_range<int64_t>(1, kMaxSteps));
  c->add_option("--epochs", o->epochs, "passes over the training data instead of --steps (as transformers' "
                "num_train_epochs): as many steps as that many passes over its windows take, rounded up (a fraction "
                "is a part of a pass); the schedule decays over them")
      ->check(CLI::PositiveNumber)
      ->excludes(steps);
  add_optimizer_options(*c, o->train);
  add_objective_options(*c, o->train);
  c->add_option("--trace", o->trace, "write the timeline as Chrome trace JSON (Perfetto)");
  c->add_option("--metrics", o->metrics, "append one JSON line per step");
  add_work_dir_option(*c, o->train);
  c->add_option("--checkpoint-dir", o->checkpoint_dir,
                "directory of the run's training checkpoints (step-N/ each, complete and atomic); without it, a run "
                "stopped by a signal or by the numerics guard saves under --out/strider-checkpoints");
  c->add_option("--checkpoint-every", o->checkpoint_every, "steps between checkpoints (0: only at the end)")
      ->capture_default_str()
      ->check(in_range<int64_t>(0, kMaxSteps));
  c->add_option("--keep-checkpoints", o->keep_checkpoints, "newest checkpoints kept; older ones are removed")
      ->capture_default_str()
      ->check(in_range<int64_t>(1, 1000));
  c->add_option("--max-skipped-steps", o->max_skipped_steps,
                "steps in a row skipped for a non-finite loss or gradient before the run stops (fp16: an "
                "overflow that backs the loss scale off does not count; one at the floor scale of 1 does)")
      ->capture_default_str()
      ->check(in_range<int64_t>(1, 1000000));
  c->add_option("--dist-timeout", o->dist_timeout_s,
                "data parallel (under torchrun): seconds any collective may wait for the other ranks; past it, "
                "or at once when a rank dies, every rank stops naming the ranks that never arrived")
      ->capture_default_str()
      ->check(in_range<int64_t>(1, 86400));
  c->add_flag("--resume", o->resume,
              "continue from the newest checkpoint in --checkpoint-dir that loads (weights, Adam state, step, data "
              "position)");
  c->add_option("--allow-changed", o->allow_changed,
                "with --resume: settings that may differ from the checkpoint's (comma-separated): 'data' or an "
                "engine setting such as lr, weight_decay, clip_norm")
      ->delimiter(',')
      ->check(CLI::Validator(
          [](std::string& name) -> std::string {
            const std::vector<std::string> can = changeable_settings();
            if (std::find(can.begin(), can.end(), name) != can.end()) return "";
            return fmt::format("'{}' is not a setting a resume may change. It may change the engine's maths "
                               "settings ({}), data and world; the model (its architecture, config.json's fields, "
                               "LoRA adapters and their base, and the base's format) is the checkpoint's and cannot "
                               "change",
                               name, fmt::join(changeable_maths(), ", "));
          },
          "SETTING"));
  return [o, config] {
    if (config != nullptr && config->count() > 0) o->config_file = config->as<std::string>();
    return run_finetune(*o);
  };
}

void check_objective_run(const FinetuneOptions& o) {
  const std::string& objective = o.train.objective;
  if (objective == "sft") return;
  STRIDER_CHECK(objective != "grpo",
                "--objective grpo: its rollouts are generated outside strider, step by step; train it from Python "
                "(strider.Engine(..., EngineConfig(objective='grpo')).step(..., advantages=), "
                "python_shim/examples/grpo_loop.py)");
}

}  // namespace strider::cli
