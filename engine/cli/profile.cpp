// strider profile: a few steps of a model and configuration (the options of
// `strider finetune`), then where the time went: per lane its busy time and
// fraction of the step, the critical (busiest) lane, the overlap efficiency
// (busiest lane / step time), tokens/s and model FLOP/s, counted two ways:
//   6·N·tokens     the usual convention (N: every parameter, embeddings too);
//   executed       what the engine computes: forward, the backward's recompute
//                  of each block's forward (none for a layer that keeps its
//                  activations, experts and soft-capped attention aside),
//                  and backward
//                  (ModelSpec::cost).
// Per step, too, what crossed the bus each way (bytes, and bytes per model
// parameter: 2 in for each bf16 visit of a parameter, 4 out for its fp32
// gradient), of it the kept activations' traffic (the spans "d2h
// activations" and "h2d activations": bytes and busy time), and ATen's
// working memory (the most any one compute op held: the figure the plan's
// per-block estimate is meant to cover).
// Writes the run's Chrome trace, and a PNG of one measured step drawn by
// bench/profile_plot.py under the project's Python. Saves no checkpoint.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/cli/cli.h"
#include "engine/cli/run_outputs.h"
#include "engine/cli/training_run.h"
#include "host/error.h"

#ifndef STRIDER_PYTHON_DEFAULT
#define STRIDER_PYTHON_DEFAULT ""
#endif
#ifndef STRIDER_PLOT_SCRIPT_DEFAULT
#define STRIDER_PLOT_SCRIPT_DEFAULT "bench/profile_plot.py"
#endif

namespace strider::cli {
namespace {

struct Options {
  TrainOptions train;
  int64_t skip_steps = 2, steps = 3;
  std::string out = "strider-profile";
  std::string python = STRIDER_PYTHON_DEFAULT[0] != '\0' ? STRIDER_PYTHON_DEFAULT : "python3";
  std::string plot_script = STRIDER_PLOT_SCRIPT_DEFAULT;
  bool no_png = false, json = false;
};

// FLOPs of one optimizer step as the engine runs it: per micro-batch, every
// block but the head runs forward, then recompute + backward (the engine's
// "recompute+backward" op: 1.5 x backward = forward again + backward); a
// layer that keeps its activations (EngineConfig::saved_blocks, the op
// "backward") recomputes only BlockCost::backward_recompute_flops (its
// experts, a soft-capped attention core; its norms, RoPE and element-wise
// ops are not counted, as nowhere in ModelSpec::cost); the head runs its loss forward and backward once (its
// backward recomputes the logits chunk by chunk, which ModelSpec counts in
// backward_flops, unless they were kept: EngineConfig::keep_logits).
struct StepFlops {
  double executed = 0;      // forward + recompute + backward
  double six_n_t = 0;       // 6 x parameters x tokens
};

StepFlops step_flops(const ModelSpec& spec, const EngineConfig& c) {
  StepFlops f;
  const int dtype_bytes = int(c10::elementSize(c.compute.dtype));
  const int64_t head = spec.num_blocks() - 1;
  for (int64_t b = 0; b <= head; ++b) {
    const BlockCost k = spec.cost(b, c.micro_batch, c.seq, c.compute.vocab_chunk, dtype_bytes, c.compute.token_tile,
                                  WorkCoefficients::analytic(), c.packed_documents);
    const bool kept = std::find(c.saved_blocks.begin(), c.saved_blocks.end(), b) != c.saved_blocks.end();
    const double recompute = b == head ? 0.0 : kept ? k.backward_recompute_flops : k.forward_flops;
    const double backward = b == head && c.keep_logits ? k.backward_flops * 2 / 3 : k.backward_flops;
    f.executed += (k.forward_flops + recompute + backward) * double(c.accumulation);
  }
  f.six_n_t = 6.0 * double(spec.param_count()) * double(c.batch() * c.seq);
  return f;
}

// The kept activations' copies (EngineConfig::saved_blocks) among spans:
// their bytes and busy time each way. One stream's copies never overlap, so
// the busy time is the sum of the spans' durations.
struct ActivationTraffic {
  uint64_t d2h_bytes = 0, h2d_bytes = 0;
  double d2h_busy_s = 0, h2d_busy_s = 0;
  nlohmann::json to_json() const {
    return {{"d2h_bytes", d2h_bytes}, {"h2d_bytes", h2d_bytes}, {"d2h_busy_s", d2h_busy_s},
            {"h2d_busy_s", h2d_busy_s}};
  }
};

ActivationTraffic activation_traffic(const std::vector<Span>& spans, size_t from) {
  ActivationTraffic t;
  for (size_t i = from; i < spans.size(); ++i) {
    const Span& s = spans[i];
    if (s.name == "d2h activations") {
      t.d2h_bytes += s.bytes;
      t.d2h_busy_s += (s.end_us - s.begin_us) * 1e-6;
    } else if (s.name == "h2d activations") {
      t.h2d_bytes += s.bytes;
      t.h2d_busy_s += (s.end_us - s.begin_us) * 1e-6;
    }
  }
  return t;
}

// A pool's devices (EngineConfig::devices > 1): each one's busy time per
// device lane (the sum of its spans' durations: one stream's spans never
// overlap) and its hand-offs to and from the others (the hand-off lane:
// kHandOut's "d2h hand-off ...", kHandIn's "h2d hand-off ...").
struct DeviceLanes {
  double compute_s = 0, h2d_s = 0, d2h_s = 0, hand_out_s = 0, hand_in_s = 0;
  uint64_t hand_out_bytes = 0, hand_in_bytes = 0;
};

void add_device_lanes(const std::vector<Span>& spans, size_t from, std::vector<DeviceLanes>& per) {
  for (size_t i = from; i < spans.size(); ++i) {
    const Span& s = spans[i];
    if (s.device < 0 || size_t(s.device) >= per.size()) continue;
    DeviceLanes& d = per[size_t(s.device)];
    const double t = (s.end_us - s.begin_us) * 1e-6;
    if (s.lane == Lane::kCompute) d.compute_s += t;
    if (s.lane == Lane::kH2D) d.h2d_s += t;
    if (s.lane == Lane::kD2H) d.d2h_s += t;
    if (s.lane == Lane::kHandOff && s.name.rfind("h2d", 0) == 0) {
      d.hand_in_s += t;
      d.hand_in_bytes += s.bytes;
    } else if (s.lane == Lane::kHandOff) {
      d.hand_out_s += t;
      d.hand_out_bytes += s.bytes;
    }
  }
}

// 'text' for sh -c, whatever it holds.
std::string shell_quote(const std::string& text) {
  std::string q = "'";
  for (char ch : text) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

struct PlotResult {
  bool ok = false;
  std::string message;  // why not, when !ok
};

// Runs the plot script; its own printout (the same figures from the trace)
// is kept out of ours, and shown only when it fails.
PlotResult draw_png(const Options& o, const std::string& trace, const std::string& png, int64_t step,
                    const ModelSpec& spec, int64_t tokens, std::string* command_out) {
  const std::string cmd = fmt::format("{} {} {} --step {} --out {} --params {} --tokens {}",
                                      shell_quote(o.python), shell_quote(o.plot_script), shell_quote(trace), step,
                                      shell_quote(png), spec.param_count(), tokens);
  *command_out = cmd;
  if (o.python.find('/') != std::string::npos && ::access(o.python.c_str(), X_OK) != 0)
    return {false, fmt::format("the Python {} does not exist or is not executable (--python)", o.python)};
  if (!std::filesystem::exists(o.plot_script))
    return {false, fmt::format("the plot script {} does not exist (--plot-script)", o.plot_script)};
  std::FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {false, fmt::format("cannot start `{}`: {}", cmd, errno_text(errno))};
  std::string output;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) output.append(buf, n);
  const int status = ::pclose(p);
  if (status == 0 && std::filesystem::exists(png)) return {true, {}};
  std::string why = output.find("matplotlib is needed") != std::string::npos ? "matplotlib is not installed"
                    : (WIFEXITED(status) && WEXITSTATUS(status) == 127) ? "the Python could not be run"
                                                                         : "the plot script failed";
  // The script's last lines say what went wrong.
  std::string tail = output.size() > 1500 ? output.substr(output.size() - 1500) : output;
  while (!tail.empty() && tail.back() == '\n') tail.pop_back();
  return {false, fmt::format("{} (exit status {}):\n{}", why, status, tail)};
}

int run(Options& o) {
  namespace fs = std::filesystem;
  STRIDER_CHECK(o.steps >= 1, "--steps {}: profile at least 1 measured step", o.steps);
  check_single_process("profile");
  check_output_dir(o.out, "--out");  // before the run, not after it
  std::FILE* log = o.json ? stderr : stdout;  // --json: stdout holds the one JSON object
  TrainingRun tr = make_training_run(o.train, "profile", o.skip_steps + o.steps, log);
  Engine& engine = *tr.engine;
  const EngineConfig& cfg = engine.config();
  const int64_t tokens = cfg.batch() * cfg.seq;

  const double params = double(tr.spec.param_count());
  std::vector<int64_t> ids(static_cast<size_t>(tokens)), labels(ids.size());
  std::vector<int64_t> positions(tr.packed ? ids.size() : 0);  // packed documents' (TrainingRun::packed)
  std::vector<int64_t> attention(ids.size());                   // padding's (an example-mode file's)
  std::vector<StepReport> measured;
  std::vector<ActivationTraffic> measured_traffic;
  std::vector<DeviceLanes> pool(size_t(engine.devices() > 1 ? engine.devices() : 0));
  nlohmann::json per_step = nlohmann::json::array();
  size_t spans_seen = 0;
  for (int64_t i = 0; i < o.skip_steps + o.steps; ++i) {
    const bool padded = tr.loader->next(ids, labels, positions, attention);
    StepReport r = engine.step(ids.data(), labels.data(), tr.packed ? positions.data() : nullptr,
                               padded ? attention.data() : nullptr);
    // The step's device spans are in the timeline once step() returns (the
    // timeline only grows here: nothing calls forget_before).
    const std::vector<Span> spans = engine.timeline().spans();
    const ActivationTraffic act = activation_traffic(spans, spans_seen);
    const bool timed = i >= o.skip_steps;
    if (timed) add_device_lanes(spans, spans_seen, pool);
    spans_seen = spans.size();
    fmt::print(log, "step {:>3} {} | loss {:.4f} | {:.3f} s | {:>7.0f} tok/s | overlap {:.2f} (critical: {})\n",
               r.step, timed ? "measured" : "untimed ", r.loss, r.step_s, r.tokens_per_s,
               r.stats.overlap_efficiency, lane_name(r.stats.critical));
    fmt::print(log, "             | h2d {} ({:.2f} B/param) | d2h {} ({:.2f} B/param) | ATen working memory {}{}\n",
               format_bytes(r.h2d_bytes), double(r.h2d_bytes) / params, format_bytes(r.d2h_bytes),
               double(r.d2h_bytes) / params, format_bytes(r.work_peak_bytes),
               engine.simulated() ? " (not simulated)" : "");
    if (!cfg.saved_blocks.empty())
      fmt::print(log, "             | of which kept activations: d2h {} ({:.4f} s busy), h2d {} ({:.4f} s busy)\n",
                 format_bytes(act.d2h_bytes), act.d2h_busy_s, format_bytes(act.h2d_bytes), act.h2d_busy_s);
    std::fflush(log);
    if (!timed) continue;
    measured.push_back(r);
    measured_traffic.push_back(act);
    per_step.push_back({{"step", r.step}, {"step_s", r.step_s}, {"loss", r.loss},
                        {"overlap_efficiency", r.stats.overlap_efficiency}, {"h2d_bytes", r.h2d_bytes},
                        {"d2h_bytes", r.d2h_bytes}, {"h2d_bytes_per_param", double(r.h2d_bytes) / params},
                        {"d2h_bytes_per_param", double(r.d2h_bytes) / params},
                        {"work_peak_bytes", r.work_peak_bytes}, {"activations", act.to_json()}});
  }
  engine.finish_updates();

  // The measured steps together: busy time per lane over their summed time.
  double total_s = 0;
  std::array<double, kNumLanes> busy_s{};
  uint64_t work_peak = 0;
  for (const StepReport& r : measured) {
    total_s += r.step_s;
    work_peak = std::max(work_peak, r.work_peak_bytes);
    for (int l = 0; l < kNumLanes; ++l) busy_s[size_t(l)] += r.stats.lanes[size_t(l)].busy_s;
  }
  const double n = double(measured.size());
  const double step_s = total_s / n;
  int critical = 0;
  for (int l = 1; l < kNumLanes; ++l)
    if (busy_s[size_t(l)] > busy_s[size_t(critical)]) critical = l;
  const double overlap = total_s > 0 ? busy_s[size_t(critical)] / total_s : 0.0;
  const StepFlops flops = step_flops(tr.spec, cfg);
  // The kept activations' traffic, per step: the mean over the measured steps.
  ActivationTraffic activations;
  for (const ActivationTraffic& t : measured_traffic) {
    activations.d2h_bytes += t.d2h_bytes;
    activations.h2d_bytes += t.h2d_bytes;
    activations.d2h_busy_s += t.d2h_busy_s / n;
    activations.h2d_busy_s += t.h2d_busy_s / n;
  }
  activations.d2h_bytes = uint64_t(double(activations.d2h_bytes) / n);
  activations.h2d_bytes = uint64_t(double(activations.h2d_bytes) / n);

  nlohmann::json out = {{"command", "profile"},
                        {"model", tr.spec.summary()},
                        {"device", engine.device().name()},
                        {"simulated", engine.simulated()},
                        {"seq", cfg.seq},
                        {"micro_batch", cfg.micro_batch},
                        {"accumulation", cfg.accumulation},
                        {"window", cfg.window},
                        {"checkpoints_on_host", cfg.checkpoints_on_host},
                        {"skip_steps", o.skip_steps},
                        {"steps", o.steps},
                        {"step_s", step_s},
                        {"tokens_per_step", tokens},
                        {"tokens_per_s", double(tokens) / step_s},
                        {"critical_lane", std::string(lane_name(Lane(critical)))},
                        {"overlap_efficiency", overlap},
                        {"params", tr.spec.param_count()},
                        {"six_n_t_flops_per_step", flops.six_n_t},
                        {"executed_flops_per_step", flops.executed},
                        {"model_flops_per_s", flops.six_n_t / step_s},
                        {"executed_flops_per_s", flops.executed / step_s},
                        {"h2d_bytes_per_step", measured.back().h2d_bytes},
                        {"d2h_bytes_per_step", measured.back().d2h_bytes},
                        {"work_peak_bytes", work_peak},
                        {"saved_layers", int64_t(cfg.saved_blocks.size())},
                        {"saved_blocks", cfg.saved_blocks},
                        {"activations_mode", o.train.activations},
                        {"activations", activations.to_json()},
                        {"per_step", per_step}};
  for (int l = 0; l < kNumLanes; ++l)
    out["lanes"][std::string(lane_name(Lane(l)))] = {{"busy_s", busy_s[size_t(l)] / n},
                                                     {"busy_fraction", busy_s[size_t(l)] / total_s}};
  std::string on = engine.device().name();
  for (int d = 1; d < engine.devices(); ++d) on += ", " + engine.device(d).name();
  for (size_t d = 0; d < pool.size(); ++d) {
    const DeviceLanes& x = pool[d];
    out["pool"].push_back({{"device", engine.device(int(d)).name()}, {"compute_busy_s", x.compute_s / n},
                           {"h2d_busy_s", x.h2d_s / n}, {"d2h_busy_s", x.d2h_s / n},
                           {"hand_out_busy_s", x.hand_out_s / n}, {"hand_in_busy_s", x.hand_in_s / n},
                           {"hand_out_bytes", uint64_t(double(x.hand_out_bytes) / n)},
                           {"hand_in_bytes", uint64_t(double(x.hand_in_bytes) / n)}});
  }

  fmt::print(log, "profile: {} measured steps after {} untimed, on {}; batch {} x seq {} (micro-batch {} x {}), K {}, "
                  "checkpoints on {}\n",
             o.steps, o.skip_steps, on, cfg.batch(), cfg.seq, cfg.micro_batch, cfg.accumulation,
             cfg.window, cfg.checkpoints_on_host ? "host" : "device");
  fmt::print(log, "  step time {:.4f} s, {:.0f} tokens/s{}\n", step_s, double(tokens) / step_s,
             engine.simulated() ? " (virtual time: a simulated device)" : "");
  for (int l = 0; l < kNumLanes; ++l) {
    fmt::print(log, "  {:>10}: busy {:.4f} s per step, {:5.1f}% of the step{}\n", lane_name(Lane(l)),
               busy_s[size_t(l)] / n, 100.0 * busy_s[size_t(l)] / total_s, l == critical ? "  <- critical" : "");
    if (Lane(l) == Lane::kH2D || Lane(l) == Lane::kD2H) {
      const bool in = Lane(l) == Lane::kH2D;
      const double act_s = in ? activations.h2d_busy_s : activations.d2h_busy_s;
      if (!cfg.saved_blocks.empty())
        fmt::print(log, "  {:>10}  of which kept activations: {:.4f} s, {} per step ({} layers)\n", "", act_s,
                   format_bytes(in ? activations.h2d_bytes : activations.d2h_bytes), cfg.saved_blocks.size());
    }
  }
  for (size_t d = 0; d < pool.size(); ++d) {
    const DeviceLanes& x = pool[d];
    fmt::print(log, "  device {} ({}): compute {:.4f} s, h2d {:.4f} s, d2h {:.4f} s per step; hand-offs out {} "
                    "({:.4f} s), in {} ({:.4f} s)\n",
               d, engine.device(int(d)).name(), x.compute_s / n, x.h2d_s / n, x.d2h_s / n,
               format_bytes(uint64_t(double(x.hand_out_bytes) / n)), x.hand_out_s / n,
               format_bytes(uint64_t(double(x.hand_in_bytes) / n)), x.hand_in_s / n);
  }
  fmt::print(log, "  critical lane: {}\n  overlap efficiency: {:.3f} (busiest lane / step time; 1.0: all else hidden)\n",
             lane_name(Lane(critical)), overlap);
  fmt::print(log, "  model FLOP/s (6·N·tokens, N = {:.4g} parameters): {:.4g} GFLOP/s ({:.4g} GFLOP per step)\n",
             double(tr.spec.param_count()), flops.six_n_t / step_s * 1e-9, flops.six_n_t * 1e-9);
  fmt::print(log, "  executed FLOP/s (forward + recompute + backward): {:.4g} GFLOP/s ({:.4g} GFLOP per step){}\n",
             flops.executed / step_s * 1e-9, flops.executed * 1e-9,
             cfg.saved_blocks.empty() ? ""
                                      : fmt::format("; {} of {} layers keep their activations and recompute "
                                                    "no matmul and no attention core",
                                                    cfg.saved_blocks.size(), tr.spec.layers));
  fmt::print(log, "  moved per step: h2d {} ({:.2f} B/param), d2h {} ({:.2f} B/param)\n",
             format_bytes(measured.back().h2d_bytes), double(measured.back().h2d_bytes) / params,
             format_bytes(measured.back().d2h_bytes), double(measured.back().d2h_bytes) / params);
  fmt::print(log, "  ATen working memory: {} at most in one compute op (the plan estimated {})\n",
             format_bytes(work_peak), format_bytes(tr.plan.device_work_bytes));

  // The trace, and the PNG of the last measured step.
  fs::create_directories(o.out);
  const std::string trace = (fs::path(o.out) / "trace.json").string();
  engine.timeline().write_chrome_trace(trace);
  out["trace"] = trace;
  fmt::print(log, "  trace: {} (open in https://ui.perfetto.dev)\n", trace);
  out["png"] = nullptr;
  if (!o.no_png) {
    const int64_t png_step = measured.back().step;
    const std::string png = (fs::path(o.out) / fmt::format("step{}.png", png_step)).string();
    std::string cmd;
    PlotResult pr = draw_png(o, trace, png, png_step, tr.spec, tokens, &cmd);
    out["png_step"] = png_step;
    if (pr.ok) {
      out["png"] = png;
      fmt::print(log, "  png: {} (step {})\n", png, png_step);
    } else {
      out["png_error"] = pr.message;
      fmt::print(log, "  no png: {}\n  draw it with:\n    {}\n  (matplotlib: .venv/bin/pip install -r requirements.txt)\n",
                 pr.message, cmd);
    }
  }
  if (o.json) fmt::print("{}\n", out.dump());
  return 0;
}

}  // namespace

std::function<int()> add_profile(CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* c = app.add_subcommand(
      "profile", "run a few steps and show where the time goes: busy time per lane, the critical lane, overlap "
                 "efficiency, FLOP/s; writes the Chrome trace and a PNG of one step");
  add_model_options(*c, o->train);
  add_placement_options(*c, o->train);
  c->add_option("--skip-steps", o->skip_steps, "untimed steps first (the pipeline fills, allocators warm up)")
      ->capture_default_str()
      ->check(in_range<int64_t>(0, 1000000));
  c->add_option("--steps", o->steps, "measured steps")->capture_default_str()->check(in_range<int64_t>(1, 1000000));
  add_optimizer_options(*c, o->train);
  add_work_dir_option(*c, o->train);
  c->add_option("--out", o->out, "folder for trace.json and step<N>.png")->capture_default_str();
  c->add_option("--python", o->python, "Python with matplotlib that draws the PNG")->capture_default_str();
  c->add_option("--plot-script", o->plot_script, "bench/profile_plot.py")->capture_default_str();
  c->add_flag("--no-png", o->no_png, "write the trace only");
  c->add_flag("--json", o->json, "print one JSON object with the figures (the rest goes to stderr)");
  return [o] { return run(*o); };
}

}  // namespace strider::cli
