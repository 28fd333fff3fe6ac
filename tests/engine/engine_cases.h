// The engine tests' runs: a configuration (Case) trained for some steps on
// CPU devices, and what it left (Result), compared bit for bit with the
// resident run's ("offload changes nothing"). Shared by test_engine.cpp and
// test_lora.cpp.
#pragma once

#include "tests/catch_torch.h"

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/run/engine.h"
#include "engine/run/resident_model.h"
#include "host/error.h"
#include "tests/engine/tiny_model.h"

namespace strider::test {

inline ModelSpec tiny(bool tied) { return ModelSpec::from_json(test::tiny_config(tied), "tiny"); }

// LoRA: every lora_B off the zero it starts at (initial_values, as PEFT), so
// that lora_A's gradients are not zero from the first step.
inline void move_lora_b(Engine& e) {
  for (int64_t b = 0; b < e.spec().num_blocks(); ++b) {
    const ParamLayout l = e.spec().layout(b);
    for (const TensorSlot& t : l.slots()) {
      if (!t.name.ends_with(".lora_B.weight")) continue;
      std::vector<float> v(t.numel);
      for (size_t i = 0; i < v.size(); ++i) v[i] = 0.05f * float(int((i * 7919 + t.numel) % 17) - 8) / 8.0f;
      e.set_param(t.name, v);
    }
  }
}

struct Case {
  std::string name;
  int64_t window = 2;
  bool host_ckpt = false;
  std::vector<int64_t> nvme;
  bool chaos = false;
  uint64_t seed = 1;
  int64_t grad_ring = 3;
  int64_t shard_rows = 0;  // vocabulary rows per embedding / LM-head shard (0: the tiny model's one shard)
  std::vector<int64_t> saved;  // layers that keep their activations (EngineConfig::saved_blocks)
  bool keep_logits = false;    // the head's pass 2 takes pass 1's logits (EngineConfig::keep_logits)
  std::string layer_pieces;    // EngineConfig::layer_pieces
  int64_t expert_pieces = 0;   // EngineConfig::expert_pieces
  int devices = 1;             // a pool of CPU devices (make_devices), each with its own chaos seed
  std::string lora;            // EngineConfig::lora: adapters over a frozen base
  BaseFormat base_format = BaseFormat::kCompute;  // EngineConfig::base_format: how that base is held
  bool packed = false;         // rows that pack documents (packed_positions; EngineConfig::packed_documents)
  bool padded = false;         // rows padded on the right (padding_mask; Engine::step's attention_mask)
  std::vector<int64_t> nvme_compute;  // layers whose compute copy lives on NVMe too (EngineConfig::nvme_compute_blocks)
  int64_t mlp_pieces = 0;      // EngineConfig::mlp_pieces: layers cut into sub-layer pieces
};

// `c` with the compute copies of `layers` on NVMe too (their state must be there).
inline Case with_compute_on_nvme(Case c, std::vector<int64_t> layers) {
  c.nvme_compute = std::move(layers);
  return c;
}

// Positions of `rows` rows of 9 tokens, 2 micro-batches of 2 rows: the
// first micro-batch packs documents (4 + 5 tokens, and 2 + 3 + 4: positions
// restart at each), the second is one sequence a row (0..8: the plain path).
inline std::vector<int64_t> packed_positions(int64_t rows, int64_t seq) {
  const std::vector<std::vector<int64_t>> docs = {{4, 5}, {2, 3, 4}, {9}, {9}};
  std::vector<int64_t> out;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n : docs[size_t(r) % docs.size()])
      for (int64_t t = 0; t < n; ++t) out.push_back(t);
  REQUIRE(out.size() == size_t(rows * seq));
  return out;
}

// An attention mask for `rows` rows of `seq` tokens: row r keeps its first
// `lengths[r % 4]` tokens (the rest is padding). The default: the first
// micro-batch has one full row and one of 5 tokens, the second 3 and 7.
inline std::vector<int64_t> padding_mask(int64_t rows, int64_t seq, std::vector<int64_t> lengths = {9, 5, 3, 7}) {
  std::vector<int64_t> out;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < seq; ++t) out.push_back(t < lengths[size_t(r) % lengths.size()] ? 1 : 0);
  return out;
}
// No target on padding (the engine requires -100 there).
inline void unlabel_padding(std::vector<int64_t>& labels, const std::vector<int64_t>& mask) {
  for (size_t i = 0; i < labels.size(); ++i)
    if (mask[i] == 0) labels[i] = -100;
}

struct Result {
  std::vector<std::vector<float>> state;  // per block: master, m, v
  std::vector<double> losses;
  double eval_loss = 0;  // the trained model's loss on another batch (Engine::evaluate)
  size_t peak = 0, budget = 0;
};

// One temporary directory for the NVMe tier, removed when the tests end.
inline std::string nvme_dir() {
  struct Dir {
    std::string path;
    Dir() {
      char tmpl[] = "/tmp/strider-engine-test-XXXXXX";
      REQUIRE(mkdtemp(tmpl) != nullptr);
      path = tmpl;
    }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static Dir dir;
  return dir.path;
}

inline Result run(const ModelSpec& spec, const Case& c, at::ScalarType dtype, double clip, int steps = 3,
           StateFormat format = StateFormat::kFp32) {
  EngineConfig cfg;
  cfg.optimizer_state = format;
  cfg.seq = 9;
  cfg.micro_batch = 2;
  cfg.accumulation = 2;
  cfg.compute = {dtype, 40};  // vocabulary chunk that does not divide 96
  cfg.window = c.window;
  cfg.checkpoints_on_host = c.host_ckpt;
  cfg.adam = {.lr = 1e-2, .weight_decay = 0.1};
  cfg.clip_norm = clip;
  cfg.nvme_blocks = c.nvme;
  cfg.nvme_compute_blocks = c.nvme_compute;
  cfg.nvme_dir = nvme_dir();
  cfg.grad_ring = c.grad_ring;
  cfg.vocab_shard_rows = c.shard_rows;
  cfg.saved_blocks = c.saved;
  cfg.keep_logits = c.keep_logits;
  cfg.layer_pieces = c.layer_pieces;
  cfg.expert_pieces = c.expert_pieces;
  cfg.mlp_pieces = c.mlp_pieces;
  cfg.lora = c.lora;
  cfg.base_format = c.base_format;
  cfg.packed_documents = c.packed;
  cfg.optimizer_threads = 2;
  DeviceOptions dopt{.spec = "cpu", .budget_bytes = size_t(64) << 20, .record_spans = true,
                     .chaos = {.enabled = c.chaos, .seed = c.seed, .max_delay_us = 300}};
  Engine e(spec, cfg, make_devices(dopt, std::to_string(c.devices)));
  REQUIRE(e.devices() == c.devices);
  e.init_params(7);
  move_lora_b(e);
  Result r;
  const std::vector<int64_t> pos = packed_positions(cfg.batch(), cfg.seq);
  const int64_t* positions = c.packed ? pos.data() : nullptr;
  const std::vector<int64_t> pad = padding_mask(cfg.batch(), cfg.seq);
  const int64_t* mask = c.padded ? pad.data() : nullptr;
  for (int s = 0; s < steps; ++s) {
    Batch b = batch(cfg.batch(), cfg.seq, spec.dims.vocab, 100 + s);
    if (c.padded) unlabel_padding(b.labels, pad);
    r.losses.push_back(e.step(b.ids.data(), b.labels.data(), positions, mask).loss);
  }
  Batch held_out = batch(cfg.batch(), cfg.seq, spec.dims.vocab, 999);
  if (c.padded) unlabel_padding(held_out.labels, pad);
  r.eval_loss = e.evaluate(held_out.ids.data(), held_out.labels.data(), positions, mask);
  for (int64_t b = 0; b < spec.num_blocks(); ++b)
    for (ExtentKind k : {ExtentKind::kMaster, ExtentKind::kAdamM, ExtentKind::kAdamV}) {
      std::vector<float> x(e.spec().layout(b).total_elems());  // with the adapters, if any
      e.read_state(b, k, x);
      r.state.push_back(std::move(x));
    }
  for (int d = 0; d < e.devices(); ++d) {
    r.peak = std::max(r.peak, e.device(d).peak_allocated_bytes());
    r.budget = e.device(d).budget_bytes();
  }
  return r;
}

// The tiny model's batch of the tests below: 2 micro-batches of 2 x 9
// tokens, bf16, vocabulary chunks of 40.
inline EngineConfig small_bf16() {
  EngineConfig cfg;
  cfg.seq = 9;
  cfg.micro_batch = 2;
  cfg.accumulation = 2;
  cfg.compute = {at::kBFloat16, 40};
  return cfg;
}

inline bool same_bits(const Result& a, const Result& b) {
  if (a.state.size() != b.state.size() || a.losses != b.losses) return false;
  for (size_t i = 0; i < a.state.size(); ++i)
    if (std::memcmp(a.state[i].data(), b.state[i].data(), a.state[i].size() * 4) != 0) return false;
  return true;
}

inline std::vector<Case> cases(int64_t blocks) {
  std::vector<Case> out = {
      {"K=2", 2},
      {"K=3", 3},
      {"K=all blocks", blocks},
      {"checkpoints on host", 2, true},
      {"state of blocks 1 and 3 on NVMe", 2, false, {1, 3}},
      {"all state on NVMe, K=3, host checkpoints", 3, true, {0, 1, 2, 3, 4}},
      {"chaos seed 1", 2, false, {}, true, 1},
      {"chaos seed 2, host checkpoints, NVMe", 2, true, {0, 2, 4}, true, 2},
      {"chaos seed 3, K=3", 3, false, {}, true, 3},
      // NVMe-tier gradients through a ring smaller than the blocks using it:
      // each D2H waits for the slot's previous gradients to be updated with
      // (no clipping) or spilled to NVMe (clipping).
      {"all state on NVMe, gradient ring of 1", 2, false, {0, 1, 2, 3, 4}, false, 1, 1},
      {"chaos seed 4, NVMe, gradient ring of 2", 3, true, {1, 2, 3, 4}, true, 4, 2},
      // Vocabulary shards (40 + 40 + 16 rows of 96, on the 40-row chunks):
      // the embedding and the LM head move, and are updated, shard by shard.
      {"3 vocabulary shards, K=2", 2, false, {}, false, 1, 3, 40},
      {"2 vocabulary shards, K=3, host checkpoints", 3, true, {}, false, 1, 3, 80},
      {"3 vocabulary shards, chaos seed 5, NVMe head and embedding", 2, false, {0, blocks - 1}, true, 5, 3, 40},
      {"3 vocabulary shards, all state on NVMe, gradient ring of 1", 2, true, {0, 1, 2, 3, 4}, false, 1, 1, 40},
      {"3 vocabulary shards, chaos seed 6, NVMe, ring of 2", 3, false, {0, 2, 4}, true, 6, 2, 40},
      // Kept activations: every layer, or some, with the rest recomputing.
      {"kept activations in every layer, K=2", 2, false, {}, false, 1, 3, 0, {1, 2, 3}},
      {"kept activations in layers 1 and 3, chaos seed 7, host checkpoints", 2, true, {}, true, 7, 3, 0, {1, 3}},
      {"kept activations in layer 2, K=3, chaos seed 8", 3, false, {}, true, 8, 3, 0, {2}},
      {"kept activations, 3 vocabulary shards, all state on NVMe, ring of 1, chaos seed 9", 2, true,
       {0, 1, 2, 3, 4}, true, 9, 1, 40, {3, 2, 1}},
      // Kept logits: pass 2 of the head takes pass 1's, shard by shard.
      {"kept logits, K=2", 2, false, {}, false, 1, 3, 0, {}, true},
      {"kept logits and activations, 3 vocabulary shards, chaos seed 10, host checkpoints", 2, true, {0, 4}, true,
       10, 3, 40, {1, 2, 3}, true},
  };
  // Compute copies on NVMe: read into load staging ahead of each visit of
  // their layers, forward and backward, and written back with the state.
  out.push_back(with_compute_on_nvme({"compute copies of every layer on NVMe, chaos seed 14", 2, false,
                                      {0, 1, 2, 3, 4}, true, 14}, {1, 2, 3}));
  out.push_back(with_compute_on_nvme({"compute copies of layers 1 and 3 on NVMe, K=3, host checkpoints, ring of 1", 3,
                                      true, {1, 3, 4}, false, 1, 1}, {1, 3}));
  out.push_back(with_compute_on_nvme({"compute copies of layers 2 and 3 on NVMe, kept activations, 3 vocabulary "
                                      "shards, chaos seed 15", 2, false, {0, 2, 3}, true, 15, 3, 40, {1, 3}}, {2, 3}));
  return out;
}

// An architecture's own operations against the placements that must not
// notice them: host checkpoints, NVMe, vocabulary shards, kept activations
// and logits, chaos, one device or a pool of two; each run (clip 0.5) gives
// the resident run `ref`'s bits.
inline void placements_change_nothing(const ModelSpec& spec, at::ScalarType dtype, const Result& ref, bool packed = false) {
  for (Case c : {Case{"chaos, host ckpt, NVMe", 2, true, {1, 2}, true, 5},
                 Case{"3 vocabulary shards, chaos, NVMe", 2, false, {0, 2, 4}, true, 7, 3, 40},
                 Case{"kept activations and logits, 2 vocabulary shards, chaos", 2, true, {}, true, 13, 3, 80,
                      {1, 2, 3}, true}})
    for (int devices : {1, 2}) {
      c.devices = devices;
      c.packed = packed;
      INFO(c.name << ", " << devices << " device(s), " << (dtype == at::kFloat ? "fp32" : "bf16"));
      CHECK(same_bits(run(spec, c, dtype, 0.5), ref));
    }
}

// The engine's first step's loss (parameters init_params(7), batch seed 100;
// packed_positions where cfg.packed_documents; `mask` an attention mask, or
// empty) and the resident model's on the same parameters and batch.
inline std::pair<double, double> first_step_losses(const ModelSpec& spec, const EngineConfig& cfg,
                                                   std::vector<int64_t> mask = {}) {
  Engine e(spec, cfg, make_device({.spec = "cpu"}));
  e.init_params(7);
  ResidentModel rm(spec, cfg.compute);
  for (const std::string& n : rm.param_names()) {
    std::vector<float> v = e.param(n);
    rm.set_param(n, at::from_blob(v.data(), rm.param(n).sizes(), at::kFloat));
  }
  Batch b = batch(cfg.batch(), cfg.seq, spec.dims.vocab, 100);
  if (!mask.empty()) unlabel_padding(b.labels, mask);
  std::vector<int64_t> pos = cfg.packed_documents ? packed_positions(cfg.batch(), cfg.seq) : std::vector<int64_t>{};
  const auto t = [&](std::vector<int64_t>& v) {
    return v.empty() ? at::Tensor() : at::from_blob(v.data(), {cfg.batch(), cfg.seq}, at::kLong);
  };
  const double loss = e.step(b.ids.data(), b.labels.data(), pos.empty() ? nullptr : pos.data(),
                             mask.empty() ? nullptr : mask.data()).loss;
  return {loss, rm.forward_backward(t(b.ids), t(b.labels), cfg.accumulation, false, t(pos), t(mask)).loss};
}

}  // namespace strider::test
