// Training checkpoints: a resumed run is bit-identical to an uninterrupted
// one (parameters and optimizer state, across a change of window and tiers,
// a pool device's failure, q8 state); the configuration's maths fields must
// match. Damage, crashes and full disks: test_checkpoint_faults.cpp.
#include "tests/catch_torch.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "engine/checkpoint/train_checkpoint.h"
#include "engine/model/hf_folder.h"
#include "engine/run/engine.h"
#include "host/bf16.h"
#include "host/error.h"
#include "tests/engine/engine_state.h"
#include "tests/engine/tiny_model.h"

#include "tests/engine/train_checkpoint_setup.h"

TEST_CASE("resume is bit-identical to an uninterrupted run, across window and tiers", "[train_checkpoint]") {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (bool tied : {false, true}) {
      INFO("dtype=" << (dtype == at::kFloat ? "fp32" : "bf16") << " tied=" << tied);
      const nlohmann::json model = tiny_config(tied);
      TempDir tmp;
      const fs::path dir = tmp.path / "ckpt";

      auto ref = engine(model, config(dtype, 0.5, window(5)));
      ref->init_params(7);
      const std::vector<double> ref_losses = train(*ref, 0, 4);
      const State ref_state = read_all(*ref);

      State at_two;
      {
        auto first = engine(model, config(dtype, 0.5, window(2)));
        first->init_params(7);
        train(*first, 0, 2);
        at_two = read_all(*first);
        save_training_checkpoint(dir, *first, model.dump(), {{"loader", {{"cursor", 2}}}, {"seed", 7}});
      }  // the first engine is gone
      CHECK_FALSE(same_bits(at_two, ref_state));  // the comparison below can fail

      // Another window, host checkpoints, and three blocks' state on NVMe.
      auto second = engine(model, config(dtype, 0.5, {3, true, {0, 2, 4}, tmp.path.string()}));
      CHECK(check_resume(*second, dir, at_two, ref_losses, ref_state) ==
            nlohmann::json{{"loader", {{"cursor", 2}}}, {"seed", 7}});
      second.reset();
      // Two layers' compute copies on NVMe too: saved from there, resumed there, and resumed in RAM.
      const auto on_nvme = compute_on_nvme(tmp.path.string());
      {
        auto first = engine(model, config(dtype, 0.5, on_nvme));
        first->init_params(7);
        train(*first, 0, 2);
        CHECK(same_bits(read_all(*first), at_two));
        save_training_checkpoint(tmp.path / "from-nvme", *first, model.dump());
      }
      check_resume(*engine(model, config(dtype, 0.5, on_nvme)), dir, at_two, ref_losses, ref_state);
      check_resume(*engine(model, config(dtype, 0.5, window(2))), tmp.path / "from-nvme", at_two, ref_losses,
                   ref_state);

      // The same directory is a Hugging Face checkpoint of the step-2 weights (bf16).
      const ModelSpec spec = ModelSpec::from_json(model, "tiny");
      HfCheckpointReader hf(dir.string(), spec);
      std::vector<float> w(spec.layout(1).total_elems());
      hf.read_block(1, w);
      std::vector<uint16_t> bits(at_two[3].size());
      float_to_bf16(at_two[3], bits);
      CHECK(w[0] == std::bit_cast<float>(uint32_t(bits[0]) << 16));
    }
  }
}

TEST_CASE("a pool device that fails mid-run stops the step naming it, and the resume is bit-identical",
          "[train_checkpoint][pool]") {
  // Device 1 of a pool of 2 fails its ops (its ATen working memory is
  // limited to one byte: a real failure, raised inside the op). The step
  // that runs on it throws naming the device; the checkpoint saved before
  // stays loadable, and a healthy pool resumed from it ends on the bits of a
  // run that never failed (one device, all resident).
  const nlohmann::json model = tiny_config(false);
  const ModelSpec spec = ModelSpec::from_json(model, "tiny");
  TempDir tmp;
  const fs::path dir = tmp.path / "ckpt";
  auto pool = [&](int n, uint64_t sick_limit) {
    std::vector<std::unique_ptr<Device>> devs;
    for (int d = 0; d < n; ++d)
      devs.push_back(make_device({.spec = "cpu", .budget_bytes = size_t(64) << 20,
                                  .chaos = {.enabled = true, .seed = uint64_t(31 + d)},
                                  .work_limit_bytes = d == 1 ? sick_limit : 0, .pool_index = d}));
    return std::make_unique<Engine>(spec, config(at::kFloat, 0.5, window(2)), std::move(devs));
  };
  auto ref = engine(model, config(at::kFloat, 0.5, window(5)));
  ref->init_params(7);
  train(*ref, 0, 4);
  const State ref_state = read_all(*ref);
  {
    auto first = pool(2, 0);
    first->init_params(7);
    train(*first, 0, 2);
    save_training_checkpoint(dir, *first, model.dump());
  }
  {
    auto sick = pool(2, 1);
    load_training_checkpoint(dir, *sick);
    Batch b = batch(sick->config().batch(), sick->config().seq, spec.dims.vocab, 102);
    CHECK_THROWS_WITH(sick->step(b.ids.data(), b.labels.data()), Catch::Contains("cpu:1") && Catch::Contains("failed"));
    // The failure surfaced wherever the host met it (an op's, raised on its stream): settled, the engine
    // still saves its state when no update of the step applied (with clipping, none can before the norm),
    // and that state is step 2's: it resumes to the same bits below.
    const std::string broken = sick->settle_after_failure();
    if (broken.empty()) {
      save_training_checkpoint(tmp.path / "after-failure", *sick, model.dump());
      CHECK(inspect_training_checkpoint(tmp.path / "after-failure").step == 2);
    } else {
      CHECK_THAT(broken, Catch::Contains("an update failed"));
    }
  }
  CHECK(inspect_training_checkpoint(dir).step == 2);
  auto resumed = pool(3, 0);
  resumed->init_params(99);
  load_training_checkpoint(dir, *resumed);
  train(*resumed, 2, 4);
  CHECK(same_bits(read_all(*resumed), ref_state));
  if (fs::exists(tmp.path / "after-failure")) {
    auto again = pool(2, 0);
    load_training_checkpoint(tmp.path / "after-failure", *again);
    train(*again, 2, 4);
    CHECK(same_bits(read_all(*again), ref_state));
  }
}

TEST_CASE("q8 state: resume is bit-identical across window and tiers, and another format is refused unless asked",
          "[train_checkpoint][q8]") {
  const nlohmann::json model = tiny_config(false);
  TempDir tmp;
  const fs::path dir = tmp.path / "ckpt";
  auto q8 = [](EngineConfig c) {
    c.optimizer_state = StateFormat::kQ8;
    return c;
  };
  auto ref = engine(model, q8(config(at::kBFloat16, 0.5, window(5))));
  ref->init_params(7);
  const std::vector<double> ref_losses = train(*ref, 0, 4);
  const State ref_state = read_all(*ref);
  State at_two;
  {
    auto first = engine(model, q8(config(at::kBFloat16, 0.5, window(2))));
    first->init_params(7);
    train(*first, 0, 2);
    at_two = read_all(*first);
    save_training_checkpoint(dir, *first, model.dump());
  }
  const nlohmann::json saved = inspect_training_checkpoint(dir).engine_config;
  CHECK(saved["optimizer_state"] == "q8");
  // The state went out as floats and comes back to the same codes, on NVMe
  // too, and with compute copies there (q8's master's high half).
  check_resume(*engine(model, q8(config(at::kBFloat16, 0.5, {3, true, {0, 2, 4}, tmp.path.string()}))), dir, at_two,
               ref_losses, ref_state);
  check_resume(*engine(model, q8(config(at::kBFloat16, 0.5, {2, false, {1, 2, 3}, tmp.path.string(), {1, 2, 3}}))),
               dir, at_two, ref_losses, ref_state);

  // An fp32 engine refuses the q8 checkpoint, naming the format, and is left untouched...
  auto fp32 = engine(model, config(at::kBFloat16, 0.5));
  fp32->init_params(5);
  const State before = read_all(*fp32);
  CHECK_THROWS_AS(load_training_checkpoint(dir, *fp32), CheckpointMismatch);
  CHECK_THROWS_WITH(load_training_checkpoint(dir, *fp32),
                    Catch::Contains("optimizer_state: checkpoint \"q8\", engine \"fp32\"") &&
                        Catch::Contains("allow_changed optimizer_state"));
  CHECK(same_bits(read_all(*fp32), before));
  // ...and converts it when asked: the q8 values, now in fp32.
  load_training_checkpoint(dir, *fp32, {.allow_changed = {"optimizer_state"}});
  CHECK(same_bits(read_all(*fp32), at_two));
}

TEST_CASE("engine config: maths fields must match unless allowed, placement may change", "[train_checkpoint]") {
  const nlohmann::json model = tiny_config(false);
  TempDir tmp;
  auto e = engine(model, config(at::kFloat, 0.5));
  e->init_params(7);
  train(*e, 0, 1);
  save_training_checkpoint(tmp.path / "c", *e, model.dump());

  EngineConfig other = config(at::kFloat, 0.5);
  other.adam.lr = 2e-2;
  other.accumulation = 1;
  auto f = engine(model, other);
  CHECK_THROWS_WITH(load_training_checkpoint(tmp.path / "c", *f),
                    Catch::Contains("trainer_state.json") && Catch::Contains("lr: checkpoint 0.01, engine 0.02") &&
                        Catch::Contains("accumulation: checkpoint 2, engine 1"));
  CHECK(f->steps_done() == 0);
  CHECK_THROWS_WITH(load_training_checkpoint(tmp.path / "c", *f, {.allow_changed = {"lr"}, .verify_checksums = true}),
                    Catch::Contains("accumulation") && !Catch::Contains("lr:"));
  CHECK_THROWS_WITH(load_training_checkpoint(tmp.path / "c", *f, {.allow_changed = {"window"}, .verify_checksums = true}),
                    Catch::Contains("'window'"));
  other.accumulation = 2;
  auto g = engine(model, other);
  load_training_checkpoint(tmp.path / "c", *g, {.allow_changed = {"lr"}, .verify_checksums = true});
  CHECK(g->steps_done() == 1);
  // Another cut into sub-layer pieces sums in another order: a maths field.
  EngineConfig cut = config(at::kFloat, 0.5);
  cut.mlp_pieces = 2;
  CHECK_THROWS_WITH(load_training_checkpoint(tmp.path / "c", *engine(model, cut)),
                    Catch::Contains("mlp_pieces: checkpoint 0, engine 2") && Catch::Contains("--mlp-pieces N"));
  load_training_checkpoint(tmp.path / "c", *engine(model, cut), {.allow_changed = {"mlp_pieces"}});

  // Sharded state and model files load the same.
  TrainCheckpointOptions sharded;
  sharded.state_shard_bytes = 100'000;
  sharded.model_shard_bytes = 30'000;
  save_training_checkpoint(tmp.path / "s", *e, model.dump(), {}, sharded);
  CHECK(fs::exists(tmp.path / "s" / "state.safetensors.index.json"));
  CHECK(fs::exists(tmp.path / "s" / "model.safetensors.index.json"));
  auto h = engine(model, config(at::kFloat, 0.5));
  load_training_checkpoint(tmp.path / "s", *h);
  CHECK(same_bits(read_all(*h), read_all(*e)));
}
