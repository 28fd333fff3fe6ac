// The configuration's one declaration (engine/config/config_fields.json) against the
// engine config JSON that the CLI, the Python package and every checkpoint
// use: the same fields, the declaration's defaults, its checks.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>
#include <set>

#include "engine/config/config_fields.h"
#include "engine/config/engine_config_json.h"
#include "engine/config/objective_config.h"
#include "host/error.h"

using namespace strider;

TEST_CASE("the engine config JSON holds exactly the declaration's engine fields", "[engine][config]") {
  std::set<std::string> declared, written;
  for (const ConfigField& f : config_fields())
    if (f.engine) declared.insert(f.name);
  const nlohmann::json j = engine_config_to_json(EngineConfig{});
  for (const auto& [key, value] : j.items()) written.insert(key);
  CHECK(declared == written);
}

TEST_CASE("a field left out of the engine config JSON takes the declaration's default", "[engine][config]") {
  const nlohmann::json back = engine_config_to_json(engine_config_from_json(nlohmann::json::object()));
  for (const ConfigField& f : config_fields()) {
    if (!f.engine) continue;
    INFO(f.name);
    if (f.default_value.is_number()) CHECK(back[f.name].get<double>() == f.default_value.get<double>());
    else CHECK(back[f.name] == f.default_value);
  }
  // The fine-tuning defaults, not the demo's (which only the built-in model takes).
  CHECK(back["lr"].get<double>() == 1e-5);
  CHECK(back["schedule"] == "constant");
}

TEST_CASE("the engine config JSON refuses a bad value naming the field and what it takes", "[engine][config]") {
  auto refused = [](nlohmann::json j) {
    try {
      engine_config_from_json(j);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  CHECK_THAT(refused({{"seq", 0}}), Catch::Contains("'seq' = 0 is outside [1, 16777216]"));
  CHECK_THAT(refused({{"seq", 2.5}}), Catch::Contains("'seq' = 2.5 is not an integer"));
  CHECK_THAT(refused({{"dtype", "fp8"}}), Catch::Contains("'dtype' = 'fp8' is not bf16, fp16 or fp32"));
  CHECK(refused({{"dtype", "fp16"}}) == "accepted");
  CHECK_THAT(refused({{"beta2", 1.0}}), Catch::Contains("'beta2' = 1.0 is outside [0, 1)"));
  CHECK_THAT(refused({{"eps", 0}}), Catch::Contains("'eps' = 0 is outside (0, 1]"));
  CHECK_THAT(refused({{"lr", "fast"}}), Catch::Contains("'lr' = 'fast' is not a number"));
  CHECK_THAT(refused({{"nvme_blocks", {1, -2}}}), Catch::Contains("holds -2, which is outside [0, inf]"));
  CHECK_THAT(refused({{"checkpoints_on_host", 1}}), Catch::Contains("is not true or false"));
  CHECK_THAT(refused({{"device", "cpu"}}), Catch::Contains("unknown field 'device'"));  // chosen per run
  CHECK(refused({{"lr", 1}}) == "accepted");  // an integer is a number
}

TEST_CASE("the declaration's flags are distinct, and the demo's values are its fields' own", "[engine][config]") {
  std::set<std::string> flags;
  for (const ConfigField& f : config_fields()) {
    if (f.flag.empty()) continue;
    CHECK(f.flag.rfind("--", 0) == 0);
    CHECK(flags.insert(f.flag).second);
  }
  const DemoValues& demo = demo_values();
  CHECK_FALSE(demo.why.empty());
  for (const nlohmann::json* values : {&demo.values, &demo.cpu_values})
    for (const auto& [name, value] : values->items()) {
      const ConfigField& f = config_field(name);
      CHECK_FALSE(f.flag.empty());  // the command line applies them
      CHECK(config_value_problem(f, value).empty());
    }
  CHECK_THROWS_WITH(config_field("learning_rate"), Catch::Contains("'learning_rate'"));
}

TEST_CASE("a size field takes sizes, bytes and its words", "[engine][config]") {
  const ConfigField& f = config_field("device_budget");
  CHECK(config_value_problem(f, "auto").empty());
  CHECK(config_value_problem(f, "20GiB").empty());
  CHECK(config_value_problem(f, 1 << 20).empty());
  CHECK_THAT(config_value_problem(f, -1), Catch::Contains("negative"));
  CHECK_THAT(config_value_problem(f, "3 parsecs"), Catch::Contains("parsecs"));
}

TEST_CASE("an objective resolves to TRL's defaults, and a config that skipped its rules is refused by name",
          "[engine][config]") {
  ObjectiveConfig c;
  CHECK(c.resolve().sft());
  c.objective = "grpo";
  const ObjectiveSettings g = c.resolve();
  CHECK((g.loss == ObjectiveLoss::kDapo && g.beta == 0.0 && g.epsilon == 0.2 && g.epsilon_high == 0.2));
  c.objective = "dpo";
  const ObjectiveSettings d = c.resolve();
  CHECK((d.loss == ObjectiveLoss::kSigmoid && d.beta == 0.1 && d.pairs() && d.takes_rows()));
  // Made in C++ without engine_config_from_json's checks: refused, never resolved to another loss.
  c.loss_type = "dapo";
  CHECK_THROWS_WITH(c.resolve(), Catch::Contains("loss_type 'dapo' with objective dpo"));
  c.loss_type = "nonsense";
  CHECK_THROWS_WITH(c.resolve(), Catch::Contains("loss_type 'nonsense'"));
  c.objective = "kto";
  CHECK_THROWS_WITH(c.resolve(), Catch::Contains("objective 'kto': one of sft, dpo, simpo, orpo, grpo"));
}
