// strider finetune: the README's main job.
#include <csignal>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/builtin.h"
#include "engine/cli/cli.h"
#include "engine/engine.h"
#include "engine/hf_checkpoint.h"
#include "engine/plan.h"
#include "engine/train_checkpoint.h"
#include "host/error.h"
#include "io/token_data.h"

namespace strider::cli {
namespace {

volatile std::sig_atomic_t g_stop = 0;
void on_sigint(int) { g_stop = 1; }

struct Options {
  std::string model = "builtin", data = "builtin", eval_data, out = "strider-out", trace, metrics;
  std::string device = "auto", device_budget = "24MiB", host_ram = "0", nvme, dtype = "bf16", schedule = "cosine";
  std::string work_dir = ".strider", checkpoint_dir;
  int64_t checkpoint_every = 0;
  bool resume = false;
  int64_t seq = 128, micro_batch = 4, accumulation = 2, window = 0, steps = 120, warmup = 10, eval_every = 30;
  int64_t eval_batches = 2, vocab_chunk = 8192;
  double lr = 5e-3, weight_decay = 0.01, clip = 1.0, beta1 = 0.9, beta2 = 0.95;
  uint64_t seed = 1234;
  int optimizer_threads = 0;
};

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  STRIDER_CHECK(in.good(), "cannot read {}", p.string());
  return {std::istreambuf_iterator<char>(in), {}};
}

int run(const Options& o) {
  namespace fs = std::filesystem;
  // The model.
  nlohmann::json config;
  std::string model_dir;
  if (o.model == "builtin") {
    config = builtin_model_config();
  } else {
    fs::path p = fs::is_directory(o.model) ? fs::path(o.model) / "config.json" : fs::path(o.model);
    model_dir = fs::is_directory(o.model) ? o.model : fs::path(o.model).parent_path().string();
    config = nlohmann::json::parse(read_text(p), nullptr, false);
    STRIDER_CHECK(!config.is_discarded(), "{}: not valid JSON", p.string());
  }
  ModelSpec spec = ModelSpec::from_json(config, o.model == "builtin" ? "built-in model" : o.model);

  // The plan, before anything is allocated.
  PlanLimits lim;
  lim.device_bytes = parse_bytes(o.device_budget);
  lim.host_bytes = parse_bytes(o.host_ram);
  lim.nvme_dir = o.nvme;
  lim.seq = o.seq;
  lim.micro_batch = o.micro_batch;
  lim.accumulation = o.accumulation;
  STRIDER_CHECK(o.dtype == "bf16" || o.dtype == "fp32", "--dtype {} is not bf16 or fp32", o.dtype);
  lim.dtype = o.dtype == "fp32" ? at::kFloat : at::kBFloat16;
  lim.vocab_chunk = o.vocab_chunk;
  lim.window = o.window;
  Plan plan = Plan::make(spec, lim);
  fmt::print("strider finetune: {}\n{}", spec.summary(), plan.explain());
  STRIDER_CHECK(plan.feasible, "{}", plan.reason);

  EngineConfig cfg = plan.engine_config(lim);
  cfg.adam = {.lr = o.lr, .beta1 = o.beta1, .beta2 = o.beta2, .eps = 1e-8, .weight_decay = o.weight_decay};
  cfg.schedule = {LrSchedule::parse_shape(o.schedule), o.warmup, o.steps};
  cfg.clip_norm = o.clip;
  cfg.optimizer_threads = o.optimizer_threads;
  std::string why;
  auto device = make_device({.spec = o.device, .budget_bytes = lim.device_bytes, .record_spans = true}, &why);
  fmt::print("  device: {}{}\n", device->name(), why.empty() ? "" : " (" + why + ")");
  Engine engine(spec, cfg, std::move(device));

  // The parameters.
  if (model_dir.empty()) {
    engine.init_params(o.seed);
  } else {
    HfCheckpointReader reader(model_dir, spec);
    for (int64_t b = 0; b < spec.num_blocks(); ++b) {
      std::vector<float> w(reader.layout(b).total_elems());
      reader.read_block(b, w);
      engine.write_state(b, ExtentKind::kMaster, w);
    }
    fmt::print("  loaded {}\n", model_dir);
  }

  // The data.
  fs::create_directories(o.work_dir);
  std::string data = o.data, eval_data = o.eval_data;
  if (data == "builtin") {
    data = (fs::path(o.work_dir) / "builtin-train.tokens").string();
    write_builtin_dataset(data, 2'000'000, 7, o.seed);
    if (eval_data.empty()) {
      eval_data = (fs::path(o.work_dir) / "builtin-eval.tokens").string();
      write_builtin_dataset(eval_data, 100'000, 7, o.seed + 1);
    }
  }
  TokenFile train_file(data, uint64_t(spec.dims.vocab));
  TokenLoader loader(train_file, {.batch = uint64_t(cfg.batch()), .seq = uint64_t(cfg.seq), .seed = o.seed});
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
                             {{"loader", loader_json()}, {"data", data}, {"seed", o.seed}});
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
  c->add_option("--model", o->model, "Hugging Face checkpoint directory, or 'builtin'")->capture_default_str();
  c->add_option("--data", o->data, "token file (python -m strider.data), or 'builtin'")->capture_default_str();
  c->add_option("--eval-data", o->eval_data, "held-out token file, evaluated every --eval-every steps");
  c->add_option("--eval-every", o->eval_every, "steps between evaluations")->capture_default_str();
  c->add_option("--out", o->out, "where the final transformers checkpoint goes")->capture_default_str();
  c->add_option("--device", o->device, "auto, cpu, cuda, cuda:N")->capture_default_str();
  c->add_option("--device-budget", o->device_budget, "device memory strider may use (e.g. 20GiB)")->capture_default_str();
  c->add_option("--host-ram", o->host_ram, "pinned host RAM limit (0: no limit); past it state goes to --nvme")
      ->capture_default_str();
  c->add_option("--nvme", o->nvme, "directory on NVMe for optimizer state that does not fit in RAM");
  c->add_option("--seq", o->seq, "sequence length")->capture_default_str();
  c->add_option("--micro-batch", o->micro_batch, "sequences per micro-batch")->capture_default_str();
  c->add_option("--accumulation", o->accumulation, "micro-batches per optimizer step")->capture_default_str();
  c->add_option("--window", o->window, "cache units K (0: the plan chooses)")->capture_default_str();
  c->add_option("--dtype", o->dtype, "bf16 or fp32 compute")->capture_default_str();
  c->add_option("--vocab-chunk", o->vocab_chunk, "LM-head vocabulary rows per chunk")->capture_default_str();
  c->add_option("--lr", o->lr, "peak learning rate")->capture_default_str();
  c->add_option("--schedule", o->schedule, "constant, linear or cosine (with warm-up)")->capture_default_str();
  c->add_option("--warmup", o->warmup, "warm-up steps")->capture_default_str();
  c->add_option("--steps", o->steps, "optimizer steps")->capture_default_str();
  c->add_option("--weight-decay", o->weight_decay, "AdamW weight decay")->capture_default_str();
  c->add_option("--clip", o->clip, "global gradient-norm clip (0: off)")->capture_default_str();
  c->add_option("--seed", o->seed, "seed for initialisation and data order")->capture_default_str();
  c->add_option("--optimizer-threads", o->optimizer_threads, "CPU AdamW threads (0: all)")->capture_default_str();
  c->add_option("--trace", o->trace, "write the timeline as Chrome trace JSON (Perfetto)");
  c->add_option("--metrics", o->metrics, "append one JSON line per step");
  c->add_option("--work-dir", o->work_dir, "where built-in data is generated")->capture_default_str();
  c->add_option("--checkpoint-dir", o->checkpoint_dir, "full training state (resumable), saved atomically");
  c->add_option("--checkpoint-every", o->checkpoint_every, "steps between checkpoints (0: only at the end)")
      ->capture_default_str();
  c->add_flag("--resume", o->resume, "continue from --checkpoint-dir (weights, Adam state, step, data position)");
  return [o] { return run(*o); };
}

}  // namespace strider::cli
