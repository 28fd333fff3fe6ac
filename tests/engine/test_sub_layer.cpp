// Layers cut into sub-layer pieces (EngineConfig::mlp_pieces;
// docs/pieces.md, "Sub-layer pieces"): each decoder layer is its attention half
// and slices of its MLP, each a visit of its own with its own unit, H2D,
// gradients, AdamW and extents. Every placement (K, host checkpoints, NVMe
// state, vocabulary shards, gradient rings, a pool, chaos) trains to the
// bits of the same cut with every piece resident; the cut trains within fp32
// rounding of whole layers; q8 state keeps its groups whole; what cannot be
// cut is refused by name.
#include "tests/catch_torch.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "engine/placement/placement.h"
#include "engine/plan/plan.h"
#include "engine/program/step_program.h"
#include "engine/run/engine.h"
#include "tests/engine/engine_cases.h"

using namespace strider;
using namespace strider::test;

namespace {

using K = StepOpKind;

int index_of_first(const StepProgram& prog, K k, int64_t p) {
  for (size_t i = 0; i < prog.ops.size(); ++i)
    if (prog.ops[i].kind == k && prog.ops[i].piece == p) return int(i);
  return -1;
}

Case cut(Case c, int64_t pieces = 3) {
  c.mlp_pieces = pieces;
  return c;
}

// Every piece resident: as many units as the step has pieces.
int64_t all_pieces(const ModelSpec& spec, int64_t mlp_pieces) {
  EngineConfig cfg;
  cfg.mlp_pieces = mlp_pieces;
  cfg.compute.vocab_chunk = 40;
  return int64_t(place(spec, cfg).shards().pieces.size());
}

// The largest relative difference between two runs' state of one kind
// (0: master, 1: m, 2: v), relative to each block's largest value.
double state_rel_diff(const Result& a, const Result& b, size_t kind) {
  double worst = 0;
  for (size_t i = kind; i < a.state.size(); i += 3) {
    double scale = 1e-30, diff = 0;
    for (size_t k = 0; k < a.state[i].size(); ++k) {
      scale = std::max(scale, double(std::abs(b.state[i][k])));
      diff = std::max(diff, double(std::abs(a.state[i][k] - b.state[i][k])));
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

// The tiny model's step cut into the attention half and 3 MLP slices, fp32.
EngineConfig cut_config() {
  EngineConfig cfg;
  cfg.seq = 9;
  cfg.micro_batch = 2;
  cfg.accumulation = 2;
  cfg.compute = {at::kFloat, 40};
  cfg.mlp_pieces = 3;
  return cfg;
}

}  // namespace

TEST_CASE("sub-layer pieces: a layer is its attention half and MLP slices, each a visit", "[sub_layer]") {
  const ModelSpec spec = tiny(false);
  EngineConfig cfg = cut_config();
  cfg.checkpoints_on_host = true;
  const Placement pl = place(spec, cfg);
  const Sharding& sh = pl.shards();
  const int64_t b = 2;
  REQUIRE(sh.end_of(b) - sh.first_of(b) == 4);
  CHECK(sh.name(spec, sh.first_of(b)) == "layer.1[attention]");
  CHECK(sh.name(spec, sh.first_of(b) + 1) == "layer.1[mlp[0:16)]");
  CHECK(sh.name(spec, sh.first_of(b) + 3) == "layer.1[mlp[32:48)]");
  // A slice: gate's rows, up's rows and one range per row of down_proj.
  CHECK(sh.pieces[size_t(sh.first_of(b) + 1)].ranges.size() == size_t(2 + spec.dims.hidden));
  // The pieces cover the layer once.
  size_t total = 0;
  for (int64_t p = sh.first_of(b); p < sh.end_of(b); ++p) total += sh.pieces[size_t(p)].elems();
  CHECK(total == spec.layout(b).total_elems());
  // A unit holds the largest piece (or the head's visit), not a layer.
  CHECK(sh.layer_elems < spec.layout(b).total_elems());

  const StepProgram prog = compile_step(pl, program_inputs(cfg, 1));
  for (size_t i = 0; i < prog.ops.size(); ++i)  // it runs in order
    for (int32_t a : prog.ops[i].after) CHECK(size_t(a) < i);
  // Forward: the attention half, then the slices; backward: the attention
  // half again (the MLP's input, with the layer's input back from the
  // host), the slices in reverse, then the attention half's backward. Each
  // piece sends its own gradients.
  const int64_t p0 = sh.first_of(b);
  std::vector<int64_t> forward, backward, sent, ckpt_in_visits, recompute_visits;
  for (const StepOp& o : prog.ops) {
    if (o.block != b) continue;
    if (o.kind == K::kForward && o.micro_batch == 0 && !fields(o).recompute) forward.push_back(o.piece);
    if (o.kind == K::kForward && fields(o).recompute) {
      CHECK(o.piece == p0);
      recompute_visits.push_back(o.visit);
    }
    if (o.kind == K::kBackward && o.micro_batch == 0) backward.push_back(o.piece);
    if (o.kind == K::kCheckpointIn) ckpt_in_visits.push_back(o.visit);
    if (o.kind == K::kGradsOut) sent.push_back(o.piece);
  }
  CHECK(forward == std::vector<int64_t>{p0, p0 + 1, p0 + 2, p0 + 3});
  CHECK(backward == std::vector<int64_t>{p0 + 3, p0 + 2, p0 + 1, p0});
  CHECK(sent == backward);
  REQUIRE(recompute_visits.size() == size_t(cfg.accumulation));
  CHECK(ckpt_in_visits == recompute_visits);
  // The recompute visit comes right before the last slice's backward.
  CHECK(prog.ops[size_t(index_of_first(prog, K::kBackward, p0 + 3))].visit == recompute_visits[0] + 1);
}

TEST_CASE("sub-layer pieces: every placement gives the resident cut's bits", "[sub_layer][engine]") {
  // Untied without clipping, tied with it (each update waits for the norm).
  for (auto [tied, clip] : {std::pair{false, 0.0}, std::pair{true, 0.5}}) {
    {
      const ModelSpec spec = tiny(tied);
      const Result ref = run(spec, cut({"all resident", all_pieces(spec, 3)}), at::kFloat, clip);
      CHECK(ref.losses.back() < ref.losses.front());
      for (const Case& c : std::vector<Case>{
               cut({"K=2", 2}),
               cut({"K=3, chaos seed 1", 3, false, {}, true, 1}),
               cut({"host checkpoints, chaos seed 2", 2, true, {}, true, 2}),
               cut({"state of layers 1 and 3 on NVMe, ring of 1", 2, false, {1, 3}, false, 1, 1}),
               cut({"all state on NVMe, host checkpoints, 3 vocabulary shards, chaos seed 3", 3, true,
                    {0, 1, 2, 3, 4}, true, 3, 2, 40}),
               // Each piece's compute copy read from NVMe ahead of each of its visits.
               with_compute_on_nvme(cut({"compute copies of every layer on NVMe, chaos seed 7", 2, false,
                                         {0, 1, 2, 3, 4}, true, 7}), {1, 2, 3}),
               with_compute_on_nvme(cut({"compute copies of layer 2 on NVMe, K=3, host checkpoints, ring of 1", 3,
                                         true, {2, 4}, false, 1, 1}), {2}),
           }) {
        INFO("tied=" << tied << " clip=" << clip << " case: " << c.name);
        const Result r = run(spec, c, at::kFloat, clip);
        CHECK(same_bits(r, ref));
        CHECK(r.eval_loss == ref.eval_loss);
        CHECK(r.peak <= r.budget);
      }
      for (int devices : {2, 3}) {
        Case c = cut({"a pool, host checkpoints, chaos seed 4", 2, true, {1, 2}, true, 4});
        c.devices = devices;
        INFO("tied=" << tied << " clip=" << clip << " devices " << devices);
        const Result r = run(spec, c, at::kFloat, clip);
        CHECK(same_bits(r, ref));
        CHECK(r.peak <= r.budget);
      }
    }
  }
}

TEST_CASE("sub-layer pieces: a slice's columns of down_proj go to the device as one copy of rows",
          "[sub_layer][engine]") {
  // down_proj is [H, I]: a slice's columns are a run in each of its H rows,
  // back to back in the unit; sent from RAM as one copy, not one per row.
  const ModelSpec spec = tiny(false);
  const EngineConfig cfg = cut_config();
  Engine e(spec, cfg, make_device({.spec = "cpu", .record_spans = true}));
  e.init_params(7);
  const Batch b = batch(cfg.batch(), cfg.seq, spec.dims.vocab, 11);
  e.step(b.ids.data(), b.labels.data());
  const uint64_t slice = uint64_t(spec.dims.intermediate / 3), hidden = uint64_t(spec.dims.hidden);
  int rows_copies = 0, row_copies = 0;
  for (const Span& sp : e.timeline().spans()) {
    if (sp.name != "h2d params" || sp.block != 2) continue;  // layer.1
    rows_copies += sp.bytes == hidden * slice * 4;
    row_copies += sp.bytes == slice * 4;
  }
  CHECK(rows_copies >= 6);  // three slices, each loaded for forward and backward
  CHECK(row_copies == 0);
}

TEST_CASE("sub-layer pieces train within fp32 rounding of whole layers", "[sub_layer][engine]") {
  // The slices' partial outputs and input gradients add in another order
  // than one layer's GEMMs: the same maths, other roundings. One slice is
  // the whole layer bit for bit. After one step, the first moment is the
  // gradient (times 1 - beta1); the losses of three steps agree to 1e-6.
  const ModelSpec spec = tiny(false);
  const Result whole = run(spec, {"whole layers", 2}, at::kFloat, 0.5, 1);
  const Result whole3 = run(spec, {"whole layers", 2}, at::kFloat, 0.5);
  for (int64_t pieces : {1, 2, 3, 48}) {
    INFO("mlp_pieces " << pieces);
    const Result r = run(spec, cut({"cut", 2}, pieces), at::kFloat, 0.5, 1);
    const double diff = state_rel_diff(r, whole, 1);
    INFO("first moments' largest relative difference " << diff);
    if (pieces == 1) CHECK(same_bits(r, whole));
    CHECK(diff <= 1e-6);
    const Result r3 = run(spec, cut({"cut", 2}, pieces), at::kFloat, 0.5);
    for (size_t i = 0; i < r3.losses.size(); ++i) CHECK(r3.losses[i] == Approx(whole3.losses[i]).epsilon(1e-6));
  }
}

TEST_CASE("sub-layer pieces with q8 state and bf16: groups stay whole, placements change nothing",
          "[sub_layer][engine][q8]") {
  // q8's groups of 128 must not straddle two pieces: the tiny model with an
  // intermediate size of 256 cuts into two slices of 128 rows.
  nlohmann::json config = tiny_config(false);
  config["intermediate_size"] = 256;
  const ModelSpec spec = ModelSpec::from_json(config, "tiny-256");
  for (double clip : {0.0, 1.0}) {
    const Result ref = run(spec, cut({"all resident", all_pieces(spec, 2)}, 2), at::kBFloat16, clip, 3,
                           StateFormat::kQ8);
    const Result whole = run(spec, {"whole layers", 2}, at::kBFloat16, clip, 3, StateFormat::kQ8);
    CHECK_FALSE(same_bits(ref, whole));  // the cut really ran
    for (size_t i = 0; i < ref.losses.size(); ++i) CHECK(ref.losses[i] == Approx(whole.losses[i]).epsilon(1e-2));
    for (const Case& c : std::vector<Case>{cut({"K=2, chaos seed 5", 2, false, {}, true, 5}, 2),
                                           cut({"NVMe state, host checkpoints, chaos seed 6", 3, true, {1, 2, 3},
                                                true, 6}, 2),
                                           with_compute_on_nvme(cut({"compute copies on NVMe, chaos seed 8", 2,
                                                                     false, {1, 2, 3}, true, 8}, 2), {1, 3})}) {
      INFO("clip=" << clip << " case: " << c.name);
      CHECK(same_bits(run(spec, c, at::kBFloat16, clip, 3, StateFormat::kQ8), ref));
    }
  }
  // The tiny model's 48 rows do not fall on q8's groups.
  EngineConfig q8;
  q8.optimizer_state = StateFormat::kQ8;
  q8.mlp_pieces = 2;
  CHECK_THROWS_WITH(place(tiny(false), q8), Catch::Contains("intermediate size 48 is not a multiple of 128"));
}

TEST_CASE("a model whose layers exceed half the GPU fits through sub-layer pieces, and the engine takes the plan",
          "[sub_layer][plan]") {
  // GPT-3 175B's widths (hidden 12288, FFN 49152) in Llama's gated shape
  // with 8 K/V heads: a layer of 2.14B parameters, whose unit (bf16 copy and
  // fp32 gradients) is 11.95 GiB: two do not fit 24 GiB. Its 96 layers
  // (bench/configs/llama-205b-wide-shape.json, in docs/offload.md, "Past the RAM")
  // plan as 8 do, slower: 8 here.
  nlohmann::json config = tiny_config(false);
  config.update({{"hidden_size", 12288}, {"intermediate_size", 49152}, {"num_hidden_layers", 8},
                 {"num_attention_heads", 96}, {"num_key_value_heads", 8}, {"vocab_size", 128256},
                 {"max_position_embeddings", 8192}, {"rope_theta", 500000.0}});
  const ModelSpec spec = ModelSpec::from_json(config, "llama-205b-wide-shape");
  // q8 here (its groups must fall on the cuts); fp32 in docs/offload.md's prediction.
  for (StateFormat format : {StateFormat::kQ8}) {
    INFO(state_format_name(format));
    PlanLimits l{.device_bytes = 24ull << 30, .host_bytes = 96ull << 30, .nvme_dir = "/nvme/strider", .seq = 1024,
                 .accumulation = 32, .clip_norm = 1.0, .optimizer_state = format};
    const Plan p = Plan::make(spec, l);
    INFO(p.explain());
    REQUIRE(p.feasible);
    CHECK(p.mlp_pieces >= 2);
    CHECK_THAT(p.explain(), Catch::Contains("sub-layer pieces") && Catch::Contains("with whole layers the plan"));
    CHECK(p.engine_config(l).mlp_pieces == p.mlp_pieces);
    CHECK(p.to_json()["mlp_pieces"] == p.mlp_pieces);
    CHECK(p.host_peak_bytes <= l.host_bytes);
    // Its units are a piece's, and what it places the engine's placement counts.
    const Placement pl = place(spec, p.engine_config(l));
    CHECK(pl.shards().layer_elems * 6 < (12ull << 30));
    CHECK(footprint(spec, p.engine_config(l)).host_bytes <= p.pinned_bytes);
    // A count given is kept.
    PlanLimits eight = l;
    eight.mlp_pieces = 8;
    CHECK(Plan::make(spec, eight).mlp_pieces == 8);
  }
}

TEST_CASE("sub-layer pieces refuse what they do not compose with, by name", "[sub_layer]") {
  const ModelSpec spec = tiny(false);
  EngineConfig cfg;
  cfg.seq = 9;
  cfg.mlp_pieces = 49;
  CHECK_THROWS_WITH(place(spec, cfg), Catch::Contains("1 to 48 slices"));
  cfg.mlp_pieces = 2;
  cfg.layer_pieces = "layernorm,self_attn+mlp";
  CHECK_THROWS_WITH(place(spec, cfg), Catch::Contains("leave layer_pieces empty"));
  cfg.layer_pieces.clear();
  auto engine_with = [&](EngineConfig c) { Engine e(spec, c, make_device({.spec = "cpu"})); };
  EngineConfig kept = cfg;
  kept.saved_blocks = {2};
  CHECK_THROWS_WITH(engine_with(kept), Catch::Contains("saved_blocks"));
  EngineConfig lora = cfg;
  lora.lora = "r=4,alpha=8,targets=all-linear";
  CHECK_THROWS_WITH(engine_with(lora), Catch::Contains("LoRA"));
}

TEST_CASE("a placement memo gives every placement's figures and runs, whatever was placed before", "[sub_layer]") {
  // A plan places many configurations under one PlacementMemo; each must be
  // what a placement of its own gives, whichever cut came before it.
  const ModelSpec spec = tiny(false);
  std::vector<EngineConfig> configs;
  for (int64_t pieces : {3, 0, 2})
    for (StateFormat format : {StateFormat::kFp32, StateFormat::kQ8})
      for (int64_t window : {2, 3}) {
        if (pieces > 0 && format == StateFormat::kQ8) continue;  // its intermediate size is less than a q8 group
        EngineConfig c = cut_config();
        c.mlp_pieces = pieces;
        c.optimizer_state = format;
        if (format == StateFormat::kQ8) c.compute.dtype = at::kBFloat16;  // its master's high half
        c.window = window;
        c.adam.weight_decay = 0.1;  // decay runs cut at the norms
        if (window == 3) c.nvme_blocks = {1, 2};
        configs.push_back(c);
      }
  const auto same = [](const Placement& a, const Placement& b) {
    CHECK(a.footprint.unit_bytes == b.footprint.unit_bytes);
    CHECK(a.footprint.device_bytes == b.footprint.device_bytes);
    CHECK(a.footprint.host_bytes == b.footprint.host_bytes);
    CHECK(a.footprint.nvme_bytes == b.footprint.nvme_bytes);
    REQUIRE(a.pieces.size() == b.pieces.size());
    for (size_t p = 0; p < a.pieces.size(); ++p) {
      CHECK(a.shards().pieces[p].ranges.size() == b.shards().pieces[p].ranges.size());
      CHECK(a.pieces[p].owned.begin == b.pieces[p].owned.begin);
      CHECK(a.pieces[p].owned.end == b.pieces[p].owned.end);
      CHECK(a.pieces[p].on_nvme == b.pieces[p].on_nvme);
      CHECK(a.pieces[p].ring_slot == b.pieces[p].ring_slot);
      REQUIRE(a.pieces[p].runs().size() == b.pieces[p].runs().size());
      for (size_t r = 0; r < a.pieces[p].runs().size(); ++r) {
        CHECK(a.pieces[p].runs()[r].block == b.pieces[p].runs()[r].block);
        CHECK(a.pieces[p].runs()[r].n == b.pieces[p].runs()[r].n);
        CHECK(a.pieces[p].runs()[r].decay == b.pieces[p].runs()[r].decay);
      }
    }
  };
  std::vector<Placement> alone;
  for (const EngineConfig& c : configs) alone.push_back(place(spec, c));
  const PlacementMemo memo;
  for (int round = 0; round < 2; ++round)  // the second round finds each cut remembered or replaced
    for (size_t i = 0; i < configs.size(); ++i) same(place(spec, configs[i]), alone[i]);
  // The same cut under a memo is shared, not made again.
  CHECK(place(spec, configs[0]).sharding == place(spec, configs[0]).sharding);
}
