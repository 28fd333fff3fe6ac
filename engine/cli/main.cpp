// strider: full-parameter fine-tuning of models larger than the GPU.
//   strider finetune [options]   (with no options: the built-in demo on the CPU device)
//   strider plan [options]       what fits, where, and why
//   strider profile [options]    a few steps: per-lane busy time, overlap, FLOP/s, a timeline PNG
//   strider score [options]      each window of a token file's log-probability under a model
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <sys/resource.h>

#include "engine/cli/cli.h"
#include "host/error.h"

namespace {

// The open-file limit, before a run opens anything: the soft limit raised to
// the hard one (as Go's runtime does at start), and a run refused below a
// floor with the limit named, instead of failing midway (a checkpoint that
// cannot open its files, ATen's /dev/urandom). The built-in model with
// --nvme, --checkpoint-dir, --trace, --metrics and --eval-batches holds 14 at
// once (it trains with every checkpoint failing at 12); a model's safetensors
// shards and a pool's devices add theirs, hence the margin.
constexpr rlim_t kMinOpenFiles = 64;

void need_open_files() {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0) return;  // unknown: nothing to raise or to name
  if (r.rlim_cur < r.rlim_max) {
    rlimit raised = r;
    raised.rlim_cur = r.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) r = raised;
  }
  STRIDER_CHECK(r.rlim_cur == RLIM_INFINITY || r.rlim_cur >= kMinOpenFiles,
                "the open-file limit is {} (ulimit -n, its hard limit {}): a run holds a dozen files at once and more "
                "for a model's shards; raise it to at least {} before the run (ulimit -n 1024)",
                uint64_t(r.rlim_cur), r.rlim_max == RLIM_INFINITY ? std::string("unlimited") : std::to_string(r.rlim_max),
                uint64_t(kMinOpenFiles));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"strider: fine-tune every parameter of a model larger than the GPU, with the GPU as a "
               "sliding window over the model's blocks"};
  app.require_subcommand(0, 1);
  strider::cli::add_config_file(app);
  auto finetune = strider::cli::add_finetune(app);
  auto plan = strider::cli::add_plan(app);
  auto profile = strider::cli::add_profile(app);
  auto score = strider::cli::add_score(app);
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
    need_open_files();
    if (app.got_subcommand("profile")) return profile();
    if (app.got_subcommand("score")) return score();
    return finetune();  // also the default with no subcommand
  } catch (const strider::Error& e) {
    fmt::print(stderr, "strider: {}\n", e.what());
    return 2;
  } catch (const c10::Error& e) {  // ATen's message, without its C++ backtrace
    fmt::print(stderr, "strider: {}\n", e.what_without_backtrace());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "strider: {}\n", e.what());
    return 2;
  }
}
