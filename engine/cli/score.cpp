// strider score: every window of a token file scored by a model, forward
// only (Engine::logprobs): one JSON line per window, in the file's order,
//   {"window": i, "first_token": i * seq, "targets": n, "logprob": sum,
//    "mean_logprob": sum / n}
// where the sum is of log p(label | prefix) over the window's n targets (a
// masked prompt's and padding's tokens are none; a window without one has
// logprob 0 and mean_logprob null). The windows are those the training loader
// cuts (seq tokens, a document's last token never predicting the next one's
// first), unshuffled. Written whole to --out at the end, or to stdout.
#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/cli/cli.h"
#include "engine/cli/run_outputs.h"
#include "engine/cli/training_run.h"
#include "host/error.h"
#include "io/atomic_file.h"

namespace strider::cli {
namespace {

struct Options {
  TrainOptions train;
  std::string out = "-";
  std::string config_file;  // --config, an input too
};

int run(Options& o) {
  check_single_process("score");
  if (o.out != "-") {
    check_output_file(o.out, "--out");
    std::vector<RunPath> inputs{{"--model", o.train.model}, {"--data", o.train.data}};
    if (!o.config_file.empty()) inputs.push_back({"--config", o.config_file});
    check_paths_apart(inputs, {{"--out", o.out}}, {});
  }
  std::FILE* log = o.out == "-" ? stderr : stdout;  // stdout holds the lines when --out is not given
  TrainingRun tr = make_training_run(o.train, "score", 1, log);
  Engine& engine = *tr.engine;
  const EngineConfig& cfg = engine.config();
  const size_t tokens = size_t(cfg.batch() * cfg.seq);
  // The training loader's windows, in the file's order.
  TokenLoader windows(*tr.train_file, {.batch = uint64_t(cfg.batch()), .seq = uint64_t(cfg.seq), .shuffle = false});
  const uint64_t total = windows.num_windows();
  std::vector<int64_t> ids(tokens), labels(tokens), positions(tr.packed ? tokens : 0), attention(tokens);
  std::string text;
  for (uint64_t first = 0; first < total; first += uint64_t(cfg.batch())) {
    const bool padded = windows.next(ids, labels, positions, attention);
    const std::vector<float> lp = engine.logprobs(ids.data(), labels.data(), tr.packed ? positions.data() : nullptr,
                                                  padded ? attention.data() : nullptr);
    for (uint64_t r = 0; r < uint64_t(cfg.batch()) && first + r < total; ++r) {
      double sum = 0;
      int64_t targets = 0;
      for (size_t t = size_t(r) * size_t(cfg.seq); t < size_t(r + 1) * size_t(cfg.seq); ++t) {
        sum += lp[t];
        targets += labels[t] != -100;
      }
      const uint64_t w = first + r;
      nlohmann::ordered_json line = {{"window", w}, {"first_token", w * uint64_t(cfg.seq)}, {"targets", targets},
                             {"logprob", sum}, {"mean_logprob", nullptr}};
      if (targets > 0) line["mean_logprob"] = sum / double(targets);
      text += line.dump() + "\n";
    }
  }
  if (o.out == "-") {
    fmt::print("{}", text);
    return 0;
  }
  AtomicFile file(o.out);
  file.write(std::as_bytes(std::span(text.data(), text.size())));
  file.commit();
  fmt::print(log, "scored {} windows of {} tokens into {}\n", total, cfg.seq, o.out);
  return 0;
}

}  // namespace

std::function<int()> add_score(CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* c = app.add_subcommand(
      "score", "score every window of a token file with a model, forward only: one JSON line per window with "
               "the sum of its targets' log-probabilities");
  add_model_options(*c, o->train);
  add_placement_options(*c, o->train);
  add_work_dir_option(*c, o->train);
  c->add_option("--out", o->out, "a JSON-lines file, written whole at the end (-: standard output)")
      ->capture_default_str();
  CLI::Option* config = app.get_config_ptr();
  return [o, config] {
    if (config != nullptr && config->count() > 0) o->config_file = config->as<std::string>();
    return run(*o);
  };
}

}  // namespace strider::cli
