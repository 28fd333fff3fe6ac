// What a training run says about each step: a plain line per step (loss, lr,
// norm, speed, progress and ETA) on stdout and a JSON line in --metrics; on a
// terminal also a progress bar under the lines, redrawn after each step.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "engine/run/engine.h"

namespace strider::cli {

class StepLog {
 public:
  // Steps [start_step, total_steps) are this run's. `metrics`: the open
  // --metrics file or nullptr. `bar`: draw the progress bar (stdout is a
  // terminal and this rank prints).
  StepLog(int64_t start_step, int64_t total_steps, std::ofstream* metrics, std::string metrics_path, bool bar);
  ~StepLog();  // clears the bar
  StepLog(const StepLog&) = delete;
  StepLog& operator=(const StepLog&) = delete;

  // A trained step: prints its line and returns its metrics line, for the
  // caller to add to (an evaluation) and append().
  nlohmann::json trained(const StepReport& r);
  // A skipped step: prints `text` after its number and appends `metrics_line`.
  void skipped(int64_t step, std::string_view text, const nlohmann::json& metrics_line);
  void append(const nlohmann::json& metrics_line);
  // Any other line of the loop (an evaluation, a checkpoint), above the bar.
  void note(std::string_view line);
  // Erases the bar (before output that does not go through note()).
  void clear();

  // "1h02m", "3m05s", "12s": what the ETA says.
  static std::string duration_text(double seconds);

 private:
  void draw(int64_t step);
  std::string eta(int64_t step) const;

  int64_t start_step_, total_;
  std::ofstream* metrics_;
  std::string metrics_path_;
  bool bar_;
  bool drawn_ = false;
  int64_t last_step_ = 0;  // the bar's step
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace strider::cli
