// What a training run writes, checked before the first step, and how it is
// asked to stop. A run must not train for hours and then find that it cannot
// write its result, nor replace something that is not its own file.
#pragma once

#include <csignal>
#include <fstream>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace strider::cli {

// A path a run reads or writes, and the option that gave it.
struct RunPath {
  std::string_view option;
  std::string path;
};

// Refuses, before anything is written, an output that is an input or lies
// inside one (a --trace over the base model's weights, --metrics appended to
// the token file), an output that is another output, and an output inside a
// `managed` one (--checkpoint-dir and --nvme, whose files the run prunes and
// rewrites). Paths are compared resolved (symlinks, "..", relative to the
// working directory) and, where both exist, as files (device and inode: a
// hard link is the same file). Throws Error naming both options and paths.
void check_paths_apart(const std::vector<RunPath>& inputs, const std::vector<RunPath>& outputs,
                       const std::vector<std::string_view>& managed);

// `path` (the value of `option`) is a directory this run can write into:
// created if absent (with its parents), then probed by creating and removing
// a file there. Throws Error naming the option, the path and why.
void check_output_dir(const std::string& path, std::string_view option);

// `path` is a file this run may replace or append to: absent, or a regular
// file (never a device, a FIFO or a directory), in a directory it can write
// into (created if absent). Throws Error naming the option and the path.
void check_output_file(const std::string& path, std::string_view option);

// Appends `line` to the --metrics file `path`: whole, or the run stops (a
// full disk is an error, not a silence).
void append_line(std::ofstream& metrics, const std::string& path, const nlohmann::json& line);

// Every checkpoint records the run (its data's and --config's paths, the
// --config text, the base model's path) as JSON, which holds UTF-8 only.
// Throws Error naming the first string of `record` that is not UTF-8 (by its
// key, or the option it came from), so that a path or a config with other
// bytes is refused before the first step, not found out at the first save.
void check_recordable(const nlohmann::json& record);

// The --config file `path` as a run's checkpoints record it ({"path",
// "text"}; null when none was given), saying so on stdout.
nlohmann::json config_file_record(const std::string& path);

// SIGINT and SIGTERM ask the run to stop: the first sets a flag that the
// training loop reads between steps (it finishes the step, saves and exits
// with 128 + the signal's number); a second one of either restores the
// default action and re-raises, ending the process at once. The checkpoint
// protocol (train_checkpoint.h) keeps the last checkpoint loadable even then.
// One instance at a time; the destructor restores the previous handlers.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  bool requested() const;     // a first signal came
  int signal_number() const;  // which (0 if none)
  static const char* name(int signo);  // "SIGINT", "SIGTERM"

 private:
  struct sigaction old_int_ {}, old_term_ {};
};

}  // namespace strider::cli
