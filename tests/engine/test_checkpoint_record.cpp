// What a training checkpoint's record of the maths compares on resume, as
// whole declared sets rather than hand-kept lists: every engine setting of
// scope "maths" in engine/config/config_fields.json (maths_changes), and
// every field the model reader takes from config.json into the ModelSpec
// (spec_differences). Each field is changed in turn.
#include "tests/catch_torch.h"

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/checkpoint/parts.h"  // spec_differences
#include "engine/checkpoint/train_checkpoint.h"
#include "engine/config/config_fields.h"
#include "engine/config/engine_config_json.h"
#include "engine/model/builtin.h"
#include "engine/model/model_presets.h"
#include "engine/model/model_spec.h"
#include "host/error.h"

using namespace strider;
using strider::train_checkpoint_parts::spec_differences;

namespace {

// Another value the declaration allows for field f, in place of v.
nlohmann::json another_value(const ConfigField& f, const nlohmann::json& v) {
  switch (f.type) {
    case FieldType::kInt: {
      const int64_t x = v.get<int64_t>();
      return f.has_max && double(x + 1) > f.max ? x - 1 : x + 1;
    }
    case FieldType::kNumber: {
      const double x = v.get<double>();
      if (x != 0) return x * 0.5;
      return f.has_max && 0.5 >= f.max ? f.max * 0.5 : 0.5;  // label_smoothing: [0, 0.5)
    }
    case FieldType::kBool: return !v.get<bool>();
    case FieldType::kChoice: return f.choices.front() == v ? f.choices.back() : f.choices.front();
    case FieldType::kText: return v.get<std::string>() + "x";
    case FieldType::kInts: {
      nlohmann::json out = v;
      out.push_back(1);
      return out;
    }
    case FieldType::kSize: return "1GiB";
  }
  return v;
}

// A run where every maths field matters: weight decay on (else whether norms
// decay is moot), the bf16 compute dtype (else the gradients travel in fp32
// whatever grad_transfer says).
nlohmann::json saved_run() {
  EngineConfig c;
  c.adam.weight_decay = 0.1;
  return engine_config_to_json(c);
}

}  // namespace

TEST_CASE("every maths setting, changed alone, is a change a resume refuses unless allowed by name",
          "[checkpoint][config]") {
  const nlohmann::json saved = saved_run();
  int maths = 0, others = 0;
  for (const ConfigField& f : config_fields()) {
    if (!f.engine) continue;
    INFO(f.name);
    nlohmann::json now = saved;
    now[f.name] = another_value(f, saved[f.name]);
    REQUIRE(config_value_problem(f, now[f.name]).empty());
    const std::vector<std::string> changes = maths_changes(saved, now, {}, "trainer_state.json");
    if (f.scope == FieldScope::kMaths) {
      ++maths;
      REQUIRE(changes.size() == 1);
      CHECK(changes[0].rfind(f.name + ": checkpoint ", 0) == 0);
      // Named in allow_changed, it is accepted, unless fixed on resume (another model: base_format).
      CHECK(maths_changes(saved, now, {f.name}, "trainer_state.json").empty() == !f.fixed_on_resume);
    } else {
      ++others;
      CHECK(changes.empty());  // placement, or the model (compared with the model: spec_differences)
    }
  }
  // The fields the hand-kept list compared before the declaration said it, and the one it missed
  // (grad_transfer: bf16 and fp32 gradient transfer are different numbers), stay maths.
  for (const char* name : {"seq", "micro_batch", "accumulation", "dtype", "vocab_chunk", "lr", "beta1", "beta2", "eps",
                           "weight_decay", "decay_norms_and_biases", "optimizer", "schedule", "warmup_steps",
                           "total_steps", "clip_norm", "optimizer_state", "packed_documents", "base_format",
                           "loss_scale_growth_interval", "matmul_accumulate", "mlp_pieces", "grad_transfer"}) {
    INFO(name);
    CHECK(config_field(name).scope == FieldScope::kMaths);
  }
  CHECK(maths >= 20);
  CHECK(others >= 10);
}

TEST_CASE("a checkpoint without a maths field means what the declaration says, or is refused naming it",
          "[checkpoint][config]") {
  const nlohmann::json now = saved_run();
  for (const ConfigField& f : config_fields()) {
    if (f.scope != FieldScope::kMaths) continue;
    INFO(f.name);
    nlohmann::json saved = now;
    saved.erase(f.name);
    if (f.absent_in_checkpoint.is_null()) {
      CHECK_THROWS_WITH(maths_changes(saved, now, {}, "trainer_state.json"),
                        Catch::Contains("trainer_state.json: engine_config has no field '" + f.name + "'"));
    } else {
      const std::vector<std::string> changes = maths_changes(saved, now, {}, "trainer_state.json");
      CHECK(changes.size() == (f.absent_in_checkpoint == now[f.name] ? 0u : 1u));
    }
  }
}

TEST_CASE("every config.json field the model reader takes, changed alone, is a model a resume refuses",
          "[checkpoint][model]") {
  for (const std::string& name : {std::string("builtin"), std::string("llama-3.1-8b"), std::string("qwen3-30b-a3b"),
                                  std::string("qwen1.5-moe-a2.7b"), std::string("mixtral-8x7b")}) {
    const nlohmann::json config = model_preset(name);
    const ModelSpec spec = ModelSpec::from_json(config, name);
    int read = 0;
    // Each field, and each of a nested object's (rope_scaling), changed to another value of its kind.
    std::vector<nlohmann::json::json_pointer> paths;
    for (const auto& [key, value] : config.items()) {
      if (value.is_object())
        for (const auto& [inner, _] : value.items()) paths.push_back(nlohmann::json::json_pointer("/" + key + "/" + inner));
      else paths.push_back(nlohmann::json::json_pointer("/" + key));
    }
    for (const auto& path : paths) {
      INFO(name << " " << path.to_string());
      const nlohmann::json& v = config[path];
      std::vector<nlohmann::json> tries;
      if (v.is_boolean()) tries = {!v.get<bool>()};
      else if (v.is_number_integer()) tries = {v.get<int64_t>() * 2, v.get<int64_t>() + 1};
      else if (v.is_number()) tries = {v.get<double>() * 0.5};
      else continue;  // names and lists: the architecture is compared by name, the lists as the layers they mark
      for (const nlohmann::json& t : tries) {
        nlohmann::json changed = config;
        changed[path] = t;
        ModelSpec other;
        try {
          other = ModelSpec::from_json(changed, name);
        } catch (const Error&) {
          continue;  // a config the reader refuses never reaches a resume
        }
        if (other == spec) {
          CHECK(spec_differences(spec, other, "checkpoint").empty());
          continue;  // a field the reader does not take (or one value it reads alike)
        }
        ++read;
        CHECK_FALSE(spec_differences(spec, other, "checkpoint").empty());
        break;
      }
    }
    INFO(name);
    CHECK(read >= 8);  // not a vacuous pass: most of a config's numbers are the model's
  }
}

TEST_CASE("a field the model reader does not take changes no model", "[checkpoint][model]") {
  nlohmann::json config = builtin_model_config();
  const ModelSpec spec = ModelSpec::from_json(config, "builtin");
  config["torch_dtype"] = "float16";
  config["some_future_field"] = 7;
  const ModelSpec other = ModelSpec::from_json(config, "builtin");
  CHECK(other == spec);
  CHECK(spec_differences(spec, other, "checkpoint").empty());
}
