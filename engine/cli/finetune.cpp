// strider finetune: the README's main job.
#include <csignal>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/builtin.h"
#include "engine/cli/cli.h"
#include "engine/cli/training_run.h"
#include "engine/hf_checkpoint.h"
#include "engine/train_checkpoint.h"
#include "host/error.h"

namespace strider::cli {
namespace {

volatile std::sig_atomic_t g_stop = 0;
void on_sigint(int) { g_stop = 1; }

struct Options {
  TrainOptions train;
  std::string eval_data, out = "strider-out", trace, metrics, checkpoint_dir;
  int64_t checkpoint_every = 0, steps = 120, eval_every = 30, eval_batches = 2;
  bool resume = false;
};

int run(const Options& o) {
  namespace fs = std::filesystem;
  TrainingRun tr = make_training_run(o.train, "finetune", o.steps);
  STRIDER_CHECK(!tr.engine->simulated(),
                "--device {}: a simulated device trains nothing; use `strider profile --device {}` or "
                "`strider plan --predict` for its figures",
                o.train.device, o.train.device);
  Engine& engine = *tr.engine;
  const ModelSpec& spec = tr.spec;
  const EngineConfig& cfg = engine.config();
  const nlohmann::json& config = tr.config;
  const std::string& data = tr.data;
  TokenLoader& loader = *tr.loader;
  std::string eval_data = o.eval_data;
  if (o.train.data == "builtin" && eval_data.empty()) {
    eval_data = (fs::path(o.train.work_dir) / "builtin-eval.tokens").string();
    write_builtin_dataset(eval_data, 100'000, 7, o.train.seed + 1);
  }
  auto loader_json = [&] {
    TokenLoaderState st = loader.state();
    return nlohmann::json{{"epoch", st.epoch}, {"cursor", st.cursor}, {"seed", st.seed},
                          {"num_windows", st.num_windows}, {"seq", st.seq}};
  };
  int64_t saved_step = -1;
  auto save_checkpoint = [&] {
    if (saved_step == engine.steps_done()) return;
    saved_step = engine.steps_done();
    save_training_checkpoint(o.checkpoint_dir, engine, config.dump(),
                             {{"loader", loader_json()}, {"data", data}, {"seed", o.train.seed}});
    fmt::print("  checkpoint: {} (step {})\n", o.checkpoint_dir, engine.steps_done());
  };
  if (o.resume) {
    STRIDER_CHECK(!o.checkpoint_dir.empty(), "--resume needs --checkpoint-dir");
    nlohmann::json extra = load_training_checkpoint(o.checkpoint_dir, engine, {.allow_changed = {"total_steps"}});
    const auto& l = extra.at("loader");
    loader.restore({l.at("epoch"), l.at("cursor"), l.at("seed"), l.at("num_windows"), l.at("seq")});
    fmt::print("  resumed from {} at step {}\n", o.checkpoint_dir, engine.steps_done());
  }
  std::unique_ptr<TokenFile> eval_file;
  if (!eval_data.empty()) eval_file = std::make_unique<TokenFile>(eval_data, uint64_t(spec.dims.vocab));
  std::vector<int64_t> ids(size_t(cfg.batch() * cfg.seq)), labels(ids.size());
  auto evaluate = [&] {
    TokenLoader el(*eval_file, {.batch = uint64_t(cfg.batch()), .seq = uint64_t(cfg.seq), .seed = 0, .shuffle = false});
    double sum = 0;
    for (int64_t i = 0; i < o.eval_batches; ++i) {
      el.next(ids, labels);
      sum += engine.evaluate(ids.data(), labels.data());
    }
    return sum / double(o.eval_batches);
  };

  std::ofstream metrics;
  if (!o.metrics.empty()) metrics.open(o.metrics, std::ios::app);
  std::signal(SIGINT, on_sigint);
  if (eval_file) fmt::print("  eval loss before training: {:.4f}\n", evaluate());
  double first_loss = 0, last_loss = 0;
  const int64_t start_step = engine.steps_done();
  int64_t step = start_step;
  for (; step < o.steps && !g_stop; ++step) {
    loader.next(ids, labels);
    StepReport r = engine.step(ids.data(), labels.data());
    if (r.step == start_step + 1) first_loss = r.loss;
    last_loss = r.loss;
    fmt::print("step {:>4}/{} | loss {:.4f} | lr {:.2e} | norm {:.3f} | {:>7.0f} tok/s | {:.3f} s | overlap {:.2f} "
               "(critical: {}) | peak dev {}\n",
               r.step, o.steps, r.loss, r.lr, r.grad_norm, r.tokens_per_s, r.step_s, r.stats.overlap_efficiency,
               lane_name(r.stats.critical), format_bytes(r.peak_device_bytes));
    std::fflush(stdout);
    nlohmann::json lanes;
    for (int l = 0; l < kNumLanes; ++l)
      lanes[std::string(lane_name(Lane(l)))] = r.stats.lanes[size_t(l)].busy_fraction;
    nlohmann::json line = {{"step", r.step}, {"loss", r.loss}, {"lr", r.lr}, {"grad_norm", r.grad_norm},
                           {"tokens_per_s", r.tokens_per_s}, {"step_s", r.step_s},
                           {"overlap_efficiency", r.stats.overlap_efficiency}, {"lanes", lanes},
                           {"peak_device_bytes", r.peak_device_bytes}};
    if (eval_file && o.eval_every > 0 && r.step % o.eval_every == 0) {
      line["eval_loss"] = evaluate();
      fmt::print("           eval loss {:.4f}\n", line["eval_loss"].get<double>());
    }
    if (metrics.is_open()) metrics << line.dump() << "\n" << std::flush;
    if (!o.checkpoint_dir.empty() && o.checkpoint_every > 0 && r.step % o.checkpoint_every == 0) save_checkpoint();
  }
  if (g_stop) fmt::print("interrupted after step {}: saving\n", step);
  engine.finish_updates();
  if (!o.checkpoint_dir.empty()) save_checkpoint();
  if (!o.trace.empty()) {
    engine.timeline().write_chrome_trace(o.trace);
    fmt::print("  trace: {}\n", o.trace);
  }

  // A checkpoint transformers loads.
  HfCheckpointWriter writer(o.out, spec, config.dump(2), {.dtype = DType::kBF16});
  for (int64_t b = 0; b < spec.num_blocks(); ++b) {
    std::vector<float> w(spec.layout(b).total_elems());
    engine.read_state(b, ExtentKind::kMaster, w);
    writer.write_block(b, w);
  }
  writer.finish();
  fmt::print("saved {} (steps {}..{}; loss {:.4f} -> {:.4f})\n", o.out, start_step + 1, step, first_loss, last_loss);
  return 0;
}

}  // namespace

std::function<int()> add_finetune(CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* c = app.add_subcommand("finetune", "fine-tune a model (with no options: the built-in demo)");
  add_model_options(*c, o->train);
  c->add_option("--eval-data", o->eval_data, "held-out token file, evaluated every --eval-every steps");
  c->add_option("--eval-every", o->eval_every, "steps between evaluations")->capture_default_str();
  c->add_option("--out", o->out, "where the final transformers checkpoint goes")->capture_default_str();
  add_placement_options(*c, o->train);
  c->add_option("--steps", o->steps, "optimizer steps")->capture_default_str();
  add_optimizer_options(*c, o->train);
  c->add_option("--trace", o->trace, "write the timeline as Chrome trace JSON (Perfetto)");
  c->add_option("--metrics", o->metrics, "append one JSON line per step");
  add_work_dir_option(*c, o->train);
  c->add_option("--checkpoint-dir", o->checkpoint_dir, "full training state (resumable), saved atomically");
  c->add_option("--checkpoint-every", o->checkpoint_every, "steps between checkpoints (0: only at the end)")
      ->capture_default_str();
  c->add_flag("--resume", o->resume, "continue from --checkpoint-dir (weights, Adam state, step, data position)");
  return [o] { return run(*o); };
}

}  // namespace strider::cli
