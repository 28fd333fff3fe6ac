// Training checkpoints of LoRA adapters (engine/checkpoint/train_checkpoint.h): the
// state is the trained tensors' only, with the base's fingerprint; a resume
// over the same base is bit-identical to an uninterrupted run, across a
// change of window and tiers; a resume over another base, or into an engine
// with other adapters or none, is refused by name and changes nothing; the
// checkpoint's model files are the adapter as PEFT saves it.
#include "tests/catch_torch.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/checkpoint/train_checkpoint.h"
#include "engine/run/engine.h"
#include "io/safetensors.h"
#include "tests/engine/engine_state.h"
#include "tests/engine/tiny_model.h"

using namespace strider;
namespace fs = std::filesystem;

namespace {

using test::Batch;
using test::batch;
using test::engine;
using test::train;
using test::read_all;
using test::same_bits;
using test::State;
using test::TempDir;
using test::tiny_config;

EngineConfig config(at::ScalarType dtype, const std::string& lora, int64_t window, bool host_ckpt = false,
                    std::vector<int64_t> nvme = {}, std::string nvme_dir = {}) {
  EngineConfig cfg;
  cfg.seq = 9;
  cfg.micro_batch = 2;
  cfg.accumulation = 2;
  cfg.compute = {dtype, 40};
  cfg.adam = {.lr = 1e-2, .weight_decay = 0.1};
  cfg.schedule = {LrShape::kCosine, 1, 10};  // the schedule must continue from the saved step
  cfg.clip_norm = 0.5;
  cfg.optimizer_threads = 2;
  cfg.window = window;
  cfg.checkpoints_on_host = host_ckpt;
  cfg.nvme_blocks = std::move(nvme);
  cfg.nvme_dir = std::move(nvme_dir);
  cfg.lora = lora;
  return cfg;
}

}  // namespace

TEST_CASE("LoRA checkpoints hold the adapters and their moments, and resume bit-identically over the same base",
          "[lora][train_checkpoint]") {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16})
    for (const std::string lora : {"r=4,alpha=8,targets=all-linear", "r=2,alpha=4,targets=q_proj+down_proj,train=lm_head"}) {
      INFO("dtype " << (dtype == at::kFloat ? "fp32" : "bf16") << " lora " << lora);
      const nlohmann::json model = tiny_config(false);
      TempDir tmp;
      const fs::path dir = tmp.path / "ckpt";
      auto ref = engine(model, config(dtype, lora, 5));
      ref->init_params(7);
      train(*ref, 0, 4);
      const State ref_state = read_all(*ref);
      State at_two;
      {
        auto first = engine(model, config(dtype, lora, 2));
        first->init_params(7);
        train(*first, 0, 2);
        at_two = read_all(*first);
        save_training_checkpoint(dir, *first, model.dump(), {{"seed", 7}}, {.base_model = "/models/tiny"});
      }
      // The state of the trained tensors only; the adapter as PEFT saves it.
      SafetensorsCheckpoint state((dir / "state.safetensors").string());
      CHECK(state.find("model.layers.0.mlp.down_proj.lora_A.weight.exp_avg_sq"));
      CHECK_FALSE(state.find("model.layers.0.mlp.down_proj.weight"));
      CHECK_FALSE(state.find("model.embed_tokens.weight"));
      CHECK(bool(state.find("lm_head.weight")) == (lora.find("lm_head") != std::string::npos));
      CHECK_FALSE(fs::exists(dir / "model.safetensors"));
      SafetensorsCheckpoint adapter((dir / "adapter_model.safetensors").string());
      CHECK(adapter.find("base_model.model.model.layers.2.mlp.down_proj.lora_B.weight"));
      CHECK(adapter.size() * 3 == state.size());
      const nlohmann::json ac = nlohmann::json::parse(std::ifstream(dir / "adapter_config.json"));
      CHECK(ac["peft_type"] == "LORA");
      CHECK(ac["base_model_name_or_path"] == "/models/tiny");
      CHECK(ac["lora_alpha"] == (lora.find("alpha=8") != std::string::npos ? 8.0 : 4.0));

      // Another window, host checkpoints and NVMe tiers; adapters that hold something else before the load.
      auto second = engine(model, config(dtype, lora, 3, true, {0, 2, 4}, tmp.path.string()));
      second->init_params(7);  // the base: the model the run started from
      const std::string moved = "model.layers.1.mlp.down_proj.lora_B.weight";
      second->set_param(moved, std::vector<float>(second->spec().layout(2).find(moved)->numel, 0.5f));
      CHECK(load_training_checkpoint(dir, *second) == nlohmann::json{{"seed", 7}});
      CHECK(second->steps_done() == 2);
      CHECK(same_bits(read_all(*second), at_two));
      train(*second, 2, 4);
      CHECK(same_bits(read_all(*second), ref_state));

      // Over another base: refused, naming it, and nothing changes.
      auto other = engine(model, config(dtype, lora, 2));
      other->init_params(8);
      const State before = read_all(*other);
      CHECK_THROWS_AS(load_training_checkpoint(dir, *other), CheckpointMismatch);
      CHECK_THROWS_WITH(load_training_checkpoint(dir, *other), Catch::Contains("trained over another base"));
      CHECK(same_bits(read_all(*other), before));
      // Into an engine with other adapters, or none.
      for (const std::string& another : {std::string("r=8,alpha=8,targets=all-linear"), std::string()}) {
        auto e = engine(model, config(dtype, another, 2));
        e->init_params(7);
        CHECK_THROWS_WITH(load_training_checkpoint(dir, *e), Catch::Contains("lora: checkpoint"));
      }
    }
}
