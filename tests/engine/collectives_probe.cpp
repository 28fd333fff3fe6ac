// collectives_probe: the C++ side of tests/python/test_collectives_torchrun.py.
// Under torchrun (`torchrun --nproc-per-node N --no-python collectives_probe`)
// it joins the ranks from the environment, runs a sum, a reduce-scatter and a
// decision, and prints one JSON line per rank. --leave-at K: the last rank
// SIGKILLs itself before its K-th collective, so the others must name it.
#include <csignal>
#include <cstdio>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "engine/run/collectives.h"

int main(int argc, char** argv) {
  CLI::App app{"collectives_probe"};
  int leave_at = 0, timeout_ms = 20000;
  app.add_option("--leave-at", leave_at, "the last rank dies before this collective (1-based; 0: never)");
  app.add_option("--timeout-ms", timeout_ms, "every collective's timeout");
  CLI11_PARSE(app, argc, argv);
  try {
    auto c = strider::collectives_from_env(std::chrono::milliseconds(timeout_ms));
    const strider::RankInfo& r = c->ranks();
    int n = 0;
    auto step = [&] {
      if (++n == leave_at && r.rank == r.world - 1) std::raise(SIGKILL);
    };
    const double vals[] = {1e16, 1.0, -1e16, 0.25};
    std::vector<double> x{vals[r.rank % 4], 0.1 * (r.rank + 1)};
    step();
    c->all_reduce_sum(x);
    std::vector<float> in(3 * r.world), out(3);
    for (size_t i = 0; i < in.size(); ++i) in[i] = float((r.rank + 1) * 100 + i);
    step();
    c->reduce_scatter_sum(in, out);
    step();
    const bool any = c->any(r.rank == 0);
    nlohmann::json j = {{"rank", r.rank}, {"world", r.world}, {"local_rank", r.local_rank},
                        {"local_world", r.local_world}, {"sum", x}, {"slice", out}, {"any", any}};
    std::printf("%s\n", j.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "collectives_probe: %s\n", e.what());
    return 1;
  }
}
