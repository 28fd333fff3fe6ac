#include "tests/catch_torch.h"

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>

#include "engine/config/engine_config_json.h"
#include "engine/model/builtin.h"
#include "engine/model/model_presets.h"
#include "engine/plan/plan.h"
#include "engine/run/engine.h"
#include "host/error.h"

using namespace strider;

TEST_CASE("the plan counts exactly what the engine allocates on the device", "[engine][plan]") {
  ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  for (auto place : {CheckpointPlace::kDevice, CheckpointPlace::kHost}) {
    PlanLimits l{.device_bytes = 64ull << 20, .seq = 32, .micro_batch = 2, .accumulation = 2, .checkpoints = place};
    Plan p = Plan::make(spec, l);
    REQUIRE(p.feasible);
    CHECK(p.checkpoints_on_host == (place == CheckpointPlace::kHost));
    Engine e(spec, p.engine_config(l), make_device({.spec = "cpu", .budget_bytes = l.device_bytes}));
    CHECK(e.device().allocated_bytes() == p.device_buffer_bytes);
    CHECK(e.arena_bytes() >= p.pinned_bytes);
    CHECK(p.device_peak_bytes <= l.device_bytes);
  }
}

TEST_CASE("an impossible budget is refused before allocation, with the number needed", "[engine][plan]") {
  ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  PlanLimits l{.device_bytes = 4ull << 20, .seq = 128, .micro_batch = 4};
  Plan p = Plan::make(spec, l);
  CHECK_FALSE(p.feasible);
  CHECK_THAT(p.reason, Catch::Contains("needs") && Catch::Contains("K=2") && Catch::Contains("micro-batch 4") &&
                           Catch::Contains("budget is 4.0 MiB"));
  // The number it names is enough.
  const std::string need = p.reason.substr(p.reason.find("needs ") + 6);
  l.device_bytes = parse_bytes(need.substr(0, need.find(" of")).erase(need.find(' '), 1)) + (1 << 20);
  CHECK(Plan::make(spec, l).feasible);
}

TEST_CASE("host RAM short: state goes to NVMe when there is one, else refused with the reason", "[engine][plan]") {
  ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  PlanLimits l{.device_bytes = 64ull << 20, .host_bytes = 60ull << 20, .seq = 32};
  Plan refused = Plan::make(spec, l);
  CHECK_FALSE(refused.feasible);
  CHECK_THAT(refused.reason, Catch::Contains("host RAM") && Catch::Contains("--nvme"));
  l.nvme_dir = "/tmp";
  Plan p = Plan::make(spec, l);
  REQUIRE(p.feasible);
  CHECK_FALSE(p.nvme_blocks.empty());
  CHECK(p.pinned_bytes <= l.host_bytes);
  CHECK(p.nvme_bytes > 0);
}

TEST_CASE("host RAM short: the plan moves the fewest blocks to NVMe that make it fit", "[engine][plan]") {
  ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  const PlanLimits base{.device_bytes = 64ull << 20, .nvme_dir = "/nvme/strider", .seq = 32};
  const uint64_t all_in_ram = Plan::make(spec, base).pinned_bytes;
  int moved_some = 0;
  for (int tenths = 1; tenths < 10; ++tenths) {
    PlanLimits l = base;
    l.host_bytes = all_in_ram * uint64_t(tenths) / 10;
    INFO("host limit " << l.host_bytes);
    Plan p = Plan::make(spec, l);
    if (!p.feasible || p.nvme_blocks.empty()) continue;
    ++moved_some;
    CHECK(p.pinned_bytes <= l.host_bytes);
    CHECK(footprint(spec, p.engine_config(l)).host_bytes == p.pinned_bytes);
    if (p.nvme_blocks.size() < 2) continue;
    // Without its smallest NVMe block (the last one a largest-first order
    // adds) the state would not fit.
    Plan fewer = p;
    auto smallest = std::min_element(fewer.nvme_blocks.begin(), fewer.nvme_blocks.end(), [&](int64_t a, int64_t b) {
      return spec.layout(a).total_elems() < spec.layout(b).total_elems();
    });
    fewer.nvme_blocks.erase(smallest);
    // The limit bounds the process's peak: the arena plus a save's staging of
    // one NVMe-tier block (the largest, fp32).
    uint64_t staging = 0;
    for (int64_t b = 0; b < spec.num_blocks(); ++b) staging = std::max<uint64_t>(staging, 4 * spec.layout(b).total_elems());
    CHECK(p.host_peak_bytes <= l.host_bytes);
    CHECK(footprint(spec, fewer.engine_config(l)).host_bytes + staging > l.host_bytes);
  }
  CHECK(moved_some >= 3);
}

TEST_CASE("the host RAM limit bounds the whole process at its peak, the arena gets what the rest leaves",
          "[engine][plan]") {
  ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  PlanLimits l{.device_bytes = 64ull << 20, .nvme_dir = "/nvme/strider", .seq = 32};
  l.process_bytes = 300ull << 20;
  l.device_memory_on_host = true;
  const Plan unlimited = Plan::make(spec, l);
  REQUIRE(unlimited.feasible);
  const uint64_t rest = l.process_bytes + l.device_bytes + PlanLimits::kCpuRuntimeGrowthBytes;
  // Below what the process holds besides its arena: refused, naming the parts.
  l.host_bytes = rest - (1u << 20);
  const Plan refused = Plan::make(spec, l);
  CHECK_FALSE(refused.feasible);
  CHECK_THAT(refused.reason, Catch::Contains("is below what the process holds besides its pinned arena") &&
                                 Catch::Contains("300.0 MiB the process before the run") &&
                                 Catch::Contains("the CPU device's budget and ATen's runtime"));
  // Room for the whole arena: all in RAM, the peak within the limit.
  l.host_bytes = rest + unlimited.pinned_bytes;
  const Plan all = Plan::make(spec, l);
  REQUIRE(all.feasible);
  CHECK(all.nvme_blocks.empty());
  CHECK(all.host_peak_bytes <= l.host_bytes);
  // Less: state goes to NVMe until the peak (arena, rest, a save's staging) fits.
  l.host_bytes = rest + unlimited.pinned_bytes / 2;
  const Plan some = Plan::make(spec, l);
  REQUIRE(some.feasible);
  CHECK_FALSE(some.nvme_blocks.empty());
  CHECK(some.host_peak_bytes <= l.host_bytes);
  CHECK(some.pinned_bytes <= l.host_bytes - rest);
}

TEST_CASE("sizes parse with binary and decimal units and name bad text", "[engine][plan]") {
  CHECK(parse_bytes("24GiB") == 24ull << 30);
  CHECK(parse_bytes("512 MiB") == 512ull << 20);
  CHECK(parse_bytes("1.5GB") == 1'500'000'000ull);
  CHECK(parse_bytes("4096") == 4096);
  CHECK(parse_bytes("2e9") == 2'000'000'000ull);
  CHECK(parse_bytes("1k") == 1024);
  CHECK(parse_bytes("1kB") == 1000);
  CHECK_THROWS_WITH(parse_bytes("-1GiB"), Catch::Contains("negative"));
  CHECK_THROWS_WITH(parse_bytes("1e30GiB"), Catch::Contains("1e30GiB"));
  CHECK_THROWS_WITH(parse_bytes("lots"), Catch::Contains("'lots'"));
  CHECK_THROWS_WITH(parse_bytes("3 parsecs"), Catch::Contains("parsecs"));
}

TEST_CASE("70B on 128 GiB: layers' compute copies go to NVMe too, the fewest that fit, and the engine takes them",
          "[engine][plan][nvme]") {
  ModelSpec spec = ModelSpec::from_json(model_preset("llama-3.1-70b"), "llama-3.1-70b");
  for (StateFormat format : {StateFormat::kQ8, StateFormat::kFp32}) {
    INFO(state_format_name(format));
    PlanLimits l{.device_bytes = 24ull << 30, .host_bytes = 128ull << 30, .nvme_dir = "/nvme/strider", .seq = 1024,
                 .accumulation = 32, .clip_norm = 1.0, .optimizer_state = format};
    Plan p = Plan::make(spec, l);
    REQUIRE(p.feasible);
    CHECK(p.nvme_blocks.size() == size_t(spec.num_blocks()));  // every block's state first
    REQUIRE_FALSE(p.nvme_compute_blocks.empty());
    CHECK(p.nvme_compute_blocks.size() < size_t(spec.layers));
    CHECK(std::is_sorted(p.nvme_compute_blocks.begin(), p.nvme_compute_blocks.end()));
    CHECK(p.nvme_compute_blocks.back() == spec.layers);  // the last layers first
    CHECK(p.host_peak_bytes <= l.host_bytes);
    CHECK_THAT(p.explain(), Catch::Contains("compute copies of") && Catch::Contains("NVMe per step"));
    // One layer fewer would not fit.
    EngineConfig fewer = p.engine_config(l);
    fewer.nvme_compute_blocks.erase(fewer.nvme_compute_blocks.begin());
    CHECK(footprint(spec, fewer).host_bytes > footprint(spec, p.engine_config(l)).host_bytes);
    CHECK(footprint(spec, p.engine_config(l)).host_bytes <= p.pinned_bytes);
    // The NVMe tier holds the layers' compute copies too.
    const Placement pl = place(spec, p.engine_config(l));
    uint64_t copies = 0;
    for (int64_t b : p.nvme_compute_blocks) copies += spec.layout(b).total_elems() * 2;
    const Placement state_only = [&] {
      EngineConfig c = p.engine_config(l);
      c.nvme_compute_blocks.clear();
      return place(spec, c);
    }();
    CHECK(pl.footprint.nvme_bytes - state_only.footprint.nvme_bytes >= copies);
    CHECK(pl.footprint.nvme_bytes - state_only.footprint.nvme_bytes < copies + (uint64_t(spec.num_blocks()) << 12));
  }
  // LoRA keeps its frozen base in RAM: no compute copy moves, and the refusal says so.
  PlanLimits lora{.device_bytes = 24ull << 30, .host_bytes = 64ull << 30, .nvme_dir = "/nvme/strider", .seq = 1024,
                  .accumulation = 8, .lora = "r=16,alpha=32,targets=all-linear"};
  Plan refused = Plan::make(spec, lora);
  CHECK_FALSE(refused.feasible);
  CHECK(refused.nvme_compute_blocks.empty());
}

TEST_CASE("123B on 24 GiB GPU / 384 GiB RAM: feasible with NVMe, refused without, and predicted", "[engine][plan]") {
  ModelSpec spec = ModelSpec::from_json(model_preset("mistral-large-123b"), "mistral-large-123b");
  for (double clip : {1.0, 0.0}) {
    INFO("clip " << clip);
    PlanLimits l{.device_bytes = 24ull << 30, .host_bytes = 384ull << 30, .seq = 1024, .accumulation = 8,
                 .clip_norm = clip};
    Plan refused = Plan::make(spec, l);
    CHECK_FALSE(refused.feasible);
    CHECK_THAT(refused.reason, Catch::Contains("host RAM") && Catch::Contains("--nvme") &&
                                   Catch::Contains("limit is 384.00 GiB"));
    l.nvme_dir = "/nvme/strider";  // the plan only names it; nothing is created
    Plan p = Plan::make(spec, l);
    REQUIRE(p.feasible);
    CHECK(p.pinned_bytes <= l.host_bytes);
    CHECK(p.device_peak_bytes <= l.device_bytes);
    CHECK(p.nvme_blocks.size() + 2 < size_t(spec.num_blocks()));  // most blocks on NVMe, not all
    // With clipping the NVMe tier also holds each NVMe block's gradients (bf16).
    uint64_t nvme_params = 0;
    for (int64_t b : p.nvme_blocks) nvme_params += spec.layout(b).total_elems();
    CHECK(p.nvme_bytes >= nvme_params * (clip > 0 ? 14 : 12));
    CHECK(p.nvme_bytes < nvme_params * (clip > 0 ? 14 : 12) + (uint64_t(spec.num_blocks() + 8) << 14));

    // The unchanged engine schedule on the 4090 preset: nothing is allocated
    // for real; the prediction respects its own lower bound.
    EngineConfig cfg = p.engine_config(l);
    Engine e(spec, cfg, make_device({.spec = "sim:rtx4090", .budget_bytes = l.device_bytes, .record_spans = true}));
    std::vector<int64_t> ids(size_t(cfg.batch() * cfg.seq), 0), labels(ids.size(), 0);
    StepReport r;
    for (int i = 0; i < 2; ++i) r = e.step(ids.data(), labels.data());
    double lower = 0;
    for (const LaneStats& ls : r.stats.lanes) lower = std::max(lower, ls.busy_s);
    CHECK(lower > 0);
    CHECK(lower <= r.step_s * (1 + 1e-9));
    CHECK(r.stats.lanes[size_t(Lane::kNvmeRead)].busy_s > 0);
    CHECK(e.device().peak_allocated_bytes() <= l.device_bytes);
  }
}

TEST_CASE("without clipping every block's gradients share the ring: grad_ring slots, not a buffer each",
          "[engine][plan]") {
  ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  EngineConfig c;
  c.seq = 32;
  c.clip_norm = 1.0;
  const EngineFootprint own = footprint(spec, c);
  c.clip_norm = 0;
  const EngineFootprint ring = footprint(spec, c);
  // bf16 gradients (the compute dtype); ring slots hold the largest piece
  // (a layer or a vocabulary shard).
  uint64_t buffers = 0, largest = 0;
  for (int64_t b = 0; b < spec.num_blocks(); ++b)
    buffers += (spec.layout(b).total_elems() * 2 + 255) / 256 * 256;  // ParamStore's alignment
  for (const Piece& p : make_sharding(spec, c.compute.vocab_chunk).pieces)
    largest = std::max<uint64_t>(largest, (p.elems() * 2 + 4095) / 4096 * 4096);
  CHECK(own.host_bytes - ring.host_bytes == buffers - uint64_t(c.grad_ring) * largest);
  CHECK(own.device_bytes == ring.device_bytes);
  // The engine maps what the footprint counts (rounded up to 2 MiB pages) and
  // carves its gradient staging from it without running short.
  Engine e(spec, c, make_device({.spec = "cpu", .budget_bytes = 64ull << 20}));
  CHECK(e.arena_bytes() >= ring.host_bytes);
  CHECK(e.arena_bytes() < ring.host_bytes + (2u << 20));
}

TEST_CASE("a model or a step past any machine is refused before the plan loops over it", "[engine][plan]") {
  const ModelSpec spec = ModelSpec::from_json(model_preset("llama-3.1-8b"), "llama-3.1-8b");
  const PlanLimits l{.device_bytes = 24ull << 30, .host_bytes = 64ull << 30, .nvme_dir = "/nvme/strider"};
  auto refused = [&](const ModelSpec& s, const PlanLimits& lim, const std::string& what) {
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(Plan::make(s, lim), Catch::Contains(what));
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1));
  };
  for (int64_t layers : {int64_t{1'000'000'000'000}, int64_t{100'000'000}}) {
    ModelSpec s = spec;
    s.layers = layers;
    refused(s, l, fmt::format("field 'num_hidden_layers' = {} is outside [1, 100000]", layers));
  }
  PlanLimits big = l;
  big.seq = int64_t{1} << 20;
  big.micro_batch = int64_t{1} << 20;
  big.accumulation = 2;
  refused(spec, big, "tokens is past 2^40");
  big = l;
  big.window = 35;
  refused(spec, big, "window 35 is outside [0, 34]");
  // Every count within its bound, the sizes they multiply into are not:
  // a layer's MLP over 2^40 tokens of the largest intermediate,
  ModelSpec broad = spec;
  broad.dims.intermediate = int64_t{1} << 22;
  big = l;
  big.seq = int64_t{1} << 30;
  big.micro_batch = 1 << 10;
  refused(broad, big, "layer.0: its forward working memory for micro-batch 1024 x seq 1073741824");
  // the block inputs of a 2^40-token step of hidden 2^20.
  ModelSpec wide = spec;
  wide.dims.hidden = int64_t{1} << 20;
  big = l;
  big.seq = int64_t{1} << 20;
  big.micro_batch = int64_t{1} << 20;
  refused(wide, big, "the block inputs of one step");
}

TEST_CASE("vocabulary shards: no cache unit is larger than the largest layer's", "[engine][plan][shards]") {
  // Llama-3.1-8B: the embedding and the LM head are 525M parameters each, a
  // layer 218M. SmolLM2-135M (tied, vocab 49152, hidden 576): 28M against 3.5M.
  nlohmann::json smol = {{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 576}, {"intermediate_size", 1536},
                         {"num_hidden_layers", 30}, {"num_attention_heads", 9}, {"num_key_value_heads", 3},
                         {"vocab_size", 49152}, {"max_position_embeddings", 8192}, {"rms_norm_eps", 1e-5},
                         {"tie_word_embeddings", true}};
  for (const auto& [name, config] : {std::pair{std::string("llama-3.1-8b"), model_preset("llama-3.1-8b")},
                                     {std::string("smollm2-135m"), smol}}) {
    INFO(name);
    const ModelSpec spec = ModelSpec::from_json(config, name);
    const Sharding sh = make_sharding(spec, 8192);
    CHECK(sh.unit_elems == sh.layer_elems);
    CHECK(sh.shards > 1);
    // Shards tile the vocabulary on chunk boundaries; the pieces tile every block.
    CHECK(sh.rows % sh.chunk == 0);
    int64_t rows = 0;
    for (int64_t k = 0; k < sh.shards; ++k) {
      const Piece& p = sh.pieces[size_t(sh.emb_piece[size_t(k)])];
      CHECK(p.row_begin == rows);
      rows = p.row_end;
    }
    CHECK(rows == spec.dims.vocab);
    for (int64_t b = 0; b < spec.num_blocks(); ++b) {
      size_t at = 0;
      for (int64_t p = sh.first_of(b); p < sh.end_of(b); ++p)
        for (const ElemRange& r : sh.pieces[size_t(p)].ranges) {
          CHECK(r.begin == at);
          at = r.end;
        }
      CHECK(at == spec.layout(b).total_elems());
    }
  }
  // The figure: Llama-3.1-8B at seq 1024, accumulation 8, on 24 GiB.
  const ModelSpec llama = ModelSpec::from_json(model_preset("llama-3.1-8b"), "llama-3.1-8b");
  const PlanLimits l{.device_bytes = 24ull << 30, .host_bytes = 256ull << 30, .seq = 1024, .accumulation = 8};
  const Plan p = Plan::make(llama, l);
  REQUIRE(p.feasible);
  CHECK(p.unit_bytes <= 1.32e9);
  // 64K tokens of context, batch 1, on the same 24 GiB: the working memory
  // grows with seq x hidden (no seq^2 scores; the head and the layers in
  // token tiles where that is what fits), so it fits; 128K untiled would not.
  const PlanLimits long_ctx{.device_bytes = 24ull << 30, .host_bytes = 256ull << 30, .seq = 65536};
  const Plan lc = Plan::make(llama, long_ctx);
  INFO(lc.reason);
  REQUIRE(lc.feasible);
  CHECK(lc.device_peak_bytes <= long_ctx.device_bytes);
  PlanLimits smaller = long_ctx;  // 20 GiB: untiled working memory (~16.9 GiB) leaves no room for the buffers
  smaller.device_bytes = 20ull << 30;
  const Plan tiled = Plan::make(llama, smaller);
  INFO(tiled.reason);
  REQUIRE(tiled.feasible);
  CHECK(tiled.token_tile > 0);
  CHECK(tiled.device_peak_bytes <= smaller.device_bytes);
  PlanLimits untiled = long_ctx;
  untiled.seq = 131072;
  untiled.token_tile = 0;
  const Plan refused = Plan::make(llama, untiled);
  CHECK_FALSE(refused.feasible);
  CHECK_THAT(refused.reason, Catch::Contains("working memory") && Catch::Contains("budget is 24.00 GiB"));
  // 128K on 24 GiB: the layers in token tiles, their attention in query
  // tiles (K and V whole), fit where untiled they would not.
  PlanLimits longest = long_ctx;
  longest.seq = 131072;
  const Plan p128 = Plan::make(llama, longest);
  INFO(p128.explain());
  REQUIRE(p128.feasible);
  CHECK(p128.token_tile > 0);
  CHECK(p128.device_peak_bytes <= longest.device_bytes);
  CHECK_THAT(p128.explain(), Catch::Contains("attention in query tiles of"));
  // Asked-for shards must fall on the chunks.
  CHECK_THROWS_WITH(make_sharding(llama, 8192, 10000), Catch::Contains("10000") && Catch::Contains("8192"));
}

TEST_CASE("aligned vocabulary shards start on the q8 groups and still fall on the chunks", "[engine][plan][shards]") {
  // hidden 34: a shard start r x 34 is a multiple of 128 only when r is a multiple of 64.
  for (int64_t hidden : {32, 34, 576}) {
    nlohmann::json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", hidden},
                          {"intermediate_size", 48}, {"num_hidden_layers", 2}, {"num_attention_heads", 1},
                          {"num_key_value_heads", 1}, {"vocab_size", 1000}, {"max_position_embeddings", 64},
                          {"rms_norm_eps", 1e-5}, {"tie_word_embeddings", false}};
    const ModelSpec spec = ModelSpec::from_json(cfg, "aligned");
    for (int64_t chunk : {24, 40, 96, 1000}) {
      INFO("hidden " << hidden << " chunk " << chunk);
      const Sharding sh = make_sharding(spec, chunk, 0, 128);
      CHECK((sh.rows % sh.chunk == 0 || sh.shards == 1));  // one shard: the whole vocabulary, any chunk
      for (const Piece& p : sh.pieces)
        for (const ElemRange& r : p.ranges) CHECK(r.begin % 128 == 0);
    }
  }
}

TEST_CASE("a SmolLM2-sized model slides in a budget its layers fit, not its vocabulary", "[engine][plan][shards]") {
  nlohmann::json smol = {{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 576}, {"intermediate_size", 1536},
                         {"num_hidden_layers", 30}, {"num_attention_heads", 9}, {"num_key_value_heads", 3},
                         {"vocab_size", 49152}, {"max_position_embeddings", 8192}, {"rms_norm_eps", 1e-5},
                         {"tie_word_embeddings", true}};
  const ModelSpec spec = ModelSpec::from_json(smol, "smollm2-135m");
  const PlanLimits l{.device_bytes = 160ull << 20, .seq = 128, .micro_batch = 1, .accumulation = 1};
  const Plan p = Plan::make(spec, l);
  INFO(p.reason);
  CHECK(p.feasible);
  CHECK(p.unit_bytes < (24ull << 20));
}

// Kept activations (PlanLimits::activations). The built-in model, with the
// engine's footprint counting what a kept layer holds.
namespace {
PlanLimits activation_limits(ActivationMode mode) {
  PlanLimits l{.device_bytes = 64ull << 20, .seq = 32, .micro_batch = 2, .accumulation = 2};
  l.activations = mode;
  return l;
}
}  // namespace

TEST_CASE("activations recompute: no layer keeps its activations", "[engine][plan][activations]") {
  const ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  const PlanLimits l = activation_limits(ActivationMode::kRecompute);
  const Plan p = Plan::make(spec, l);
  REQUIRE(p.feasible);
  CHECK(p.saved_blocks.empty());
  CHECK(p.saved_layers == 0);
  CHECK(p.saved_host_bytes == 0);
  CHECK(p.engine_config(l).saved_blocks.empty());
  CHECK_THAT(p.explain(), Catch::Contains("activations: every layer recomputes"));
}

TEST_CASE("activations saved with unlimited RAM: every decoder layer keeps them", "[engine][plan][activations]") {
  const ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  const PlanLimits l = activation_limits(ActivationMode::kSaved);
  const Plan p = Plan::make(spec, l);
  REQUIRE(p.feasible);
  std::vector<int64_t> layers;
  for (int64_t b = 1; b <= spec.layers; ++b) layers.push_back(b);
  CHECK(p.saved_blocks == layers);
  CHECK(p.saved_layers == spec.layers);
  CHECK(p.engine_config(l).saved_blocks == layers);
  const EngineFootprint f = footprint(spec, p.engine_config(l));
  CHECK(p.saved_host_bytes == f.saved_host_bytes);
  CHECK(p.saved_bytes_per_layer == f.saved_bytes_per_layer);
  CHECK(p.pinned_bytes == f.host_bytes);
  CHECK(p.device_buffer_bytes == f.device_bytes);
  CHECK_THAT(p.explain(), Catch::Contains(fmt::format("activations: {} of {} layers keep", spec.layers, spec.layers)));
}

TEST_CASE("activations saved, RAM for only some: the last layers keep them, the plan says how many",
          "[engine][plan][activations]") {
  const ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  REQUIRE(spec.layers >= 3);
  PlanLimits l = activation_limits(ActivationMode::kSaved);
  const Plan all = Plan::make(spec, l);
  REQUIRE(all.feasible);
  const uint64_t per_layer = all.saved_bytes_per_layer;
  if (per_layer == 0) {
    WARN("Engine::footprint counts no kept activations yet: nothing to limit");
    return;
  }
  PlanLimits none = activation_limits(ActivationMode::kRecompute);
  const uint64_t state = Plan::make(spec, none).pinned_bytes;
  // Room for two layers and a half: two keep theirs.
  l.host_bytes = state + 2 * per_layer + per_layer / 2;
  const Plan some = Plan::make(spec, l);
  INFO(some.explain());
  REQUIRE(some.feasible);
  CHECK(some.saved_layers == 2);
  CHECK(some.saved_blocks == std::vector<int64_t>{spec.layers - 1, spec.layers});
  CHECK(some.host_bytes <= l.host_bytes);
  CHECK(some.nvme_blocks.empty());
  CHECK_THAT(some.explain(), Catch::Contains(fmt::format("2 of {} layers keep", spec.layers)) &&
                                 Catch::Contains("the rest recompute"));
  // RAM for the state alone: every layer recomputes, still feasible, no error.
  l.host_bytes = state;
  const Plan zero = Plan::make(spec, l);
  REQUIRE(zero.feasible);
  CHECK(zero.saved_layers == 0);
  CHECK_THAT(zero.explain(), Catch::Contains("leaves no room for kept activations"));
  // Kept activations never push optimizer state to NVMe: with an NVMe tier
  // and RAM short of the state, the state is placed as without them.
  l.nvme_dir = "/nvme/strider";
  none.nvme_dir = l.nvme_dir;
  l.host_bytes = none.host_bytes = state * 3 / 4;
  const Plan tight = Plan::make(spec, l), recompute = Plan::make(spec, none);
  REQUIRE(tight.feasible);
  REQUIRE(recompute.feasible);
  CHECK(tight.nvme_blocks == recompute.nvme_blocks);
  CHECK(tight.host_bytes <= l.host_bytes);
}

TEST_CASE("activations auto: kept on a fast link, recomputed on a slow one", "[engine][plan][activations]") {
  const ModelSpec spec = ModelSpec::from_json(model_preset("llama-3.1-8b"), "llama-3.1-8b");
  PlanLimits l{.device_bytes = 24ull << 30, .seq = 1024, .accumulation = 8};
  l.activations = ActivationMode::kAuto;
  // The rtx4090's rates by default.
  CHECK(l.compute_flops_per_s == CostModel::preset("rtx4090").sustained_tflops() * 1e12);
  l.link_bytes_per_s = 1e15;  // a link far faster than any
  const Plan fast = Plan::make(spec, l);
  REQUIRE(fast.feasible);
  CHECK(fast.layer_cost.pays());
  CHECK(fast.saved_layers == spec.layers);
  l.link_bytes_per_s = 1e6;  // 1 MB/s
  const Plan slow = Plan::make(spec, l);
  REQUIRE(slow.feasible);
  CHECK_FALSE(slow.layer_cost.pays());
  CHECK(slow.saved_layers == 0);
  CHECK_THAT(slow.explain(), Catch::Contains("would not pay"));
}

TEST_CASE("a pool's kept activations are priced on its share of the host's memory bus",
          "[engine][plan][activations]") {
  // Llama-3.1-8B, 16 sequences per device: one device keeps every layer's
  // activations on its own 25 GB/s link; eight on the workstation preset's
  // 70 GB/s bus get 70 / 16 GB/s each way, where recomputing costs less (the
  // simulator agrees: `strider plan --devices 8 --accumulation 128` predicts
  // 8366 tokens/s recomputing against 7050 with --activations saved).
  const ModelSpec spec = ModelSpec::from_json(model_preset("llama-3.1-8b"), "llama-3.1-8b");
  PlanLimits l{.device_bytes = 24ull << 30, .host_bytes = 512ull << 30, .seq = 1024, .accumulation = 16};
  l.set_machine_rates(CostModel::preset("rtx4090"));
  CHECK(l.copy_bytes_per_s() == l.link_bytes_per_s);
  const Plan one = Plan::make(spec, l);
  REQUIRE(one.feasible);
  CHECK(one.saved_layers == spec.layers);
  l.devices = 8;
  l.accumulation = 128;
  CHECK(l.copy_bytes_per_s() == Approx(l.host_memory_bytes_per_s / 16));
  const Plan pool = Plan::make(spec, l);
  REQUIRE(pool.feasible);
  CHECK_FALSE(pool.layer_cost.pays());
  CHECK(pool.saved_layers == 0);
  CHECK_THAT(pool.explain(), Catch::Contains("would not pay") && Catch::Contains("each of 8 devices' share"));
  // On a server host's 300 GB/s bus the same pool keeps them.
  l.set_machine_rates(CostModel::parse("rtx4090,cpu_mem_gbps=300"));
  CHECK(Plan::make(spec, l).saved_layers == spec.layers);
}

TEST_CASE("the plan's JSON names the activations asked and chosen", "[engine][plan][activations]") {
  const ModelSpec spec = ModelSpec::from_json(builtin_model_config(), "builtin");
  const Plan p = Plan::make(spec, activation_limits(ActivationMode::kSaved));
  const nlohmann::json j = p.to_json();
  CHECK(j["activations"] == "saved");
  CHECK(j["saved_layers"] == spec.layers);
  CHECK(j["saved_blocks"].size() == size_t(spec.layers));
  CHECK(j["saved_host_bytes"] == p.saved_host_bytes);
  CHECK(j["saved_bytes_per_layer"] == p.saved_bytes_per_layer);
  CHECK(j["activation_cost"].contains("recompute_s"));
  CHECK(Plan::make(spec, activation_limits(ActivationMode::kAuto)).to_json()["activations"] == "auto");
  CHECK(parse_activation_mode("recompute") == ActivationMode::kRecompute);
  CHECK_THROWS_WITH(parse_activation_mode("keep"),
                    Catch::Contains("'keep'") && Catch::Contains("auto, recompute or saved"));
}

TEST_CASE("the engine config's saved_blocks round-trip through JSON, checked", "[engine][plan][activations]") {
  EngineConfig c;
  c.saved_blocks = {2, 3, 5};
  const EngineConfig back = engine_config_from_json(engine_config_to_json(c));
  CHECK(back.saved_blocks == c.saved_blocks);
  nlohmann::json j = engine_config_to_json(c);
  j["saved_blocks"] = {0, 1};
  CHECK_THROWS_WITH(engine_config_from_json(j), Catch::Contains("'saved_blocks'") && Catch::Contains("holds 0"));
  j["saved_blocks"] = {2, 2};
  CHECK_THROWS_WITH(engine_config_from_json(j), Catch::Contains("twice"));
  j.erase("saved_blocks");
  CHECK(engine_config_from_json(j).saved_blocks.empty());
}
