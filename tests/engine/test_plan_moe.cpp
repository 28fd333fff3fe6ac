// The plan for mixtures of experts: one that does not fit with whole layers
// as pieces (even with their compute copies on NVMe) gets its experts cut
// into pieces of their own (Plan::make), said in its lines and JSON and
// carried into the engine's configuration; a size the limits name stays;
// where nothing cut fits, the refusal is the whole-layer one.
#include "tests/catch_torch.h"

#include <nlohmann/json.hpp>

#include "engine/model_presets.h"
#include "engine/plan.h"

using namespace strider;

namespace {

PlanLimits workstation(uint64_t ram_gib) {
  PlanLimits l{.device_bytes = 24ull << 30, .host_bytes = ram_gib << 30, .seq = 1024, .accumulation = 32};
  l.nvme_dir = "/tmp/strider-plan-moe";  // the plan only names it
  l.optimizer_state = StateFormat::kQ8;
  l.clip_norm = 1.0;
  return l;
}

}  // namespace

TEST_CASE("a mixture of experts that does not fit with whole layers gets one expert per piece",
          "[engine][plan][moe]") {
  const ModelSpec mixtral = ModelSpec::from_json(model_preset("mixtral-8x7b"), "mixtral-8x7b");
  // On 128 GiB whole layers fit with some layers' compute copies on NVMe too.
  const Plan on_nvme = Plan::make(mixtral, workstation(128));
  REQUIRE(on_nvme.feasible);
  CHECK(on_nvme.expert_pieces == 0);
  CHECK_FALSE(on_nvme.nvme_compute_blocks.empty());
  // On 40 GiB whole layers do not fit even so: their ring slots, NVMe and
  // load staging hold a whole layer each.
  PlanLimits l = workstation(40);
  const Plan p = Plan::make(mixtral, l);
  INFO(p.reason);
  REQUIRE(p.feasible);
  CHECK(p.expert_pieces == 1);
  CHECK(p.engine_config(l).expert_pieces == 1);
  CHECK(p.to_json()["expert_pieces"] == 1);
  CHECK_THAT(p.explain(), Catch::Contains("one expert per piece (chosen: with whole layers the plan needs") &&
                              Catch::Contains("pinned host RAM"));
  // The whole-layer plan is what the limits gave it: refused for RAM.
  l.expert_pieces = 8;
  const Plan whole = Plan::make(mixtral, l);
  CHECK_FALSE(whole.feasible);
  CHECK_THAT(whole.reason, Catch::Contains("pinned host RAM"));
  // A size the limits name stays, fitting or not.
  l.expert_pieces = 2;
  const Plan two = Plan::make(mixtral, l);
  REQUIRE(two.feasible);
  CHECK(two.expert_pieces == 2);
  // Where whole layers fit, they stay whole.
  const Plan roomy = Plan::make(mixtral, workstation(256));
  REQUIRE(roomy.feasible);
  CHECK(roomy.expert_pieces == 0);
  CHECK_THAT(roomy.explain(), !Catch::Contains("expert per piece"));
}

TEST_CASE("a mixture of experts whose layer does not fit the device is cut into groups of experts, each a visit",
          "[engine][plan][moe]") {
  // Qwen3-235B-A22B: a layer's unit (13.90 GiB) twice does not fit 24 GiB;
  // cutting experts into pieces within the layer's visit shrinks no unit,
  // groups of experts that are visits of their own do.
  const ModelSpec big = ModelSpec::from_json(model_preset("qwen3-235b-a22b"), "qwen3-235b-a22b");
  const PlanLimits l = workstation(512);
  const Plan p = Plan::make(big, l);
  REQUIRE(p.feasible);
  CHECK(p.expert_pieces == 0);
  CHECK(p.mlp_pieces >= 2);
  CHECK(p.engine_config(l).mlp_pieces == p.mlp_pieces);
  bool said = false;  // and why: whole layers' units
  for (const std::string& w : p.why)
    said = said || (w.find("groups of its experts") != std::string::npos && w.find("of device memory") != std::string::npos);
  CHECK(said);
}
