#include "tests/catch_torch.h"

#include <nlohmann/json.hpp>

#include "engine/builtin.h"
#include "engine/engine.h"
#include "engine/plan.h"
#include "host/error.h"

using namespace strider;

TEST_CASE("the plan counts exactly what the engine allocates on the device", "[engine][plan]") {
  ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  for (auto place : {CheckpointPlace::kDevice, CheckpointPlace::kHost}) {
    PlanLimits l{.device_bytes = 64ull << 20, .seq = 32, .micro_batch = 2, .accumulation = 2, .checkpoints = place};
    Plan p = Plan::make(spec, l);
    REQUIRE(p.feasible);
    CHECK(p.checkpoints_on_host == (place == CheckpointPlace::kHost));
    Engine e(spec, p.engine_config(l), make_device({.spec = "cpu", .budget_bytes = l.device_bytes}));
    CHECK(e.device().allocated_bytes() == p.device_buffer_bytes);
    CHECK(e.arena_bytes() >= p.host_bytes);
    CHECK(p.device_peak_bytes <= l.device_bytes);
  }
}

TEST_CASE("an impossible budget is refused before allocation, with the number needed", "[engine][plan]") {
  ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  PlanLimits l{.device_bytes = 4ull << 20, .seq = 128, .micro_batch = 4};
  Plan p = Plan::make(spec, l);
  CHECK_FALSE(p.feasible);
  CHECK_THAT(p.reason, Catch::Contains("needs") && Catch::Contains("K=2") && Catch::Contains("micro-batch 4") &&
                           Catch::Contains("budget is 4.0 MiB"));
  // The number it names is enough.
  const std::string need = p.reason.substr(p.reason.find("needs ") + 6);
  l.device_bytes = parse_bytes(need.substr(0, need.find(" of")).erase(need.find(' '), 1)) + (1 << 20);
  CHECK(Plan::make(spec, l).feasible);
}

TEST_CASE("host RAM short: state goes to NVMe when there is one, else refused with the reason", "[engine][plan]") {
  ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  PlanLimits l{.device_bytes = 64ull << 20, .host_bytes = 60ull << 20, .seq = 32};
  Plan refused = Plan::make(spec, l);
  CHECK_FALSE(refused.feasible);
  CHECK_THAT(refused.reason, Catch::Contains("host RAM") && Catch::Contains("--nvme"));
  l.nvme_dir = "/tmp";
  Plan p = Plan::make(spec, l);
  REQUIRE(p.feasible);
  CHECK_FALSE(p.nvme_blocks.empty());
  CHECK(p.host_bytes <= l.host_bytes);
  CHECK(p.nvme_bytes > 0);
}

TEST_CASE("sizes parse with binary and decimal units and name bad text", "[engine][plan]") {
  CHECK(parse_bytes("24GiB") == 24ull << 30);
  CHECK(parse_bytes("512 MiB") == 512ull << 20);
  CHECK(parse_bytes("1.5GB") == 1'500'000'000ull);
  CHECK(parse_bytes("4096") == 4096);
  CHECK_THROWS_WITH(parse_bytes("lots"), Catch::Contains("'lots'"));
  CHECK_THROWS_WITH(parse_bytes("3 parsecs"), Catch::Contains("parsecs"));
}
