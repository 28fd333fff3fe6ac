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
  auto finetune = strider::cli::add_finetune(app);
  auto plan = strider::cli::add_plan(app);
  auto profile = strider::cli::add_profile(app);
  CLI11_PARSE(app, argc, argv);
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
