// The plan for mixtures of experts: one that does not fit with whole layers
// as pieces (even with their compute copies on NVMe) gets its experts cut
// into pieces of their own (Plan::make), said in its lines and JSON and
// carried into the engine's configuration; a size the limits name stays;
// where nothing cut fits, the refusal is the whole-layer one.
#include "tests/catch_torch.h"

#include <algorithm>
#include <map>

#include <nlohmann/json.hpp>

#include "engine/config/engine_config.h"
#include "engine/model/model_presets.h"
#include "engine/plan/plan.h"

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

// fastest_expert_pieces's rule, given the speeds (strider plan passes its
// simulated machine's, which tests/python/test_plan_experts.py runs): whole
// layers first, then pieces of 16, 4 and 1 expert below the expert count;
// a smaller piece replaces the best only when at least 1% faster.
TEST_CASE("a mixture of experts' pieces are chosen by their predicted speed", "[engine][plan][moe]") {
  const ModelSpec mixtral = ModelSpec::from_json(model_preset("mixtral-8x7b"), "mixtral-8x7b");
  const PlanLimits l = workstation(128);
  const Plan base = Plan::make(mixtral, l);
  REQUIRE(base.feasible);
  REQUIRE(base.expert_pieces == 0);
  const auto speeds = [](std::map<int64_t, double> by_pieces, std::vector<int64_t>* asked) {
    return [=](const Plan& p, const PlanLimits& pl) {
      CHECK(p.engine_config(pl).expert_pieces == p.expert_pieces);  // what a prediction runs
      asked->push_back(p.expert_pieces);
      return by_pieces.at(p.expert_pieces);
    };
  };
  std::vector<int64_t> asked;
  // Mixtral's 8 experts: whole layers, pieces of 4, of 1 (16 is not below 8).
  Plan p = fastest_expert_pieces(mixtral, l, base, speeds({{0, 100.0}, {4, 105.0}, {1, 105.9}}, &asked));
  CHECK(asked == std::vector<int64_t>{0, 4, 1});
  CHECK(p.expert_pieces == 4);  // 1 is not 1% faster than 4
  CHECK(p.engine_config(l).expert_pieces == 4);
  REQUIRE(p.expert_trials.size() == 3);
  CHECK(p.expert_trials[2].expert_pieces == 1);
  CHECK(p.expert_trials[2].tokens_per_s == 105.9);
  const nlohmann::json j = p.to_json();
  CHECK(j["expert_pieces"] == 4);
  CHECK(j["expert_pieces_tried"].size() == 3);
  CHECK_THAT(p.explain(), Catch::Contains("expert pieces: 4 experts per piece (chosen for speed over whole layers, "
                                          "tokens/s predicted: whole layers 100, 4 experts per piece 105, "
                                          "1 expert per piece 106") &&
                              Catch::Contains("strider finetune: --expert-pieces 4"));
  // Under 1% faster: whole layers stay.
  asked.clear();
  p = fastest_expert_pieces(mixtral, l, base, speeds({{0, 100.0}, {4, 100.5}, {1, 100.9}}, &asked));
  CHECK(p.expert_pieces == 0);
  CHECK_THAT(p.explain(), Catch::Contains("expert pieces: whole layers (the fastest") &&
                              !Catch::Contains("strider finetune:"));
  // Where whole layers do not fit (Plan::make chose one expert per piece),
  // they are not tried.
  PlanLimits small = workstation(40);
  const Plan cut = Plan::make(mixtral, small);
  REQUIRE(cut.expert_pieces == 1);
  asked.clear();
  p = fastest_expert_pieces(mixtral, small, cut, speeds({{4, 50.0}, {1, 40.0}}, &asked));
  CHECK(asked == std::vector<int64_t>{4, 1});
  CHECK(p.expert_pieces == 4);
  CHECK_THAT(p.explain(), Catch::Contains("expert pieces: 4 experts per piece (chosen for speed over 1 expert per "
                                          "piece, tokens/s predicted: 4 experts per piece 50, 1 expert per piece 40;"));
  // A size the limits name, a dense model: nothing is tried.
  asked.clear();
  PlanLimits named = l;
  named.expert_pieces = 2;
  p = fastest_expert_pieces(mixtral, named, Plan::make(mixtral, named), speeds({}, &asked));
  CHECK(p.expert_pieces == 2);
  const ModelSpec dense = ModelSpec::from_json(model_preset("llama-3.1-8b"), "llama-3.1-8b");
  p = fastest_expert_pieces(dense, l, Plan::make(dense, l), speeds({}, &asked));
  CHECK(p.expert_trials.empty());
  CHECK(asked.empty());
}
