// The `strider` command line: subcommands share this header.
#pragma once

#include <CLI/CLI.hpp>

namespace strider::cli {

// Each registers its subcommand; the returned callback runs it (exit code).
std::function<int()> add_finetune(CLI::App& app);
std::function<int()> add_plan(CLI::App& app);
std::function<int()> add_profile(CLI::App& app);

}  // namespace strider::cli
