// bit_matrix: trains the tiny Llama of the engine tests under a matrix of
// configurations (K, tiers, shards, kept activations, q8, tied, clipping on
// and off, 2 ranks) and prints, per configuration, one hash of every block's
// master, Adam m and v after the steps, and of the losses and norms.
//
// A restructuring of the engine must change no bit: scripts/bit_matrix.sh
// records the hashes before it and checks them after each step. The bits
// belong to one machine and one ATen thread count (the script fixes it), so
// this is a tool, not a ctest entry: another machine's kernels round
// differently, and a test must hold on any x86-64 machine.
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <ATen/Parallel.h>
#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "engine/run/collectives.h"
#include "engine/run/engine.h"
#include "tests/engine/bit_matrix_programs.h"
#include "tests/engine/tiny_model.h"

using namespace strider;

namespace {

struct Case {
  std::string name;
  EngineConfig config;
  bool tied = false;
  bool chaos = false;
  int world = 1;  // ranks on threads, each stepping on its rows of the global batch
};

EngineConfig base() {
  EngineConfig c;
  c.seq = 9;
  c.micro_batch = 2;
  c.accumulation = 2;
  c.compute = {at::kBFloat16, 40};
  c.adam = {.lr = 1e-2, .weight_decay = 0.1};
  c.schedule = LrSchedule{LrShape::kCosine, 1, 4};
  c.optimizer_threads = 1;
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  auto add = [&](std::string name, auto edit, bool tied = false, bool chaos = false, int world = 1) {
    EngineConfig c = base();
    edit(c);
    out.push_back({std::move(name), c, tied, chaos, world});
  };
  const auto none = [](EngineConfig&) {};
  add("base", none);
  add("K3", [](EngineConfig& c) { c.window = 3; });
  add("clip", [](EngineConfig& c) { c.clip_norm = 0.5; });
  add("fp32", [](EngineConfig& c) { c.compute.dtype = at::kFloat; });
  add("fp32-grads", [](EngineConfig& c) { c.fp32_grad_transfer = true; });
  add("host-ckpt", [](EngineConfig& c) { c.checkpoints_on_host = true; });
  add("saved", [](EngineConfig& c) { c.saved_blocks = {1, 3}; });
  add("saved-host-clip", [](EngineConfig& c) {
    c.saved_blocks = {2};
    c.checkpoints_on_host = true;
    c.clip_norm = 0.5;
  });
  add("logits", [](EngineConfig& c) { c.keep_logits = true; });
  add("shards", [](EngineConfig& c) { c.vocab_shard_rows = 40; });
  add("shards-clip-K3", [](EngineConfig& c) {
    c.vocab_shard_rows = 40;
    c.clip_norm = 0.5;
    c.window = 3;
  });
  add("nvme", [](EngineConfig& c) { c.nvme_blocks = {1, 3}; });
  add("nvme-clip-ring1", [](EngineConfig& c) {
    c.nvme_blocks = {0, 2, 4};
    c.clip_norm = 0.5;
    c.grad_ring = 1;
  });
  add("nvme-compute-clip", [](EngineConfig& c) {
    c.nvme_blocks = {1, 2, 3};
    c.nvme_compute_blocks = {1, 3};
    c.clip_norm = 0.5;
  });
  add("q8", [](EngineConfig& c) { c.optimizer_state = StateFormat::kQ8; });
  add("q8-nvme-clip-shards", [](EngineConfig& c) {
    c.optimizer_state = StateFormat::kQ8;
    c.nvme_blocks = {1, 4};
    c.clip_norm = 0.5;
    c.vocab_shard_rows = 32;  // whole q8 groups (128 elements) of 32-wide rows
  });
  add("tied", none, true);
  add("tied-clip-shards-nvme", [](EngineConfig& c) {
    c.clip_norm = 0.5;
    c.vocab_shard_rows = 40;
    c.nvme_blocks = {0};
  }, true);
  add("chaos-all", [](EngineConfig& c) {
    c.clip_norm = 0.5;
    c.checkpoints_on_host = true;
    c.saved_blocks = {1};
    c.nvme_blocks = {2};
    c.vocab_shard_rows = 40;
  }, false, true);
  add("2ranks", none, false, false, 2);
  add("2ranks-clip-nvme", [](EngineConfig& c) {
    c.clip_norm = 0.5;
    c.nvme_blocks = {1, 3};
  }, false, true, 2);
  add("2ranks-sharded", [](EngineConfig& c) {
    c.state_shards = 2;
    c.clip_norm = 0.5;
  }, false, false, 2);
  add("2ranks-sharded-q8-nvme", [](EngineConfig& c) {
    c.state_shards = 2;
    c.optimizer_state = StateFormat::kQ8;
    c.nvme_blocks = {2};
  }, false, false, 2);
  return out;
}

struct Hasher {
  XXH64_state_t* s = XXH64_createState();
  Hasher() { XXH64_reset(s, 0); }
  ~Hasher() { XXH64_freeState(s); }
  void add(const void* p, size_t n) { XXH64_update(s, p, n); }
  uint64_t digest() const { return XXH64_digest(s); }
};

constexpr int kSteps = 4;

// One rank's run: its steps on its rows of each global batch, then its state.
void run_rank(const Case& k, int rank, const c10::intrusive_ptr<c10d::Store>& store, const std::string& dir,
              Hasher& h) {
  EngineConfig cfg = k.config;
  if (cfg.state_shards > 1) cfg.state_shard = rank;
  if (!cfg.nvme_blocks.empty()) cfg.nvme_dir = dir;
  const ModelSpec spec = ModelSpec::from_json(test::tiny_config(k.tied, 3), "tiny");
  Engine e(spec, cfg,
           make_device({.spec = "cpu", .chaos = {.enabled = k.chaos, .seed = uint64_t(11 + rank), .max_delay_us = 200}}));
  e.init_params(7);
  if (k.world > 1)
    e.set_collectives(c10d_collectives(
        store, {.rank = rank, .world = k.world, .local_rank = rank, .local_world = k.world}, std::chrono::seconds(60)));
  std::vector<double> figures;
  for (int s = 0; s < kSteps; ++s) {
    const int64_t per_rank = cfg.batch() * cfg.seq;
    test::Batch b = test::batch(cfg.batch() * k.world, cfg.seq, spec.dims.vocab, 100 + uint32_t(s));
    const StepReport r = e.step(b.ids.data() + rank * per_rank, b.labels.data() + rank * per_rank);
    figures.push_back(r.loss);
    figures.push_back(r.grad_norm);
  }
  e.finish_updates();
  h.add(figures.data(), figures.size() * sizeof(double));
  for (int64_t b = 0; b < spec.num_blocks(); ++b)
    for (ExtentKind x : {ExtentKind::kMaster, ExtentKind::kAdamM, ExtentKind::kAdamV}) {
      std::vector<float> v(spec.layout(b).total_elems());
      e.read_state(b, x, v);  // sharded: a collective, every rank reads the whole block
      h.add(v.data(), v.size() * 4);
    }
}

uint64_t run(const Case& k, const std::filesystem::path& root) {
  static int runs = 0;
  auto store = c10::make_intrusive<c10d::PrefixStore>("bits" + std::to_string(runs++),
                                                      c10::make_intrusive<c10d::HashStore>());
  std::vector<Hasher> hashes(size_t(k.world));
  std::vector<std::string> errors(size_t(k.world));
  std::vector<std::thread> threads;
  for (int r = 0; r < k.world; ++r)
    threads.emplace_back([&, r] {
      try {
        const auto dir = root / (k.name + "-rank" + std::to_string(r));
        std::filesystem::create_directories(dir);
        run_rank(k, r, store, dir.string(), hashes[size_t(r)]);
      } catch (const std::exception& ex) {
        errors[size_t(r)] = ex.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < k.world; ++r)
    if (!errors[size_t(r)].empty()) throw std::runtime_error(k.name + ", rank " + std::to_string(r) + ": " + errors[size_t(r)]);
  // Every rank must end with the same bits; the hash is rank 0's.
  for (int r = 1; r < k.world; ++r)
    if (hashes[size_t(r)].digest() != hashes[0].digest())
      throw std::runtime_error(k.name + ": rank " + std::to_string(r) + " ended with other bits than rank 0");
  return hashes[0].digest();
}

}  // namespace

int main(int argc, char** argv) {
  // The bits depend on how ATen splits its GEMMs: one thread, unless
  // STRIDER_BIT_MATRIX_THREADS asks for more (to see whether runs in one
  // process still agree with each other).
  const char* threads = std::getenv("STRIDER_BIT_MATRIX_THREADS");
  at::set_num_threads(threads ? std::max(1, std::atoi(threads)) : 1);
  // The programs first (pure functions of the configuration, any machine's);
  // `bit_matrix programs` prints only them, `bit_matrix NAME` one case's bits.
  const std::string only = argc > 1 ? argv[1] : "";
  int rc = only.empty() || only == "programs" ? print_programs() : 0;
  if (only == "programs") return rc;
  char tmpl[] = "/tmp/strider-bit-matrix-XXXXXX";
  if (!mkdtemp(tmpl)) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::filesystem::path root = tmpl;
  for (const Case& k : cases()) {
    if (!only.empty() && k.name != only) continue;
    if (k.world > 1 && !have_c10d_gloo()) {
      std::printf("%-24s skipped: this build has no c10d Gloo\n", k.name.c_str());
      rc = 1;
      continue;
    }
    try {
      std::printf("%-24s %016llx\n", k.name.c_str(), static_cast<unsigned long long>(run(k, root)));
    } catch (const std::exception& ex) {
      std::printf("%-24s error: %s\n", k.name.c_str(), ex.what());
      rc = 1;
    }
    std::fflush(stdout);
  }
  std::filesystem::remove_all(root);
  return rc;
}
