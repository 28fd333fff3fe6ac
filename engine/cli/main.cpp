// strider: full-parameter fine-tuning of models larger than the GPU.
//   strider finetune [options]   (with no options: the built-in demo on the CPU device)
//   strider plan [options]       what fits, where, and why
//   strider profile [options]    a few steps: per-lane busy time, overlap, FLOP/s, a timeline PNG
#include <fmt/format.h>

#include "engine/cli/cli.h"
#include "host/error.h"

int main(int argc, char** argv) {
  CLI::App app{"strider: fine-tune every parameter of a model larger than the GPU, with the GPU as a "
               "sliding window over the model's blocks"};
  app.require_subcommand(0, 1);
  strider::cli::add_config_file(app);
  auto finetune = strider::cli::add_finetune(app);
  auto plan = strider::cli::add_plan(app);
  auto profile = strider::cli::add_profile(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ConfigError& e) {  // a --config file that is not TOML (INI), or a key that is no option
    const std::string command = app.get_subcommands().empty() ? "finetune" : app.get_subcommands().front()->get_name();
    const std::string file = app.get_config_ptr()->as<std::string>();
    const std::string what = e.what();
    const std::string lead = "INI was not able to parse " + command + ".";
    if (what.rfind(lead, 0) != 0) {
      fmt::print(stderr, "strider: --config {}: {}\n", file, what);
      return e.get_exit_code();
    }
    fmt::print(stderr,
               "strider: --config {}: '{}' is not an option of 'strider {}'; a key is an option's long name without the "
               "dashes (device-budget = \"20GiB\", not device_budget), and 'strider {} --help' lists them\n",
               file, what.substr(lead.size()), command, command);
    return e.get_exit_code();
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (app.got_subcommand("plan")) return plan();
    if (app.got_subcommand("profile")) return profile();
    return finetune();  // also the default with no subcommand
  } catch (const strider::Error& e) {
    fmt::print(stderr, "strider: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "strider: {}\n", e.what());
    return 2;
  }
}
