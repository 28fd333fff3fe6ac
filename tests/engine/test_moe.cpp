// Mixture-of-experts models on CpuDevice: offload changes nothing with
// experts (every placement of engine_cases.h, chaos, tied and untied,
// fp32 and bf16, bit for bit), the resident reference computes the same
// loss, and the load-balancing loss is in it; layers cut into groups of
// experts that are visits of their own (mlp_pieces) train to whole layers'
// bits. That they train as
// transformers does is tests/python/test_moe_vs_transformers.py's.
#include "tests/catch_torch.h"
#include <nlohmann/json.hpp>

#include <algorithm>
#include <utility>

#include "engine/checkpoint/train_checkpoint.h"
#include "engine/model/model_presets.h"
#include "engine/placement/placement.h"
#include "engine/plan/plan.h"
#include "engine/run/engine.h"
#include "gpu/blocks/moe.h"
#include "tests/engine/engine_cases.h"
#include "tests/engine/engine_state.h"

using namespace strider;
using namespace strider::test;

namespace {

// The tiny Llama's dimensions with experts: Qwen3-MoE with layer 1 dense
// (mlp_only_layers), top 2 of 6 renormalised; Mixtral top 2 of 4.
nlohmann::json tiny_moe(const char* arch, bool tied, bool aux) {
  nlohmann::json c = test::tiny_config(tied);
  c["architectures"] = {arch};
  c["output_router_logits"] = aux;
  c["router_aux_loss_coef"] = 0.05;
  if (std::string(arch) == "Qwen3MoeForCausalLM")
    c.update({{"num_experts", 6}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 16}, {"norm_topk_prob", true},
              {"mlp_only_layers", {1}}, {"head_dim", 8}});
  else if (std::string(arch) == "Qwen2MoeForCausalLM")  // its shared expert; top-k not renormalised
    c.update({{"num_experts", 4}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 16},
              {"shared_expert_intermediate_size", 24}, {"decoder_sparse_step", 2}});
  else
    c.update({{"num_local_experts", 4}, {"num_experts_per_tok", 2}, {"intermediate_size", 24}});
  return c;
}

}  // namespace

TEST_CASE("mixture of experts: the spec reads the experts, the dense layers and the loss's weight", "[engine]") {
  const ModelSpec q = ModelSpec::from_json(tiny_moe("Qwen3MoeForCausalLM", false, true), "q");
  CHECK(q.dims.moe.experts == 6);
  CHECK(q.sparse(0));
  CHECK_FALSE(q.sparse(1));
  CHECK(q.sparse(2));
  CHECK(q.sparse_layer_count() == 2);
  CHECK(q.router_aux_coef == 0.05);
  CHECK(q.layer_dims(1).moe.experts == 0);
  const ParamLayout l0 = q.layout(1), l1 = q.layout(2);
  CHECK(l0.find("model.layers.0.mlp.experts.gate_up_proj")->shape == std::vector<int64_t>{6, 32, 32});
  CHECK(l0.find("model.layers.0.mlp.experts.down_proj")->shape == std::vector<int64_t>{6, 32, 16});
  CHECK(l0.find("model.layers.0.mlp.gate.weight")->shape == std::vector<int64_t>{6, 32});
  CHECK(l1.find("model.layers.1.mlp.gate_proj.weight") != nullptr);
  // Parameters: the two kinds of layer counted as they are.
  int64_t n = 0;
  for (int64_t b = 0; b < q.num_blocks(); ++b) n += int64_t(q.layout(b).param_elems());
  CHECK(q.param_count() == n);
  CHECK(q.largest_layer_block() == 1);  // a sparse layer: 6 experts outweigh the dense MLP
  const ModelSpec m = ModelSpec::from_json(tiny_moe("MixtralForCausalLM", false, false), "m");
  CHECK(m.router_aux_coef == 0);  // output_router_logits off: transformers adds no such loss
  CHECK(m.dims.moe.norm_topk);
  CHECK(m.dims.moe.scores_fp32);
  CHECK(m.sparse_layer_count() == 3);
  nlohmann::json bad = tiny_moe("MixtralForCausalLM", false, true);
  bad["router_jitter_noise"] = 0.01;
  CHECK_THROWS_WITH(ModelSpec::from_json(bad, "bad.json"), Catch::Contains("router_jitter_noise"));
  bad = tiny_moe("Qwen3MoeForCausalLM", false, true);
  bad["num_experts_per_tok"] = 7;
  CHECK_THROWS_WITH(ModelSpec::from_json(bad, "bad.json"), Catch::Contains("num_experts_per_tok 7"));
  bad["architectures"] = {"DeepseekV3ForCausalLM"};
  CHECK_THROWS_WITH(ModelSpec::from_json(bad, "bad.json"), Catch::Contains("latent attention"));
  CHECK_THROWS_WITH(q.with_lora("r=4,alpha=8,targets=q_proj", "--lora"), Catch::Contains("mixture-of-experts"));
  // Qwen2-MoE: Qwen2's q/k/v biases, every second layer sparse, a shared expert with its gate.
  const ModelSpec q2 = ModelSpec::from_json(tiny_moe("Qwen2MoeForCausalLM", false, true), "q2");
  CHECK(q2.dims.qkv_bias);
  CHECK_FALSE(q2.dims.o_bias);
  CHECK_FALSE(q2.dims.qk_norm);
  CHECK_FALSE(q2.dims.moe.norm_topk);
  CHECK_FALSE(q2.dims.moe.scores_fp32);
  CHECK(q2.dims.moe.shared_intermediate == 24);
  CHECK_FALSE(q2.sparse(0));
  CHECK(q2.sparse(1));
  CHECK(q2.sparse_layer_count() == 1);
  const ParamLayout s1 = q2.layout(2);
  CHECK(s1.find("model.layers.1.mlp.shared_expert.gate_proj.weight")->shape == std::vector<int64_t>{24, 32});
  CHECK(s1.find("model.layers.1.mlp.shared_expert.down_proj.weight")->shape == std::vector<int64_t>{32, 24});
  CHECK(s1.find("model.layers.1.mlp.shared_expert_gate.weight")->shape == std::vector<int64_t>{1, 32});
  CHECK(q2.layout(1).find("model.layers.0.mlp.shared_expert_gate.weight") == nullptr);
  // The preset: Qwen1.5-MoE-A2.7B's 14.3B parameters (its model card's count).
  const ModelSpec a27 = ModelSpec::from_json(model_preset("qwen1.5-moe-a2.7b"), "qwen1.5-moe-a2.7b");
  CHECK(double(a27.param_count()) == Approx(14.32e9).epsilon(0.005));
  bad = tiny_moe("Qwen2MoeForCausalLM", false, true);
  bad.erase("shared_expert_intermediate_size");
  CHECK_THROWS_WITH(ModelSpec::from_json(bad, "bad.json"), Catch::Contains("shared_expert_intermediate_size"));
}

TEST_CASE("mixture of experts: offload changes nothing, and the resident reference agrees", "[engine]") {
  for (const auto& [arch, tied, aux] : {std::tuple{"Qwen3MoeForCausalLM", false, true},
                                        std::tuple{"MixtralForCausalLM", true, true},
                                        std::tuple{"MixtralForCausalLM", false, false},
                                        std::tuple{"Qwen2MoeForCausalLM", false, true}}) {
    const ModelSpec spec = ModelSpec::from_json(tiny_moe(arch, tied, aux), arch);
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      INFO(arch << (tied ? " tied" : "") << (aux ? " with" : " without") << " the load-balancing loss, "
                << (dtype == at::kFloat ? "fp32" : "bf16"));
      const Result ref = run(spec, Case{"all resident", spec.num_blocks()}, dtype, 0.5);
      bool compute_on_nvme = false;  // one of the compute-copy cases is enough here (test_engine runs them all)
      for (Case c : cases(spec.num_blocks())) {
        if (!c.nvme_compute.empty() && std::exchange(compute_on_nvme, true)) continue;
        INFO(c.name);
        CHECK(same_bits(run(spec, c, dtype, 0.5), ref));
      }
      // Pools of two and three devices, checkpoints on the device and on the
      // host. With the load-balancing loss the routing statistics ride the
      // hand-offs (their sum in layer order, as on one device).
      for (int devices : {2, 3})
        for (bool host_ckpt : {false, true}) {
          Case pool{"chaos, NVMe, kept activations, a pool", 2, host_ckpt, {1, 2}, true, 5};
          pool.devices = devices;
          pool.saved = {2};
          INFO(devices << " devices" << (host_ckpt ? ", host checkpoints" : ""));
          CHECK(same_bits(run(spec, pool, dtype, 0.5), ref));
        }

      // The first step's loss is the resident model's (with its load-balancing term).
      EngineConfig cfg = small_bf16();
      cfg.compute.dtype = dtype;
      const auto [engine_loss, resident_loss] = first_step_losses(spec, cfg);
      CHECK(engine_loss == resident_loss);
    }
  }
}

TEST_CASE("mixture of experts: experts in pieces of any size train to the same bits", "[engine][pieces]") {
  // Qwen3-MoE's 6 experts in pieces of 1, 4 (4 + 2) and 6; with layer_pieces
  // too, the norms apart. Each piece lands, sums, spills and updates on its
  // own; the layer's visit still loads them all in the block's layout. Without
  // clipping: the bits of one piece per layer. With it the norm adds its parts
  // range by range, so a cut is held to its own bits, as layer_pieces are.
  const ModelSpec spec = ModelSpec::from_json(tiny_moe("Qwen3MoeForCausalLM", false, true), "q");
  const int64_t B = spec.num_blocks();
  {
    EngineConfig cfg = small_bf16();
    cfg.expert_pieces = 4;
    Engine e(spec, cfg, make_device({.spec = "cpu"}));
    const Sharding& sh = e.sharding();
    REQUIRE(sh.end_of(1) - sh.first_of(1) == 3);  // layer 0: attention and router, experts 0-3, experts 4-5
    CHECK(sh.name(spec, sh.first_of(1)) == "layer.0[attention+router]");
    CHECK(sh.name(spec, sh.first_of(1) + 2) == "layer.0[experts[4:6)]");
    const Piece& p = sh.pieces[size_t(sh.first_of(1) + 1)];
    const ParamLayout l = spec.layout(1);
    const TensorSlot* gu = l.find("model.layers.0.mlp.experts.gate_up_proj");
    const TensorSlot* dn = l.find("model.layers.0.mlp.experts.down_proj");
    REQUIRE(p.ranges.size() == 2);  // one range of each fused tensor
    CHECK(p.ranges[0].begin == gu->offset_elems);
    CHECK(p.ranges[0].elems() == gu->numel / 6 * 4);
    CHECK(p.ranges[1].begin == dn->offset_elems);
    CHECK(p.ranges[1].elems() == dn->numel / 6 * 4);
    CHECK(sh.end_of(2) - sh.first_of(2) == 1);  // layer 1 is dense: one piece
    cfg.layer_pieces = "layernorm,self_attn+mlp";
    Engine cut(spec, cfg, make_device({.spec = "cpu"}));
    CHECK(cut.sharding().name(spec, cut.sharding().first_of(1) + 1) == "layer.0[self_attn+mlp]");  // its router
    CHECK(cut.sharding().end_of(1) - cut.sharding().first_of(1) == 4);
    const ModelSpec dense = ModelSpec::from_json(test::tiny_config(false), "dense");
    CHECK_THROWS_WITH(Engine(dense, cfg, make_device({.spec = "cpu"})), Catch::Contains("no mixture-of-experts layers"));
  }
  for (double clip : {0.0, 0.5}) {
    const Result whole = run(spec, {"all resident", B}, at::kFloat, clip);
    for (const auto& [per, norms] : {std::pair<int64_t, const char*>{1, ""}, {4, ""}, {4, "layernorm,self_attn+mlp"},
                                     {6, ""}}) {
      Case own{"all resident", B};
      own.expert_pieces = per;
      own.layer_pieces = norms;
      const Result same_cut = run(spec, own, at::kFloat, clip);
      for (Case c : {Case{"chaos, host checkpoints, NVMe layers, ring of 1", 2, true, {1, 3}, true, 3, 1},
                     Case{"kept activations, K=3, chaos", 3, false, {2}, true, 5, 2, 0, {1, 3}}}) {
        INFO("clip=" << clip << " experts per piece " << per << " layer pieces '" << norms << "' case: " << c.name);
        c.expert_pieces = per;
        c.layer_pieces = norms;
        const Result r = run(spec, c, at::kFloat, clip);
        CHECK(same_bits(r, same_cut));
        if (clip == 0) CHECK(same_bits(r, whole));
        else CHECK(r.losses.back() == Approx(whole.losses.back()).epsilon(1e-6));
      }
    }
  }
  // q8 state: the groups and their scales, piece by piece, in RAM and on NVMe.
  Case q{"q8, NVMe layers, chaos", 2, false, {1, 3}, true, 6};
  const Result whole_q8 = run(spec, q, at::kBFloat16, 0.0, 3, StateFormat::kQ8);
  q.expert_pieces = 2;
  CHECK(same_bits(run(spec, q, at::kBFloat16, 0.0, 3, StateFormat::kQ8), whole_q8));
}

TEST_CASE("mixture of experts: groups of experts as visits of their own train to the whole layers' bits",
          "[engine][sub_layer]") {
  // mlp_pieces cuts a layer with experts into its attention-and-router half
  // and groups of experts, each a visit (gpu/blocks/moe_cut.h): the whole layer's
  // bits, forward and backward, so without clipping the run's bits too
  // (clipping sums the norm piece by piece: held to the same cut's own).
  const ModelSpec mixtral = ModelSpec::from_json(tiny_moe("MixtralForCausalLM", false, true), "m");
  {
    EngineConfig cfg = small_bf16();
    cfg.mlp_pieces = 3;
    Engine e(mixtral, cfg, make_device({.spec = "cpu"}));
    const Sharding& sh = e.sharding();
    REQUIRE(sh.end_of(1) - sh.first_of(1) == 4);  // attention and router, then experts 0, 1, 2-3
    CHECK(sh.name(mixtral, sh.first_of(1)) == "layer.0[attention+router]");
    CHECK(sh.name(mixtral, sh.first_of(1) + 3) == "layer.0[experts[2:4)]");
    CHECK(sh.pieces[size_t(sh.first_of(1) + 1)].sub_layer);
    cfg.expert_pieces = 2;
    CHECK_THROWS_WITH(Engine(mixtral, cfg, make_device({.spec = "cpu"})), Catch::Contains("leave expert_pieces 0"));
    cfg.expert_pieces = 0;
    cfg.mlp_pieces = 5;
    CHECK_THROWS_WITH(Engine(mixtral, cfg, make_device({.spec = "cpu"})), Catch::Contains("4 experts: 1 to 4 groups"));
  }
  // Every piece resident: as many units as the step has pieces.
  auto resident = [](const ModelSpec& spec, int64_t pieces) {
    EngineConfig cfg;
    cfg.mlp_pieces = pieces;
    cfg.compute.vocab_chunk = 40;
    Case c{"all resident", int64_t(place(spec, cfg).shards().pieces.size())};
    c.mlp_pieces = pieces;
    return c;
  };
  const int64_t B = mixtral.num_blocks();
  for (double clip : {0.0, 0.5}) {
    const Result whole = run(mixtral, {"all resident", B}, at::kFloat, clip);
    for (int64_t groups : {2, 3, 4}) {
      const Result same_cut = run(mixtral, resident(mixtral, groups), at::kFloat, clip);
      if (clip == 0) CHECK(same_bits(same_cut, whole));
      for (Case c : {Case{"chaos, host checkpoints, NVMe layers, ring of 1", 2, true, {1, 3}, true, 3, 1},
                     with_compute_on_nvme(Case{"compute copies on NVMe, K=3, chaos", 3, false, {1, 2, 3}, true, 7},
                                          {1, 3})}) {
        INFO("clip=" << clip << " groups " << groups << " case: " << c.name);
        c.mlp_pieces = groups;
        const Result r = run(mixtral, c, at::kFloat, clip);
        CHECK(same_bits(r, same_cut));
        CHECK(r.peak <= r.budget);
      }
    }
  }
  // A pool, padding (left out of the load-balancing loss), bf16: still the whole layers' bits.
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    Case padded{"padded rows, a pool of 2, host checkpoints, chaos", 2, true, {2}, true, 9};
    padded.padded = true;
    padded.devices = 2;
    const Result whole = run(mixtral, padded, dtype, 0.0);
    padded.mlp_pieces = 2;
    INFO((dtype == at::kFloat ? "fp32" : "bf16"));
    CHECK(same_bits(run(mixtral, padded, dtype, 0.0), whole));
  }
  // q8 state: each group's and the half's groups of 128 whole, in RAM and on NVMe.
  Case q8{"q8, NVMe layers, chaos", 2, false, {1, 3}, true, 6};
  const Result whole_q8 = run(mixtral, q8, at::kBFloat16, 0.0, 3, StateFormat::kQ8);
  q8.mlp_pieces = 3;
  CHECK(same_bits(run(mixtral, q8, at::kBFloat16, 0.0, 3, StateFormat::kQ8), whole_q8));
  // Qwen3-MoE's dense layer is cut into MLP slices (fp32 rounding of the
  // whole, gpu/blocks/layer_cut.h): held to the same cut resident.
  const ModelSpec qwen = ModelSpec::from_json(tiny_moe("Qwen3MoeForCausalLM", false, true), "q");
  const Result q_ref = run(qwen, resident(qwen, 2), at::kFloat, 0.5);
  Case qc{"chaos, NVMe layers, K=2", 2, false, {1, 2}, true, 4};
  qc.mlp_pieces = 2;
  CHECK(same_bits(run(qwen, qc, at::kFloat, 0.5), q_ref));
  // Qwen2-MoE's shared expert stays in the half, its output added after
  // every group's: cut into one piece each (a dense layer's one slice is
  // exact too) it is whole layers' bits; cut in two, its own cut's.
  const ModelSpec qwen2 = ModelSpec::from_json(tiny_moe("Qwen2MoeForCausalLM", false, true), "q2");
  Case q2{"chaos, host checkpoints, NVMe layers", 2, true, {1, 3}, true, 8};
  const Result q2_whole = run(qwen2, q2, at::kFloat, 0.0);
  q2.mlp_pieces = 1;
  CHECK(same_bits(run(qwen2, q2, at::kFloat, 0.0), q2_whole));
  q2.mlp_pieces = 2;
  CHECK(same_bits(run(qwen2, q2, at::kFloat, 0.5), run(qwen2, resident(qwen2, 2), at::kFloat, 0.5)));
}

TEST_CASE("mixture of experts: every count of experts in every count of groups gives the whole layers' bits",
          "[engine][sub_layer]") {
  // Uneven groups too (3 experts in 2, 5 in 3): a trial found 3 and 4
  // experts of Qwen3-MoE, and 3 of Mixtral, apart from the whole layers.
  for (const char* arch : {"MixtralForCausalLM", "Qwen3MoeForCausalLM"})
    for (int64_t experts : {2, 3, 4, 5})
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
        nlohmann::json c = tiny_moe(arch, false, true);
        c.erase("mlp_only_layers");  // every layer with experts: no dense layer's MLP slices
        c[std::string(arch) == "MixtralForCausalLM" ? "num_local_experts" : "num_experts"] = experts;
        const ModelSpec spec = ModelSpec::from_json(c, arch);
        const Result whole = run(spec, {"all resident", spec.num_blocks()}, dtype, 0.0);
        for (int64_t groups = 2; groups <= experts; ++groups) {
          INFO(arch << ", " << experts << " experts in " << groups << " groups, "
                    << (dtype == at::kFloat ? "fp32" : "bf16"));
          Case cut{"K=2", 2};
          cut.mlp_pieces = groups;
          CHECK(same_bits(run(spec, cut, dtype, 0.0), whole));
        }
      }
}

TEST_CASE("mixture of experts: resume is bit-identical, across window, tiers and expert pieces", "[engine][train_checkpoint]") {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16})
    for (const char* arch : {"Qwen3MoeForCausalLM", "MixtralForCausalLM"}) {
      INFO(arch << (dtype == at::kFloat ? " fp32" : " bf16"));
      const nlohmann::json model = tiny_moe(arch, false, true);
      const int64_t B = ModelSpec::from_json(model, arch).num_blocks();
      TempDir tmp;
      const std::filesystem::path dir = tmp.path / "ckpt";
      // Clipping off: a change of expert pieces keeps the bits (with it, the norm's parts change).
      EngineConfig cfg = small_bf16();
      cfg.compute.dtype = dtype;
      cfg.adam = {.lr = 1e-2, .weight_decay = 0.1};
      cfg.schedule = {.shape = LrShape::kCosine, .warmup_steps = 1, .total_steps = 10};
      cfg.window = B;
      auto ref = engine(model, cfg);
      ref->init_params(7);
      const std::vector<double> ref_losses = train(*ref, 0, 4);
      const State ref_state = read_all(*ref);
      State at_two;
      {
        cfg.window = 2;
        cfg.expert_pieces = 1;
        auto first = engine(model, cfg);
        first->init_params(7);
        train(*first, 0, 2);
        at_two = read_all(*first);
        save_training_checkpoint(dir, *first, model.dump(), {{"seed", 7}});
      }
      CHECK_FALSE(same_bits(at_two, ref_state));
      cfg.window = 3;
      cfg.expert_pieces = 3;
      cfg.checkpoints_on_host = true;
      cfg.nvme_blocks = {1, 3};
      cfg.nvme_dir = tmp.path.string();
      check_resume(*engine(model, cfg), dir, at_two, ref_losses, ref_state);
    }
}

TEST_CASE("mixture of experts: the load-balancing loss and its gradient", "[engine]") {
  // 2 experts, 4 rows: expert 0 chosen 3 times, expert 1 once (top 1);
  // probabilities summed 2.5 and 1.5. transformers' formula: E x sum over e
  // of (count_e / rows) x (prob_e / rows) = 2 x (3/4 x 2.5/4 + 1/4 x 1.5/4).
  const at::Tensor stats = at::tensor({3.0f, 1.0f, 2.5f, 1.5f}).view({2, 2});
  CHECK(moe_aux_loss(stats, 4).item<double>() == Approx(2 * (0.75 * 0.625 + 0.25 * 0.375)).epsilon(1e-6));
  // d/d(p[t, e]) = E x count_e / rows^2, times the weight.
  const at::Tensor g = moe_aux_grad(stats, 4, 0.5);
  CHECK(g[0].item<double>() == Approx(0.5 * 2 * 3 / 16.0));
  CHECK(g[1].item<double>() == Approx(0.5 * 2 * 1 / 16.0));

  // In the engine: the same model with and without it differs by its weight x the micro-batches' mean.
  EngineConfig cfg = small_bf16();
  cfg.compute.dtype = at::kFloat;
  Batch b = batch(cfg.batch(), cfg.seq, 96, 5);
  double loss[2];
  for (bool aux : {false, true}) {
    const ModelSpec spec = ModelSpec::from_json(tiny_moe("MixtralForCausalLM", false, aux), "m");
    Engine e(spec, cfg, make_device({.spec = "cpu"}));
    e.init_params(3);
    loss[aux] = e.evaluate(b.ids.data(), b.labels.data());
  }
  // Near-uniform routing at init: each micro-batch's loss is about top_k = 2 (its minimum: the
  // assignments per token sum to top_k), so the term is about 0.05 x 2.
  CHECK(loss[1] - loss[0] == Approx(0.1).epsilon(0.1));
}

TEST_CASE("mixture of experts: a pool with the load-balancing loss may keep its checkpoints on the host",
          "[engine][plan]") {
  // The plan puts them on the host for such a pool where one device fits
  // only with them there, as for any model.
  const ModelSpec spec = ModelSpec::from_json(tiny_moe("Qwen3MoeForCausalLM", false, true), "qwen3_moe");
  EngineConfig cfg = small_bf16();
  PlanLimits l{.seq = cfg.seq, .micro_batch = cfg.micro_batch, .accumulation = 256};  // checkpoints outweigh units
  Plan one;
  for (l.device_bytes = 64 << 10; l.device_bytes < (64ull << 20) && !one.feasible; l.device_bytes += 16 << 10)
    one = Plan::make(spec, l);
  REQUIRE(one.feasible);
  CHECK(one.checkpoints_on_host);
  l.device_bytes -= 16 << 10;
  l.devices = 2;
  const Plan pool = Plan::make(spec, l);
  REQUIRE(pool.feasible);
  CHECK(pool.checkpoints_on_host);
  cfg.devices = 2;
  cfg.checkpoints_on_host = true;
  CHECK_NOTHROW(check_config(spec, cfg));
}

TEST_CASE("mixture of experts: padding is left out of the load-balancing loss, under every placement", "[engine]") {
  // Rows padded on the right (the first micro-batch 9 + 5 tokens, the second
  // 3 + 7): placements, chaos and a pool give the resident run's bits.
  for (const auto& [arch, tied] : {std::tuple{"Qwen3MoeForCausalLM", false}, std::tuple{"MixtralForCausalLM", true}}) {
    const ModelSpec spec = ModelSpec::from_json(tiny_moe(arch, tied, true), arch);
    const std::vector<Case> all = cases(spec.num_blocks());
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      INFO(arch << (dtype == at::kFloat ? " fp32" : " bf16"));
      Case resident{"all resident", spec.num_blocks()};
      resident.padded = true;
      const Result ref = run(spec, resident, dtype, 0.5);
      Case pool{"chaos, NVMe, kept activations, a pool of 2", 2, false, {1, 2}, true, 5};
      pool.devices = 2;
      pool.saved = {2};
      for (Case c : {all[0], all[3], all[7], all[13], all[19], pool}) {
        c.padded = true;
        INFO(c.name);
        CHECK(same_bits(run(spec, c, dtype, 0.5), ref));
      }
    }
  }

  const ModelSpec spec = ModelSpec::from_json(tiny_moe("Qwen3MoeForCausalLM", false, true), "q");
  EngineConfig cfg = small_bf16();
  cfg.compute.dtype = at::kFloat;
  // The engine's loss is the resident model's; the padding changes it (the
  // padded tokens route, but no longer count); a mask of ones is no mask.
  const std::vector<int64_t> pad = padding_mask(cfg.batch(), cfg.seq);
  const auto [padded, resident_padded] = first_step_losses(spec, cfg, pad);
  CHECK(padded == resident_padded);
  const std::vector<int64_t> pad_labels_only = padding_mask(cfg.batch(), cfg.seq, {9});
  const auto [ones, resident_ones] = first_step_losses(spec, cfg, pad_labels_only);
  CHECK(ones == first_step_losses(spec, cfg).first);
  CHECK(ones == resident_ones);
  CHECK(padded != ones);

  // A micro-batch of padding only has no load-balancing loss: the mean is
  // over the other one (near-uniform routing at init puts each micro-batch's
  // loss near top_k = 2: the term is about 0.05 x 2, not half of it).
  const std::vector<int64_t> half = padding_mask(cfg.batch(), cfg.seq, {9, 6, 0, 0});
  Batch b = batch(cfg.batch(), cfg.seq, 96, 5);
  unlabel_padding(b.labels, half);
  double loss[2];
  for (bool aux : {false, true}) {
    Engine e(ModelSpec::from_json(tiny_moe("Qwen3MoeForCausalLM", false, aux), "q"), cfg, make_device({.spec = "cpu"}));
    e.init_params(3);
    loss[aux] = e.evaluate(b.ids.data(), b.labels.data(), nullptr, half.data());
  }
  CHECK(loss[1] - loss[0] == Approx(0.1).epsilon(0.1));
  const auto [engine_half, resident_half] = first_step_losses(spec, cfg, half);
  CHECK(engine_half == resident_half);

  // Bad masks are named before anything runs.
  Engine e(spec, cfg, make_device({.spec = "cpu"}));
  e.init_params(3);
  Batch c = batch(cfg.batch(), cfg.seq, 96, 6);
  std::vector<int64_t> left = padding_mask(cfg.batch(), cfg.seq);
  std::reverse(left.begin(), left.begin() + cfg.seq * 2);  // row 1 padded on the left
  unlabel_padding(c.labels, left);
  CHECK_THROWS_WITH(e.step(c.ids.data(), c.labels.data(), nullptr, left.data()), Catch::Contains("left padding"));
  std::vector<int64_t> two(size_t(cfg.batch() * cfg.seq), 1);
  two[3] = 2;
  CHECK_THROWS_WITH(e.step(c.ids.data(), c.labels.data(), nullptr, two.data()), Catch::Contains("is 2: 0 (padding) or 1"));
  c = batch(cfg.batch(), cfg.seq, 96, 6);  // labels on the padding
  CHECK_THROWS_WITH(e.step(c.ids.data(), c.labels.data(), nullptr, pad.data()), Catch::Contains("padding is no target"));
  CHECK(e.steps_done() == 0);
  // The resident reference checks a mask as the engine does (engine/model/batch_mask.h).
  ResidentModel rm(spec, cfg.compute);
  const auto t = [&](const std::vector<int64_t>& v) {
    return at::from_blob(const_cast<int64_t*>(v.data()), {cfg.batch(), cfg.seq}, at::kLong);
  };
  CHECK_THROWS_WITH(rm.forward_backward(t(c.ids), t(c.labels), cfg.accumulation, false, {}, t(pad)),
                    Catch::Contains("padding is no target"));
  unlabel_padding(c.labels, left);
  CHECK_THROWS_WITH(rm.forward_backward(t(c.ids), t(c.labels), cfg.accumulation, false, {}, t(left)),
                    Catch::Contains("left padding"));
}

TEST_CASE("mixture of experts: a resume refuses a config.json whose routing or load-balancing loss changed",
          "[engine][train_checkpoint]") {
  struct Change {
    const char* arch;
    const char* key;
    nlohmann::json value;
    const char* named;  // what the refusal names
  };
  const std::vector<Change> changes = {
      {"Qwen3MoeForCausalLM", "router_aux_loss_coef", 0.1, "load-balancing loss's weight"},
      {"Qwen3MoeForCausalLM", "output_router_logits", false, "load-balancing loss's weight"},
      {"Qwen3MoeForCausalLM", "norm_topk_prob", false, "norm_topk_prob"},
      {"Qwen3MoeForCausalLM", "num_experts_per_tok", 3, "num_experts_per_tok"},
      {"Qwen3MoeForCausalLM", "num_experts", 8, "num_experts"},
      {"Qwen3MoeForCausalLM", "moe_intermediate_size", 24, "moe_intermediate_size"},
      {"Qwen3MoeForCausalLM", "mlp_only_layers", nlohmann::json::array(), "dense layers"},
      {"Qwen2MoeForCausalLM", "shared_expert_intermediate_size", 32, "shared_expert_intermediate_size"},
      {"Qwen2MoeForCausalLM", "decoder_sparse_step", 1, "dense layers"},
      {"Qwen2MoeForCausalLM", "router_aux_loss_coef", 0.01, "load-balancing loss's weight"},
      {"MixtralForCausalLM", "num_experts_per_tok", 1, "num_experts_per_tok"},
      {"MixtralForCausalLM", "output_router_logits", false, "load-balancing loss's weight"},
  };
  TempDir tmp;
  for (const char* arch : {"Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"}) {
    const nlohmann::json model = tiny_moe(arch, false, true);
    const std::filesystem::path dir = tmp.path / arch;
    {
      auto saved = engine(model, small_bf16());
      saved->init_params(7);
      save_training_checkpoint(dir, *saved, model.dump());
    }
    CHECK_NOTHROW(load_training_checkpoint(dir, *engine(model, small_bf16())));  // the same config resumes
    for (const Change& c : changes) {
      if (std::string(c.arch) != arch) continue;
      INFO(arch << ": " << c.key << " = " << c.value.dump());
      nlohmann::json changed = model;
      changed[c.key] = c.value;
      auto other = engine(changed, small_bf16());
      CHECK_THROWS_WITH(load_training_checkpoint(dir, *other),
                        Catch::Contains("another model") && Catch::Contains(c.named));
    }
  }
}
