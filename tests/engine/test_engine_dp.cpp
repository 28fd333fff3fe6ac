// Data parallel on CpuDevice: N engines, one rank per thread, over c10d's Gloo
// and one in-memory store, each stepping on its micro-batches of a global batch,
// against one engine stepping on the whole batch with N times the accumulation.
// Every rank ends with the same bits; the weights match the one-rank run's to
// 1e-6 relative (fp32 gradients); chaos, NVMe tiers and clipping change nothing.
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "tests/catch_torch.h"

#include <atomic>
#include <cmath>
#include <filesystem>
#include <set>
#include <thread>

#include "engine/run/collectives.h"
#include "engine/run/engine.h"
#include "host/error.h"
#include "tests/engine/tiny_model.h"

using namespace strider;
using namespace std::chrono_literals;

namespace {

struct Run {
  std::vector<std::vector<float>> master;  // per block
  std::vector<double> losses;
  std::vector<double> norms;
  std::set<std::string> collective;  // the names of the spans on the collective lane
};

struct Setup {
  at::ScalarType dtype = at::kFloat;
  bool fp32_grads = true;
  double clip = 0;
  bool chaos = false;
  bool nvme = false;  // blocks 1 and 3's state on NVMe
  bool nvme_compute = false;  // and block 3's compute copy (with nvme)
  bool tied = false;
  bool sharded = false;  // each rank keeps its slice of the state (EngineConfig::state_shards)
  std::string shared;    // sharded: the ranks' one compute copy in this shared memory file
  StateFormat format = StateFormat::kFp32;
  std::string layer_pieces;  // EngineConfig::layer_pieces: pieces of several ranges, cut by the ranks' slices
  std::string lora;          // EngineConfig::lora: adapters over a frozen base
  BaseFormat base_format = BaseFormat::kCompute;  // EngineConfig::base_format: that base held quantized
};

EngineConfig config(const Setup& s, int64_t accumulation, const std::string& nvme_dir, int world = 1, int rank = 0) {
  EngineConfig cfg;
  cfg.optimizer_state = s.format;
  if (s.sharded) {
    cfg.state_shards = world;
    cfg.state_shard = rank;
    cfg.shared_compute_file = s.shared;
  }
  cfg.seq = 9;
  cfg.micro_batch = 2;
  cfg.accumulation = accumulation;
  cfg.compute = {s.dtype, 40};
  cfg.adam = {.lr = 1e-2, .weight_decay = 0.1};
  cfg.clip_norm = s.clip;
  cfg.fp32_grad_transfer = s.fp32_grads;
  cfg.optimizer_threads = 1;
  cfg.layer_pieces = s.layer_pieces;
  cfg.lora = s.lora;
  cfg.base_format = s.base_format;
  if (s.nvme) {
    cfg.nvme_blocks = {1, 3};
    cfg.nvme_dir = nvme_dir;
    if (s.nvme_compute) cfg.nvme_compute_blocks = {3};
  }
  return cfg;
}

// One engine's steps; `rows` picks its part of each global batch (all of it for one rank).
Run steps(Engine& e, int world, int rank, int n_steps) {
  const EngineConfig& cfg = e.config();
  Run r;
  for (int s = 0; s < n_steps; ++s) {
    const int64_t per_rank = cfg.batch() * cfg.seq;
    test::Batch b = test::batch(cfg.batch() * world, cfg.seq, e.spec().dims.vocab, 100 + s);
    StepReport rep = e.step(b.ids.data() + rank * per_rank, b.labels.data() + rank * per_rank);
    r.losses.push_back(rep.loss);
    r.norms.push_back(rep.grad_norm);
  }
  e.finish_updates();
  for (const Span& sp : e.timeline().spans())
    if (sp.lane == Lane::kCollective) r.collective.insert(sp.name);
  for (int64_t b = 0; b < e.spec().num_blocks(); ++b) {
    std::vector<float> x(e.spec().layout(b).total_elems());
    e.read_state(b, ExtentKind::kMaster, x);
    r.master.push_back(std::move(x));
  }
  return r;
}

std::string temp_dir(const std::string& tag) {
  char tmpl[] = "/tmp/strider-dp-test-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  return std::string(tmpl) + "/" + tag;
}

// `world` ranks on threads, `accumulation` micro-batches each.
std::vector<Run> data_parallel(const Setup& s, int world, int64_t accumulation, int n_steps) {
  static std::atomic<int> runs{0};
  auto store = c10::make_intrusive<c10d::PrefixStore>("dp" + std::to_string(runs++),
                                                      c10::make_intrusive<c10d::HashStore>());
  const ModelSpec spec = ModelSpec::from_json(test::tiny_config(s.tied), "tiny");
  std::vector<Run> out(world);
  std::vector<std::string> errors(world);
  const std::string root = temp_dir("ranks");
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        const std::string dir = root + std::to_string(r);
        std::filesystem::create_directories(dir);
        Engine e(spec, config(s, accumulation, dir, world, r),
                 make_device({.spec = "cpu", .chaos = {.enabled = s.chaos, .seed = uint64_t(11 + r), .max_delay_us = 200}}));
        e.init_params(7);
        e.set_collectives(c10d_collectives(store, {.rank = r, .world = world, .local_rank = r, .local_world = world}, 60s));
        out[r] = steps(e, world, r, n_steps);
      } catch (const std::exception& ex) {
        errors[r] = ex.what();
      }
    });
  for (auto& t : threads) t.join();
  std::filesystem::remove_all(std::filesystem::path(root).parent_path());
  std::string all;
  for (int r = 0; r < world; ++r)
    if (!errors[r].empty()) all += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
  INFO(all);
  REQUIRE(all.empty());
  return out;
}

Run one_rank(const Setup& s, int64_t accumulation, int n_steps) {
  const ModelSpec spec = ModelSpec::from_json(test::tiny_config(s.tied), "tiny");
  const std::string dir = temp_dir("one");
  std::filesystem::create_directories(dir);
  Engine e(spec, config(s, accumulation, dir), make_device({.spec = "cpu"}));
  e.init_params(7);
  Run r = steps(e, 1, 0, n_steps);
  std::filesystem::remove_all(std::filesystem::path(dir).parent_path());
  return r;
}

// max |a - b| over max |b|, per block, the largest.
double relative_gap(const Run& a, const Run& b) {
  double worst = 0;
  for (size_t k = 0; k < b.master.size(); ++k) {
    double d = 0, m = 0;
    for (size_t i = 0; i < b.master[k].size(); ++i) {
      d = std::max(d, double(std::fabs(a.master[k][i] - b.master[k][i])));
      m = std::max(m, double(std::fabs(b.master[k][i])));
    }
    worst = std::max(worst, d / m);
  }
  return worst;
}

// The weights' distance in L2, relative to b's norm, over all blocks.
double relative_l2_gap(const Run& a, const Run& b) {
  double d = 0, m = 0;
  for (size_t k = 0; k < b.master.size(); ++k)
    for (size_t i = 0; i < b.master[k].size(); ++i) {
      const double x = double(a.master[k][i]) - double(b.master[k][i]);
      d += x * x;
      m += double(b.master[k][i]) * double(b.master[k][i]);
    }
  return std::sqrt(d / m);
}

bool same_weights(const Run& a, const Run& b) {
  if (a.losses != b.losses || a.master.size() != b.master.size()) return false;
  for (size_t k = 0; k < a.master.size(); ++k)
    if (std::memcmp(a.master[k].data(), b.master[k].data(), a.master[k].size() * 4) != 0) return false;
  return true;
}

bool same_bits(const Run& a, const Run& b) {
  if (a.losses != b.losses || a.norms != b.norms || a.master.size() != b.master.size()) return false;
  for (size_t k = 0; k < a.master.size(); ++k)
    if (std::memcmp(a.master[k].data(), b.master[k].data(), a.master[k].size() * 4) != 0) return false;
  return true;
}

}  // namespace

TEST_CASE("data parallel ranks end bit-identical and match one rank with their accumulation", "[engine][dist]") {
  if (!have_c10d_gloo()) {
    WARN("skipped: this build has no c10d Gloo (no gloo headers)");
    return;
  }
  // Ranks of one micro-batch each, untied: the ranks' sum in rank order,
  // (g0 + g1) + g2, is what one process accumulating its micro-batches in
  // order gets (its weight gradients are whole products added to the
  // accumulator, its embedding rows summed per token before they are added:
  // gpu/blocks/blocks.h), so the bits are the same, with clipping and NVMe tiers too.
  // Sharded state adds the global norm from the slices' sums of squares: its
  // last bit may differ, and the clip coefficient's with it (held to 1e-6).
  // With several micro-batches per rank, or a tied embedding (its head and
  // lookup gradients), the additions associate differently ((g0 + g1) + (g2 +
  // g3) against ((g0 + g1) + g2) + g3): measured up to 2.7e-6 here, so those
  // are held to 1e-5.
  struct Variant {
    std::string name;
    int world;
    int64_t accumulation;  // per rank
    Setup setup;
    bool same_bits_as_one_rank;
    double bound = 1e-6;
  };
  for (const Variant& v :
       {Variant{"2 ranks", 2, 1, {}, true},
        Variant{"2 ranks, chaos, clipping, NVMe tiers", 2, 1, {.clip = 0.5, .chaos = true, .nvme = true}, true},
        Variant{"3 ranks, chaos, clipping, NVMe tiers", 3, 1, {.clip = 0.5, .chaos = true, .nvme = true}, true},
        Variant{"2 ranks, chaos, clipping, NVMe tiers with a compute copy", 2, 1,
                {.clip = 0.5, .chaos = true, .nvme = true, .nvme_compute = true}, true},
        Variant{"3 ranks sharded, chaos, clipping, NVMe tiers", 3, 1,
                {.clip = 0.5, .chaos = true, .nvme = true, .sharded = true}, false},
        Variant{"3 ranks, 2 micro-batches each, chaos, clipping", 3, 2, {.clip = 0.5, .chaos = true}, false, 1e-5},
        Variant{"2 ranks, NVMe tiers, clipping, tied, chaos", 2, 1,
                {.clip = 0.5, .chaos = true, .nvme = true, .tied = true}, false, 1e-5}}) {
    INFO(v.name);
    const int n_steps = 3;
    const std::vector<Run> ranks = data_parallel(v.setup, v.world, v.accumulation, n_steps);
    const Run one = one_rank(v.setup, v.accumulation * v.world, n_steps);
    for (int r = 1; r < v.world; ++r) CHECK(same_bits(ranks[r], ranks[0]));
    // What the ranks exchange is timed on the collective lane; one rank exchanges nothing.
    CHECK(one.collective.empty());
    if (v.setup.sharded)
      CHECK(ranks[0].collective == std::set<std::string>{"reduce-scatter", "all-gather"});
    else
      CHECK(ranks[0].collective == std::set<std::string>{"all-reduce"});
    const double gap = relative_gap(ranks[0], one);
    INFO("largest relative gap of the weights: " << gap);
    if (v.same_bits_as_one_rank) CHECK(same_bits(ranks[0], one));
    CHECK(gap <= v.bound);
    // A loss after updates moves with the weights: held to a hundredth of
    // their bound (with AVX2 kernels the tied case's weights drift 4.4e-6 and
    // its loss 1.05e-8).
    for (int s = 0; s < n_steps; ++s) {
      CHECK(ranks[0].losses[s] == Approx(one.losses[s]).epsilon(v.bound * 1e-2));
      CHECK(ranks[0].norms[s] == Approx(one.norms[s]).epsilon(1e-6));
    }
  }
}

TEST_CASE("data parallel in bf16 trains as one rank does to bf16 rounding", "[engine][dist]") {
  if (!have_c10d_gloo()) {
    WARN("skipped: this build has no c10d Gloo (no gloo headers)");
    return;
  }
  // bf16 gradients cross to the host per rank and are summed in fp32 there:
  // one more rounding than one rank's on-device sum (its weight gradients are
  // fp32 sums, gpu/blocks/weight_grad.h). Held in L2 over all weights (measured
  // 4.6e-3): element by element, a gradient near zero that its rounding
  // moves across zero gets Adam's full step the other way (lr 1e-2, against
  // weights of ~0.1: up to 0.14 of a block's largest weight after 3 steps).
  const Setup s{.dtype = at::kBFloat16, .fp32_grads = false, .clip = 1.0, .chaos = true};
  const std::vector<Run> ranks = data_parallel(s, 2, 1, 3);
  const Run one = one_rank(s, 2, 3);
  CHECK(same_bits(ranks[1], ranks[0]));
  for (int i = 0; i < 3; ++i) CHECK(ranks[0].losses[i] == Approx(one.losses[i]).epsilon(2e-3));
  CHECK(relative_l2_gap(ranks[0], one) < 2e-2);
}

TEST_CASE("an engine takes its ranks before its first step only", "[engine][dist]") {
  const ModelSpec spec = ModelSpec::from_json(test::tiny_config(false), "tiny");
  Engine e(spec, config({}, 1, ""), make_device({.spec = "cpu"}));
  e.init_params(7);
  CHECK(e.ranks().solo());
  test::Batch b = test::batch(2, 9, spec.dims.vocab, 1);
  e.step(b.ids.data(), b.labels.data());
  CHECK_THROWS_WITH(e.set_collectives(solo_collectives()), Catch::Contains("before the first step"));
}

TEST_CASE("sharded state gives the bits of replicated state", "[engine][dist]") {
  if (!have_c10d_gloo()) {
    WARN("skipped: this build has no c10d Gloo (no gloo headers)");
    return;
  }
  // Each rank keeps and updates its slice of every block; the gradient is
  // summed only there (a reduce-scatter in the same rank order as the
  // replicated all-reduce), the compute copies gathered. AdamW is elementwise,
  // so the weights are the replicated run's bits, whatever the format or the
  // tier. The global norm adds the slices' sums of squares: its last bit may
  // differ from the replicated sum over the whole piece, and with clipping
  // the clip coefficient's with it, so those runs are held to 1e-6.
  struct Variant {
    std::string name;
    int world;
    Setup setup;
    bool same_bits = true;
  };
  for (const Variant& v :
       {Variant{"2 ranks", 2, {}},
        Variant{"3 ranks, chaos, NVMe tiers", 3, {.chaos = true, .nvme = true}},
        Variant{"3 ranks, q8, bf16, chaos, NVMe tiers", 3,
                {.dtype = at::kBFloat16, .fp32_grads = false, .chaos = true, .nvme = true,
                 .format = StateFormat::kQ8}},
        Variant{"2 ranks, q8, tied", 2,
                {.dtype = at::kBFloat16, .fp32_grads = false, .tied = true, .format = StateFormat::kQ8}},
        Variant{"3 ranks, layers in pieces of two ranges, chaos, NVMe tiers", 3,
                {.chaos = true, .nvme = true, .layer_pieces = "layernorm,self_attn+mlp"}},
        Variant{"2 ranks, q8, bf16, layers in pieces of two ranges, NVMe tiers", 2,
                {.dtype = at::kBFloat16, .fp32_grads = false, .nvme = true, .format = StateFormat::kQ8,
                 .layer_pieces = "layernorm,self_attn+mlp"}},
        Variant{"2 ranks, LoRA over an NF4 base, chaos, NVMe tiers", 2,
                {.chaos = true, .nvme = true, .lora = "r=4,alpha=8,targets=all-linear", .base_format = BaseFormat::kNf4}},
        Variant{"3 ranks, clipping, chaos, NVMe tiers, tied", 3,
                {.clip = 0.5, .chaos = true, .nvme = true, .tied = true}, false}}) {
    INFO(v.name);
    const std::vector<Run> replicated = data_parallel(v.setup, v.world, 1, 3);
    // Each rank its own compute copy (gathered), or one in shared memory.
    for (const bool shared : {false, true}) {
      INFO((shared ? "one shared compute copy" : "a compute copy per rank"));
      Setup sharded = v.setup;
      sharded.sharded = true;
      const std::string file = temp_dir("shared-compute");
      if (shared) sharded.shared = file;
      const std::vector<Run> got = data_parallel(sharded, v.world, 1, 3);
      std::filesystem::remove_all(std::filesystem::path(file).parent_path());
      for (int r = 1; r < v.world; ++r) CHECK(same_bits(got[r], got[0]));
      if (v.same_bits) {
        // The weights' bits; the reported norm adds the slices' sums of squares.
        CHECK(same_weights(got[0], replicated[0]));
      } else {
        CHECK(relative_gap(got[0], replicated[0]) <= 1e-6);
      }
      for (int s = 0; s < 3; ++s) CHECK(got[0].norms[s] == Approx(replicated[0].norms[s]).epsilon(1e-12));
    }
  }
}

TEST_CASE("a sharded engine keeps only its slice of the state", "[engine][dist]") {
  const ModelSpec spec = ModelSpec::from_json(test::tiny_config(false), "tiny");
  Setup s{.sharded = true};
  const EngineFootprint whole = footprint(spec, config({}, 1, ""));
  uint64_t slices = 0;
  for (int r = 0; r < 3; ++r) {
    const EngineFootprint part = footprint(spec, config(s, 1, "", 3, r));
    CHECK(part.state_host_bytes < whole.state_host_bytes);
    slices += part.state_host_bytes;
  }
  // Three ranks hold the state once, plus each its own compute copy and
  // gradient staging (and alignment): less than three whole copies by far.
  CHECK(slices < 2 * whole.state_host_bytes);
  // With the compute copy shared, it leaves the ranks' arenas and counts once.
  Setup shared{.sharded = true, .shared = "/dev/shm/unused"};
  const EngineFootprint with = footprint(spec, config(shared, 1, "", 3, 0));
  const EngineFootprint without = footprint(spec, config(s, 1, "", 3, 0));
  CHECK(with.shared_host_bytes > 0);
  CHECK(with.host_bytes + with.shared_host_bytes == without.host_bytes);
  // Without its ranks a sharded engine cannot step, and says why.
  Engine e(spec, config(s, 1, "", 2, 1), make_device({.spec = "cpu"}));
  e.init_params(7);
  test::Batch b = test::batch(2, 9, spec.dims.vocab, 1);
  CHECK_THROWS_WITH(e.step(b.ids.data(), b.labels.data()), Catch::Contains("set_collectives first"));
  CHECK_THROWS_WITH(e.set_collectives(solo_collectives()), Catch::Contains("state slice 1 of 2"));
}
