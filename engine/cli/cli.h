// The `strider` command line: subcommands share this header.
#pragma once

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <string>

namespace strider::cli {

// Each registers its subcommand; the returned callback runs it (exit code).
std::function<int()> add_finetune(CLI::App& app);
std::function<int()> add_plan(CLI::App& app);
std::function<int()> add_profile(CLI::App& app);
std::function<int()> add_score(CLI::App& app);  // score.cpp: each window's log-probability, forward only

// --config FILE, given after any subcommand (engine/cli/config_file.cpp): a
// TOML file, or an INI file when its name ends in .ini, of that command's
// options, each under its long name without the dashes (seq = 1024,
// device-budget = "20GiB", decay-norms-and-biases = true). The command
// line's own options win; a key that is no option is refused (main() names
// the fix). Call on the main app before adding the subcommands; returns the
// option (its value: the file used).
CLI::Option* add_config_file(CLI::App& app);

// A CLI11 check that a number lies in [lo, hi] ((lo, hi] when `lo_open`), so
// a value out of range is refused while parsing, with the range in the
// message ("--steps: 0 is outside [1, 1e+12]"). NaN is outside every range.
template <class T>
CLI::Validator in_range(T lo, T hi, bool lo_open = false) {
  const std::string range = fmt::format("{}{}, {}]", lo_open ? "(" : "[", lo, hi);
  return CLI::Validator(
      [=](std::string& input) -> std::string {
        T v{};
        if (!CLI::detail::lexical_cast(input, v)) return fmt::format("{} is not a number", input);
        const bool above_lo = lo_open ? v > lo : v >= lo;
        if constexpr (std::is_floating_point_v<T>)
          if (!std::isfinite(v)) return fmt::format("{} is outside {}", input, range);
        return above_lo && v <= hi ? std::string() : fmt::format("{} is outside {}", input, range);
      },
      "in " + range);
}

}  // namespace strider::cli
