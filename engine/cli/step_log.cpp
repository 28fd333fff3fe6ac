#include "engine/cli/step_log.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "engine/cli/run_outputs.h"
#include "engine/plan/plan.h"  // format_bytes
#include "engine/program/timeline.h"

namespace strider::cli {

StepLog::StepLog(int64_t start_step, int64_t total_steps, std::ofstream* metrics, std::string metrics_path, bool bar)
    : start_step_(start_step), total_(total_steps), metrics_(metrics), metrics_path_(std::move(metrics_path)),
      bar_(bar) {}

StepLog::~StepLog() { clear(); }

std::string StepLog::duration_text(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto t = int64_t(std::llround(s));
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, t % 3600 / 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

// From this run's steps so far (a resumed run's earlier steps took no time here).
std::string StepLog::eta(int64_t step) const {
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const int64_t done = step - start_step_;
  if (done <= 0) return "?";
  return duration_text(elapsed / double(done) * double(total_ - step));
}

nlohmann::json StepLog::trained(const StepReport& r) {
  clear();
  // A preference objective's two figures a user watches (every one of TRL's names is in the metrics line).
  std::string pairs;
  for (const auto& [name, value] : r.metrics)
    if (name == "rewards/accuracies" || name == "rewards/margins")
      pairs += fmt::format(" | {} {:.3f}", name == "rewards/accuracies" ? "accuracy" : "margin", value);
  fmt::print("step {:>4}/{} | loss {:.4f}{} | lr {:.2e} | norm {:.3f}{} | {:>7.0f} tok/s | {:.3f} s | overlap {:.2f} "
             "(critical: {}) | peak dev {} | ETA {}\n",
             r.step, total_, r.loss, pairs, r.lr, r.grad_norm,
             r.loss_scale > 0 ? fmt::format(" | scale {:g}", r.loss_scale) : std::string(), r.tokens_per_s, r.step_s,
             r.stats.overlap_efficiency, lane_name(r.stats.critical), format_bytes(r.peak_device_bytes), eta(r.step));
  draw(r.step);
  nlohmann::json lanes;
  for (int l = 0; l < kNumLanes; ++l) lanes[std::string(lane_name(Lane(l)))] = r.stats.lanes[size_t(l)].busy_fraction;
  nlohmann::json line = {{"step", r.step}, {"loss", r.loss}, {"lr", r.lr}, {"grad_norm", r.grad_norm},
                         {"tokens_per_s", r.tokens_per_s}, {"step_s", r.step_s},
                         {"overlap_efficiency", r.stats.overlap_efficiency}, {"lanes", lanes},
                         {"peak_device_bytes", r.peak_device_bytes}, {"h2d_bytes", r.h2d_bytes},
                         {"d2h_bytes", r.d2h_bytes}, {"work_peak_bytes", r.work_peak_bytes}};
  if (r.loss_scale > 0) line["loss_scale"] = r.loss_scale;  // fp16
  for (const auto& [name, value] : r.metrics) line[name] = value;  // an objective's, under TRL's names
  return line;
}

void StepLog::skipped(int64_t step, std::string_view text, const nlohmann::json& metrics_line) {
  clear();
  fmt::print("step {:>4}/{} skipped: {}\n", step, total_, text);
  draw(step);
  append(metrics_line);
}

void StepLog::append(const nlohmann::json& metrics_line) {
  if (metrics_ != nullptr && metrics_->is_open()) append_line(*metrics_, metrics_path_, metrics_line);
}

void StepLog::note(std::string_view line) {
  const bool was = drawn_;
  clear();
  fmt::print("{}\n", line);
  if (was) draw(last_step_);
  std::fflush(stdout);
}

void StepLog::clear() {
  if (!drawn_) return;
  fmt::print("\r\033[K");  // back to the line's start, erase it
  drawn_ = false;
}

// Written by hand: a bar is one line of text, and no Debian-packaged library
// draws one for C++ (indicators and the like are not packaged).
void StepLog::draw(int64_t step) {
  if (bar_) {
    constexpr int kWidth = 30;
    const double f = total_ > 0 ? std::clamp(double(step) / double(total_), 0.0, 1.0) : 1.0;
    const int full = int(f * kWidth);
    fmt::print("[{}{}] {}/{} {:.0f}% | ETA {}", std::string(size_t(full), '#'), std::string(size_t(kWidth - full), '.'),
               step, total_, f * 100, eta(step));
    drawn_ = true;
    last_step_ = step;
  }
  std::fflush(stdout);
}

}  // namespace strider::cli
