// strider finetune: the README's main job.
//
// A long run never ends in lost work: every output is checked (and the
// directories this run writes are locked) before the first step; checkpoints
// rotate (the newest --keep-checkpoints kept, each complete); a non-finite
// loss or gradient skips the step, and too many in a row stop the run with
// the last good state saved; SIGINT/SIGTERM finish the step, save and exit
// 128 + the signal; resuming takes the newest checkpoint that loads and
// refuses other data or other maths settings unless --allow-changed names them.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <limits>
#include <optional>

#include "engine/checkpoint/series.h"
#include "engine/checkpoint/train_checkpoint.h"
#include "engine/cli/cli.h"
#include "engine/cli/final_model.h"
#include "engine/cli/finetune_options.h"
#include "engine/cli/finetune_outputs.h"
#include "engine/cli/preference_reference.h"
#include "engine/cli/resume_run.h"
#include "engine/cli/run_outputs.h"
#include "engine/cli/step_log.h"
#include "engine/cli/training_run.h"
#include "engine/model/builtin.h"
#include "engine/model/hf_folder.h"
#include "host/error.h"

namespace strider::cli {
namespace {

// The training data as a checkpoint records it: which file, how large, what content.
nlohmann::json data_identity(const std::string& path, TokenFile& file) {
  const TokenFileFingerprint f = file.fingerprint();
  return {{"path", path}, {"bytes", f.bytes}, {"xxh3", fmt::format("{:016x}", f.xxh3)}};
}

}  // namespace

int run_finetune(FinetuneOptions& o) {
  namespace fs = std::filesystem;
  // Data parallel under torchrun (WORLD_SIZE > 1), else a world of one. Rank
  // 0 alone writes (outputs, checkpoints, metrics, the trace) and prints; the
  // others print only their errors (stderr), step on their rows of each
  // global batch, and take every decision with rank 0 (a stop, a skipped
  // step, the end), through the collectives.
  // From the start: a signal before the first step (a long model load) ends
  // the run with a line, not silently by the default action.
  StopSignals signals;
  const std::unique_ptr<Collectives> ranks = collectives_from_env(std::chrono::seconds(o.dist_timeout_s));
  const RankInfo& me = ranks->ranks();
  const bool writes = me.rank == 0;
  if (!writes) STRIDER_CHECK(std::freopen("/dev/null", "w", stdout) != nullptr, "rank {}: cannot quiet its output: {}",
                             me.rank, errno_text(errno));
  const nlohmann::json config_file = config_file_record(o.config_file);  // as the checkpoints record it
  check_objective_run(o);
  // 1. Outputs first: nothing trains for hours to find it cannot write its result.
  RunOutputs outputs;
  open_outputs(o, writes, outputs);
  std::optional<DirLock>& ckpt_lock = outputs.ckpt_lock;
  const std::string& ckpt_root = outputs.ckpt_root;
  std::ofstream& metrics = outputs.metrics;

  // 2. The model, plan, engine and data (locks --nvme).
  // Every rank has checked what it owns before any rank builds its run.
  ranks->barrier();
  TrainingRun tr = make_training_run(o.train, "finetune", RunLength(o.steps, o.epochs), stdout, ranks.get());
  o.steps = tr.total_steps;
  STRIDER_CHECK(!tr.engine->simulated(),
                "--device {}: a simulated device trains nothing; use `strider profile --device {}` or "
                "`strider plan --predict` for its figures",
                o.train.device, o.train.device);
  Engine& engine = *tr.engine;
  const ModelSpec& spec = tr.spec;
  const DType save_dtype = final_model_dtype(o.save_dtype, tr.source_dtype);
  const FinalModel final_model{.out = o.out, .dtype = save_dtype, .merge = o.merge,
                               .base_model = fs::exists(o.train.model) ? fs::absolute(o.train.model).string()
                                                                       : o.train.model,
                               .adapter_bf16 = o.save_dtype == "bf16", .source_dir = tr.model_dir};
  const EngineConfig& cfg = engine.config();
  const nlohmann::json& config = tr.config;
  TokenLoader& loader = *tr.loader;
  const nlohmann::json data = data_identity(tr.data, *tr.train_file);
  std::string eval_data = o.eval_data;
  if (o.train.data == "builtin" && eval_data.empty()) {
    eval_data = (fs::path(o.train.work_dir) / "builtin-eval.tokens").string();
    if (writes) write_builtin_dataset(eval_data, 100'000, 7, o.train.seed + 1);
  }
  if (writes) {
    warn_unlikely_settings(o.train.warmup, o.steps, o.train.lr, !tr.model_dir.empty());
    check_room_for_final_model(final_model, engine.spec());  // said now, not after the run
  }
  ranks->barrier();
  int64_t skipped_total = 0;
  const bool dpo = cfg.objective.objective == "dpo", objective = !cfg.objective.sft();
  // dpo: each window's reference log-probability sum (preference_reference.h), of the training and eval files
  std::vector<float> reference, eval_reference;
  nlohmann::json resumed_extra;  // the checkpoint's, where the eval file's reference is too
  auto extra_json = [&] {
    TokenLoaderState st = loader.state();
    nlohmann::json l = {{"epoch", st.epoch}, {"cursor", st.cursor}, {"seed", st.seed},
                        {"num_windows", st.num_windows}, {"seq", st.seq}};
    nlohmann::json e{{"loader", l}, {"data", tr.data}, {"data_file", data}, {"seed", o.train.seed},
                     {"skipped_steps", skipped_total}, {"world", me.world}, {"config_file", config_file}};
    if (!reference.empty()) e["reference_logps"] = reference_record(reference);  // beside data_file's checksum
    if (!eval_reference.empty()) e["eval_reference_logps"] = reference_record(eval_reference);
    return e;
  };
  // Now, not at the first save after hours of training: what every
  // checkpoint records of the run must be JSON, UTF-8 only.
  if (writes) check_recordable({{"base_model", final_model.base_model}, {"extra", extra_json()}});
  CheckpointSeries series(ckpt_root, int(o.keep_checkpoints));
  int64_t saved_step = -1;
  auto save_checkpoint = [&] {
    if (saved_step == engine.steps_done()) return;
    if (!writes) {  // rank 0 saves; with the state sharded, it gathers this rank's slices as it goes
      serve_training_checkpoint(engine);
      saved_step = engine.steps_done();
      return;
    }
    if (!ckpt_lock) {  // the default under --out: checked and locked when first used
      check_output_dir(ckpt_root, "the checkpoint directory");
      ckpt_lock.emplace(ckpt_root, "the checkpoint directory");
    }
    const fs::path dir = series.save(engine, config.dump(), extra_json(), {.base_model = final_model.base_model});
    saved_step = engine.steps_done();
    fmt::print("  checkpoint: {} (step {})\n", dir.string(), saved_step);
  };
  // A checkpoint that fails to save (a full disk, a permission, something in
  // the way) does not lose the run: the previous one stays, training and the
  // final --out go on, and the run's end says what was kept. (Ranks that save
  // together stop at a failure, as before: rank 0 gathers the others' slices.)
  std::string checkpoint_error;  // the newest save's failure, until one succeeds
  auto kept_checkpoint = [&] {
    return saved_step >= 0 ? fmt::format("the last checkpoint (step {}) stays in {}", saved_step, ckpt_root)
                           : std::string("no checkpoint of this run was saved");
  };
  auto try_checkpoint = [&] {
    if (!me.solo()) {
      save_checkpoint();
      return true;
    }
    try {
      save_checkpoint();
      checkpoint_error.clear();
      return true;
    } catch (const Error& e) {
      checkpoint_error = fmt::format("the checkpoint of step {} failed: {}", engine.steps_done(), e.what());
      fmt::print(stderr, "warning: {}; {}\n", checkpoint_error, kept_checkpoint());
      return false;
    }
  };

  // 3. Resume: the newest checkpoint that loads, on the same data unless allowed.
  if (o.resume) {
    const CheckpointSeries::Resumed r = resume_checkpoint(o, series, engine, tr.data, data, me.world);
    const nlohmann::json& extra = r.extra;
    const auto& l = extra.at("loader");
    const TokenLoaderState st{l.at("epoch"), l.at("cursor"), l.at("seed"), l.at("num_windows"), l.at("seq")};
    if (st.num_windows == loader.state().num_windows) loader.restore(st);
    else fmt::print("  the data has another number of windows: its order starts afresh\n");
    skipped_total = extra.value("skipped_steps", int64_t{0});
    if (dpo) reference = reference_from_record(extra, "reference_logps", tr.train_file->layout().num_docs, r.dir.string());
    resumed_extra = extra;
    saved_step = engine.steps_done();
    fmt::print("  resumed from {} at step {}\n", r.dir.string(), engine.steps_done());
    // fp16: the loss scale is the run's state, so the checkpoint's goes on;
    // --loss-scale (the first scale of a new run) is named, not silently lost.
    if (cfg.loss_scaled() && engine.loss_scale().scale != cfg.loss_scaling.init)
      fmt::print("  the loss scale goes on from the checkpoint's {:g}: --loss-scale {:g} is a new run's first scale\n",
                 engine.loss_scale().scale, cfg.loss_scaling.init);
    STRIDER_CHECK(o.steps > engine.steps_done(),
                  "--steps {}: the checkpoint {} is at step {} already; ask for more --steps to continue", o.steps,
                  r.dir.string(), engine.steps_done());
  }

  // DPO's reference, under the starting weights (LoRA: the frozen base), before the first step.
  const auto stopping = [&] { return ranks->any(signals.requested()); };
  if (dpo && reference.empty()) reference = score_windows(engine, *tr.train_file, !cfg.lora.empty(), stopping);
  PairInputs pair_inputs;
  auto my_objective = [&]() -> const ObjectiveInputs* {
    if (!dpo) return nullptr;  // sft; simpo and orpo take every row, no reference
    return pair_inputs.next(reference, loader.last_windows().subspan(size_t(me.rank * cfg.batch()), size_t(cfg.batch())));
  };
  std::unique_ptr<TokenFile> eval_file;
  PairInputs eval_pairs;
  if (!eval_data.empty() && o.eval_batches > 0) {
    eval_file = std::make_unique<TokenFile>(eval_data, uint64_t(spec.dims.vocab));
    check_token_seq(*eval_file, uint64_t(cfg.seq));
    if (dpo)  // the eval pairs' reference: the checkpoint's, or under the starting weights
      eval_reference = resumed_extra.is_null()
                           ? score_windows(engine, *eval_file, !cfg.lora.empty(), stopping)
                           : reference_from_record(resumed_extra, "eval_reference_logps", eval_file->layout().num_docs,
                                                   "the checkpoint resumed");
  }
  // The global batch; this rank steps on its share of the rows.
  std::vector<int64_t> ids(size_t(cfg.batch() * cfg.seq * me.world)), labels(ids.size());
  std::vector<int64_t> positions(tr.packed ? ids.size() : 0);  // packed documents' (TrainingRun::packed)
  const size_t mine = size_t(me.rank * cfg.batch() * cfg.seq);
  const auto my_positions = [&]() -> const int64_t* { return tr.packed ? positions.data() + mine : nullptr; };
  std::vector<int64_t> attention(ids.size());  // where a batch has padding (an example-mode file's)
  const auto my_attention = [&](bool padded) -> const int64_t* { return padded ? attention.data() + mine : nullptr; };
  auto evaluate = [&] {
    TokenLoader el(*eval_file, {.batch = uint64_t(cfg.batch() * me.world), .seq = uint64_t(cfg.seq), .seed = 0,
                                .shuffle = false, .pair_rows = objective ? uint64_t(cfg.batch()) : 0});
    double sum = 0;
    for (int64_t i = 0; i < o.eval_batches; ++i) {
      // A signal does not wait for the whole evaluation: it is dropped (NaN),
      // and the run stops after it as after a step.
      if (ranks->any(signals.requested())) {
        fmt::print("  evaluation interrupted after {} of {} batches\n", i, o.eval_batches);
        return std::numeric_limits<double>::quiet_NaN();
      }
      const bool padded = el.next(ids, labels, positions, attention);
      if (!objective) {
        sum += engine.evaluate(ids.data() + mine, labels.data() + mine, my_positions(), my_attention(padded));
        continue;
      }
      const std::span<const uint64_t> rows = el.last_windows().subspan(size_t(me.rank * cfg.batch()), size_t(cfg.batch()));
      sum += engine.evaluate_objective(ids.data() + mine, labels.data() + mine, my_positions(), my_attention(padded),
                                       dpo ? eval_pairs.next(eval_reference, rows) : nullptr).loss;
    }
    return sum / double(o.eval_batches);
  };

  // 4. Train.
  if (eval_file && !ranks->any(signals.requested())) {
    const double loss = evaluate();
    if (!std::isnan(loss)) fmt::print("  eval loss before training: {:.4f}\n", loss);
  }
  if (ranks->any(signals.requested())) {  // during the load, the plan, the data or that evaluation
    const int sig = signals.requested() ? signals.signal_number() : SIGTERM;
    fmt::print("interrupted by {} before the first step{}: nothing new to save\n", StopSignals::name(sig),
               engine.steps_done() > 0 ? fmt::format(" (the run resumed at step {})", engine.steps_done()) : "");
    return 128 + sig;
  }
  double first_loss = 0, last_loss = 0;
  const int64_t start_step = engine.steps_done();
  int64_t in_a_row = 0;
  std::string diverged;  // why the numerics guard stopped the run
  StepLog log(start_step, o.steps, &metrics, o.metrics, writes && ::isatty(STDOUT_FILENO) == 1);
  bool stop = false;  // a signal reached a rank: every rank stops after the same step
  std::string data_error;  // the training data failed (changed or cut under the run): stop, keeping the state
  // A step that fails part way (a device, an NVMe read, an update): the
  // last whole state is saved where it can be (engine/run/engine.h,
  // settle_after_failure), the data back at the failed step's batch, so that
  // a resume is the run that never failed. Data parallel: another rank's
  // part of the step is unknown, and the error ends the run as it is.
  const std::optional<InjectedFault> fault = injected_fault_from_env();
  auto step_failed = [&](const std::string& error, int64_t steps_before, const TokenLoaderState& batch_at) {
    const std::string broken = engine.settle_after_failure(error);
    std::string kept;
    if (!broken.empty()) {
      kept = fmt::format("the state after it is not whole ({}), so {}", broken, kept_checkpoint());
    } else {
      if (engine.steps_done() == steps_before) loader.restore(batch_at);  // else the step did complete
      try {
        save_checkpoint();
        kept = fmt::format("the state of step {} is saved in {}; resume with --checkpoint-dir {} --resume",
                           engine.steps_done(), ckpt_root, ckpt_root);
      } catch (const Error& e) {
        kept = fmt::format("saving the state of step {} failed too ({}), so {}", engine.steps_done(), e.what(),
                           kept_checkpoint());
      }
    }
    return Error(fmt::format("step {} failed: {}; {}", steps_before + 1, error, kept));
  };
  while (engine.steps_done() < o.steps && !(stop = ranks->any(signals.requested() || !data_error.empty()))) {
    bool padded = false;
    const TokenLoaderState batch_at = loader.state();
    try {
      padded = loader.next(ids, labels, positions, attention);
    } catch (const Error& e) {
      data_error = e.what();
      continue;  // every rank stops after the same step, through the check above
    }
    const int64_t steps_before = engine.steps_done();
    if (fault && fault->step == steps_before + 1) engine.inject_device_fault(fault->kind, fault->block);
    StepReport r;
    try {
      r = engine.step(ids.data() + mine, labels.data() + mine, my_positions(), my_attention(padded), my_objective());
    } catch (const std::exception& e) {
      if (!me.solo()) throw;
      log.clear();
      throw step_failed(e.what(), steps_before, batch_at);
    }
    if (r.no_targets) {
      // Sparse targets (chat data masked to the assistant's turns): this batch
      // has none. Nothing changed; the data moves on; not a fault, so it does
      // not count toward --max-skipped-steps.
      ++skipped_total;
      const TokenLoaderState at = loader.state();
      log.skipped(r.step,
                  fmt::format("{}; nothing changed, the data moves on (epoch {}, window {} of {})", r.skip_reason,
                              at.epoch, at.cursor, at.num_windows),
                  {{"step", r.step}, {"skipped", true}, {"reason", r.skip_reason}, {"no_targets", true},
                   {"epoch", at.epoch}, {"window", at.cursor}});
      continue;
    }
    if (r.overflow) {  // fp16: nothing changed, the loss scale backed off; not a divergence
      ++skipped_total;
      const double next = engine.loss_scale().scale;
      log.skipped(r.step,
                  fmt::format("fp16 gradients overflowed at loss scale {:g} (block {}, {}); the scale is now {:g}",
                              r.loss_scale, r.nonfinite_block, r.nonfinite_tensor, next),
                  {{"step", r.step}, {"skipped", true}, {"reason", r.skip_reason}, {"overflow", true},
                   {"loss_scale", r.loss_scale}, {"next_loss_scale", next}, {"nonfinite_block", r.nonfinite_block},
                   {"nonfinite_tensor", r.nonfinite_tensor}, {"loss", r.loss}});
      continue;
    }
    if (r.skipped) {
      ++skipped_total;
      ++in_a_row;
      const std::string where =
          r.nonfinite_block >= 0 ? fmt::format("; first non-finite gradient: block {} ({})", r.nonfinite_block,
                                               r.nonfinite_tensor)
                                 : "";
      log.skipped(r.step,
                  fmt::format("{}{} ({} in a row; the run stops at {})", r.skip_reason, where, in_a_row,
                              o.max_skipped_steps),
                  {{"step", r.step}, {"skipped", true}, {"reason", r.skip_reason},
                   {"nonfinite_block", r.nonfinite_block}, {"nonfinite_tensor", r.nonfinite_tensor},
                   {"loss", r.loss}, {"grad_norm", r.grad_norm}});
      if (in_a_row >= o.max_skipped_steps) {
        const std::string param = engine.first_non_finite_param();
        diverged = fmt::format("step {}: {} steps in a row were skipped (--max-skipped-steps {}), the last because "
                               "the {}{}{}; the model stays at step {}",
                               r.step, in_a_row, o.max_skipped_steps, r.skip_reason, where,
                               param.empty() ? "" : "; first non-finite parameter: " + param, engine.steps_done());
        break;
      }
      continue;
    }
    in_a_row = 0;
    if (r.step == start_step + 1) first_loss = r.loss;
    last_loss = r.loss;
    nlohmann::json line = log.trained(r);
    // Every --eval-every steps, and after the last step whatever --eval-every.
    if (eval_file && (r.step % o.eval_every == 0 || r.step == o.steps)) {
      log.clear();  // the evaluation may print
      if (const double loss = evaluate(); !std::isnan(loss)) {
        line["eval_loss"] = loss;
        log.note(fmt::format("           eval loss {:.4f}", loss));
      }
    }
    log.append(line);
    if (!o.checkpoint_dir.empty() && o.checkpoint_every > 0 && r.step % o.checkpoint_every == 0) {
      log.clear();  // the save prints its line
      try_checkpoint();
    }
  }
  engine.finish_updates();
  log.clear();
  auto write_trace = [&] {
    if (o.trace.empty() || !writes) return;
    engine.timeline().write_chrome_trace(o.trace);
    fmt::print("  trace: {}\n", o.trace);
  };

  // 5. How the run ends: diverged, interrupted, or done.
  if (!diverged.empty()) {
    // Skipped steps changed nothing: the state is the last good step's,
    // unless an update itself overflowed (a save then refuses the state, and
    // says so below the reason the run stopped).
    std::string not_saved;
    if (!o.checkpoint_dir.empty()) {
      try {
        save_checkpoint();
      } catch (const Error& e) {
        not_saved = fmt::format(" (its state was not saved: {})", e.what());
      }
    }
    write_trace();
    ranks->barrier();  // no rank's exit may stop rank 0's save
    throw Error(fmt::format("the run diverged: {}{}. Lower --lr (or raise --warmup) and resume from {}", diverged,
                            not_saved, saved_step >= 0 ? ckpt_root : "a new start"));
  }
  if (stop && ranks->any(!data_error.empty())) {
    // The state is the last good step's: kept, then the reason.
    std::string saved;
    try {
      save_checkpoint();
      saved = fmt::format("the state of step {} is saved in {}; resume with --checkpoint-dir {} --resume once the data "
                          "is whole (or --allow-changed data on other data)",
                          engine.steps_done(), ckpt_root, ckpt_root);
    } catch (const Error& e) {
      saved = fmt::format("saving the state of step {} failed too: {}", engine.steps_done(), e.what());
    }
    write_trace();
    ranks->barrier();
    throw Error(fmt::format("the training data failed after step {}: {}; {}", engine.steps_done(),
                            data_error.empty() ? "on another rank" : data_error, saved));
  }
  if (stop) {
    // The signal may have reached another rank only (torchrun forwards it to all).
    const int sig = signals.requested() ? signals.signal_number() : SIGTERM;
    fmt::print("interrupted by {} after step {}: saving\n", StopSignals::name(sig), engine.steps_done());
    std::fflush(stdout);  // a supervisor watching the output knows the save has begun
    if (try_checkpoint()) {
      write_trace();
      ranks->barrier();  // a rank that exits first would have torchrun stop rank 0 mid-save
      fmt::print("resume with --checkpoint-dir {} --resume\n", ckpt_root);
      return 128 + sig;
    }
    fmt::print(stderr, "saving the trained model to --out {} instead\n", o.out);  // the final save below
  }
  if (!o.checkpoint_dir.empty()) try_checkpoint();
  write_trace();

  // A checkpoint transformers loads (with LoRA, an adapter PEFT loads),
  // written by rank 0. Every rank reads the weights: from an fp32 compute
  // copy they are the master, which a sharded state gathers from every rank.
  // A write that fails (a full disk) stops writing, but every rank still
  // takes part in gathering the weights; then the trained state is kept.
  // Rank 0 writes the whole folder beside --out, then switches it in at
  // once (out_folder.h): --out holds the earlier folder or this one, never a mix.
  FinalModel into = final_model;
  if (writes) into.out = outputs.out->begin();
  FinalSaveResult saved = save_final_model(engine, spec, config.dump(2), into, writes);
  // What from_pretrained, AutoTokenizer and generate() read besides the
  // weights, as the source checkpoint had it: copied, so the folder loads as is.
  std::vector<std::string> copied, replaced;
  if (writes && saved.error.empty()) try {
      if (!tr.model_dir.empty()) {
        copied = copy_model_companions(tr.model_dir, into.out);
        if (o.merge) copy_model_companions(tr.model_dir, into.merged_dir());
      }
      replaced = outputs.out->commit();
    } catch (const Error& e) {
      saved.error = e.what();
    }
  if (writes && !saved.error.empty()) outputs.out->abandon();  // --out is as it was
  const std::string& write_error = saved.error;
  if (ranks->any(!write_error.empty())) {
    std::string kept;
    try {
      save_checkpoint();  // nothing to do when --checkpoint-dir holds this step already
      kept = fmt::format("the trained state (step {}) is in {}", saved_step, ckpt_root);
    } catch (const Error& e) {
      kept = fmt::format("saving the trained state failed too: {}", e.what());
    }
    ranks->barrier();
    throw Error(fmt::format("the final save to --out {} failed: {}; {}. Free space and resume with --checkpoint-dir {} "
                            "--resume and a larger --steps, or load that checkpoint from Python "
                            "(strider.Engine.resume)",
                            o.out, write_error.empty() ? "on rank 0" : write_error, kept, ckpt_root));
  }
  if (!writes) return 0;
  const std::string what = o.train.lora.empty() ? std::string(dtype_name(save_dtype))
                           : fmt::format("a PEFT adapter, {}{}", dtype_name(final_model.adapter_dtype()),
                                         o.merge ? fmt::format("; the merged model ({}) in {}", dtype_name(save_dtype),
                                                               final_model.merged_dir())
                                                 : "");
  fmt::print("saved {} (steps {}..{}; loss {:.4f} -> {:.4f}{}; {}{})\n", o.out, start_step + 1, engine.steps_done(),
             first_loss, last_loss, skipped_total ? fmt::format("; {} steps skipped", skipped_total) : "", what,
             copied.empty() ? "" : fmt::format("; with {} from --model", fmt::join(copied, ", ")));
  if (!replaced.empty()) fmt::print("  replaced the earlier --out: {}\n", fmt::join(replaced, ", "));
  STRIDER_CHECK(checkpoint_error.empty(), "{}; the trained model is saved in --out {}, and {}", checkpoint_error,
                o.out, kept_checkpoint());
  return 0;
}

}  // namespace strider::cli
