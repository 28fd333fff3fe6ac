// What the engine tests compare: every block's fp32 state, bit for bit, and a
// temporary directory removed when the test ends; and the tiny model's
// engine on a CPU device, stepped on batches that depend on the step only.
#pragma once

#include <cstring>
#include <filesystem>
#include <stdlib.h>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/checkpoint/train_checkpoint.h"
#include "engine/run/engine.h"
#include "tests/catch_torch.h"
#include "tests/engine/tiny_model.h"

namespace strider::test {

using State = std::vector<std::vector<float>>;  // per block: master, m, v

inline State read_all(Engine& e) {
  State st;
  for (int64_t b = 0; b < e.spec().num_blocks(); ++b)
    for (ExtentKind k : {ExtentKind::kMaster, ExtentKind::kAdamM, ExtentKind::kAdamV}) {
      std::vector<float> x(e.spec().layout(b).total_elems());
      e.read_state(b, k, x);
      st.push_back(std::move(x));
    }
  return st;
}

inline bool same_bits(const State& a, const State& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4) != 0) return false;
  return true;
}

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    char tmpl[] = "/tmp/strider-engine-test-XXXXXX";
    if (!mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

// `model` (a config.json) on a CPU device with a 64 MiB budget.
inline std::unique_ptr<Engine> engine(const nlohmann::json& model, const EngineConfig& cfg) {
  DeviceOptions dopt;
  dopt.spec = "cpu";
  dopt.budget_bytes = size_t(64) << 20;
  return std::make_unique<Engine>(ModelSpec::from_json(model, "tiny"), cfg, make_device(dopt));
}

// Steps `from` .. `to`-1; the data of step s is always the same batch. The losses.
inline std::vector<double> train(Engine& e, int from, int to) {
  std::vector<double> losses;
  for (int s = from; s < to; ++s) {
    Batch b = batch(e.config().batch(), e.config().seq, e.spec().dims.vocab, 100 + s);
    losses.push_back(e.step(b.ids.data(), b.labels.data()).loss);
  }
  return losses;
}

// Resumes `e` (whatever it held: init_params first) from the checkpoint in
// `dir`, saved after step 2 with state `at_two`, and trains steps 2 and 3: the
// state, both losses and the end state must be the uninterrupted run's
// (`ref_losses` of steps 0..3, `ref_state` after them). The checkpoint's extra.
inline nlohmann::json check_resume(Engine& e, const std::filesystem::path& dir, const State& at_two,
                                   const std::vector<double>& ref_losses, const State& ref_state) {
  e.init_params(99);
  const nlohmann::json extra = load_training_checkpoint(dir, e);
  CHECK(e.steps_done() == 2);
  CHECK(same_bits(read_all(e), at_two));
  const std::vector<double> losses = train(e, 2, 4);
  CHECK(losses[0] == ref_losses[2]);
  CHECK(losses[1] == ref_losses[3]);
  CHECK(same_bits(read_all(e), ref_state));
  return extra;
}

}  // namespace strider::test
