// What tests/engine/test_train_checkpoint.cpp (resume) and
// test_checkpoint_faults.cpp (damage, crashes, full disks) share: a tiny
// model's engine configuration and where its state lives.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "engine/run/engine.h"
#include "tests/engine/engine_state.h"
#include "tests/engine/tiny_model.h"

using namespace strider;
namespace fs = std::filesystem;

namespace {

using test::Batch;
using test::batch;
using test::check_resume;
using test::engine;
using test::train;
using test::tiny_config;

using test::read_all;
using test::same_bits;
using test::State;
using test::TempDir;

struct Placement {
  int64_t window = 2;
  bool host_ckpt = false;
  std::vector<int64_t> nvme;
  std::string nvme_dir;
  std::vector<int64_t> nvme_compute;  // layers whose compute copy lives on NVMe too
};

Placement window(int64_t k) { return {k, false, {}, {}}; }
// Layers 1..3's state on NVMe under `dir`, and the compute copies of layers 1 and 3.
Placement compute_on_nvme(const std::string& dir) { return {2, false, {1, 2, 3}, dir, {1, 3}}; }

EngineConfig config(at::ScalarType dtype, double clip, const Placement& p = {}) {
  EngineConfig cfg;
  cfg.seq = 9;
  cfg.micro_batch = 2;
  cfg.accumulation = 2;
  cfg.compute = {dtype, 40};
  cfg.adam = {.lr = 1e-2, .weight_decay = 0.1};
  cfg.schedule.shape = LrShape::kCosine;  // the schedule must continue from the saved step
  cfg.schedule.warmup_steps = 1;
  cfg.schedule.total_steps = 10;
  cfg.clip_norm = clip;
  cfg.optimizer_threads = 2;
  cfg.window = p.window;
  cfg.checkpoints_on_host = p.host_ckpt;
  cfg.nvme_blocks = p.nvme;
  cfg.nvme_dir = p.nvme_dir;
  cfg.nvme_compute_blocks = p.nvme_compute;
  return cfg;
}

}  // namespace
