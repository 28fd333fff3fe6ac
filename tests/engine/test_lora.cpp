// LoRA adapters over a frozen base (engine/model/lora.h) on the CPU device: the
// frozen pieces' program has no gradient, update or state operations, the
// base stays bit for bit what it was, offload changes nothing, and one step
// is the resident reference's adapter gradients plus AdamW.
#include "tests/catch_torch.h"

#include <set>

#include "engine/model/model_presets.h"
#include "engine/plan/plan.h"
#include "engine/program/step_program.h"
#include "engine/run/engine.h"
#include "engine/run/resident_model.h"
#include "host/cpu_adam.h"
#include "tests/engine/engine_cases.h"

using namespace strider;
using namespace strider::test;

namespace {

constexpr const char* kAllLinear = "r=4,alpha=8,targets=all-linear";

ModelSpec with_lora(const ModelSpec& s, const std::string& lora) { return s.with_lora(lora, "test"); }

// The elements of block b outside its trained stretch (its frozen tensors).
bool frozen_same(const ModelSpec& spec, const Result& a, const Result& b) {
  for (int64_t blk = 0; blk < spec.num_blocks(); ++blk) {
    const ParamLayout l = spec.layout(blk);
    const auto [tb, te] = l.trainable_span();
    const std::vector<float>& x = a.state[size_t(3 * blk)];
    const std::vector<float>& y = b.state[size_t(3 * blk)];
    for (size_t i = 0; i < l.total_elems(); ++i)
      if ((i < tb || i >= te) && std::memcmp(&x[i], &y[i], 4) != 0) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("LoRA: the spec parses PEFT's options and refuses others by name", "[lora]") {
  const LoraSpec l = LoraSpec::parse("alpha=32,targets=v_proj+q_proj,r=16,rslora=1,train=lm_head", "t");
  CHECK(l.r == 16);
  CHECK(l.alpha == 32);
  CHECK(l.rslora);
  CHECK(l.targets == std::vector<std::string>{"q_proj", "v_proj"});  // layer order
  CHECK(l.scale() == Approx(32 / 4.0));
  CHECK(LoraSpec::parse(l.text(), "t") == l);
  CHECK(LoraSpec::parse("r=8,alpha=16,targets=all-linear", "t").targets.size() == 7);
  CHECK(LoraSpec::parse("r=8,alpha=16,targets=all-linear", "t").scale() == 2.0);
  CHECK(!LoraSpec::parse("", "t").enabled());
  CHECK_THROWS_WITH(LoraSpec::parse("r=8,alpha=16,targets=lm_head", "cfg"), Catch::Contains("cfg") &&
                    Catch::Contains("target 'lm_head'"));
  CHECK_THROWS_WITH(LoraSpec::parse("r=8,alpha=16,targets=all-linear,dora=1", "cfg"), Catch::Contains("'dora'"));
  CHECK_THROWS_WITH(LoraSpec::parse("r=0,alpha=16,targets=all-linear", "cfg"), Catch::Contains("r '0'"));
  CHECK_THROWS_WITH(LoraSpec::parse("r=8,targets=all-linear", "cfg"), Catch::Contains("no alpha"));
  CHECK_THROWS_WITH(LoraSpec::parse("r=8,alpha=1", "cfg"), Catch::Contains("targets no module"));
  CHECK_THROWS_WITH(LoraSpec::parse("r=8,alpha=1,targets=q_proj,train=norm", "cfg"), Catch::Contains("train 'norm'"));
  ModelSpec tied = tiny(true);
  CHECK_THROWS_WITH(tied.with_lora("r=8,alpha=1,targets=q_proj,train=lm_head", "t"),
                    Catch::Contains("ties its embedding"));
}

TEST_CASE("LoRA: a layer's adapters follow its base, and only they train", "[lora]") {
  const ModelSpec spec = with_lora(tiny(false), "r=4,alpha=8,targets=q_proj+down_proj");
  const ParamLayout l = spec.layout(2);  // layer 1
  const TensorSlot& a = l.at("model.layers.1.self_attn.q_proj.lora_A.weight");
  const TensorSlot& b = l.at("model.layers.1.mlp.down_proj.lora_B.weight");
  CHECK(a.shape == std::vector<int64_t>{4, 32});
  CHECK(b.shape == std::vector<int64_t>{32, 4});
  CHECK(l.find("model.layers.1.self_attn.k_proj.lora_A.weight") == nullptr);
  for (const TensorSlot& t : l.slots()) {
    INFO(t.name);
    CHECK(t.trainable == (t.name.find(".lora_") != std::string::npos));
  }
  CHECK(l.trainable_span().first == a.offset_elems);
  CHECK(l.trainable_span().second == l.total_elems());
  CHECK(spec.layout(0).trainable_span().second == 0);  // the embedding: frozen
  CHECK(spec.layout(spec.num_blocks() - 1).trainable_span().second == 0);
  const ModelSpec head = with_lora(tiny(false), "r=4,alpha=8,targets=q_proj,train=lm_head");
  const ParamLayout h = head.layout(head.num_blocks() - 1);
  CHECK(!h.at("model.norm.weight").trainable);
  CHECK(h.at("lm_head.weight").trainable);
}

TEST_CASE("LoRA: frozen pieces have no gradient, update or state operations, and no backward below the adapters",
          "[lora]") {
  for (bool tied : {false, true})
    for (double clip : {0.0, 1.0}) {
      const ModelSpec spec = with_lora(tiny(tied), kAllLinear);
      EngineConfig cfg = small_bf16();
      cfg.lora = kAllLinear;
      cfg.clip_norm = clip;
      cfg.vocab_shard_rows = 40;
      const Placement pl = place(spec, cfg);
      const Sharding& sh = pl.shards();
      // Per layer: its base and its adapters; the embedding's and the head's pieces frozen.
      CHECK(pl.num_pieces() == 3 + 2 * 3 + 1 + (tied ? 0 : 3));
      std::set<int64_t> trained;
      for (int64_t p = 0; p < pl.num_pieces(); ++p)
        if (!pl.piece(p).frozen) trained.insert(p);
      CHECK(trained.size() == 3);
      for (int64_t p : trained) CHECK(sh.name(spec, p).ends_with("[lora]"));
      CHECK(std::set<int64_t>(pl.landing.begin(), pl.landing.end()) == trained);
      const StepProgram prog = compile_step(pl, program_inputs(cfg, 1));
      INFO("tied " << tied << " clip " << clip);
      for (const StepOp& o : prog.ops) {
        const bool per_piece = o.kind == StepOpKind::kGradsOut || o.kind == StepOpKind::kLand ||
                               o.kind == StepOpKind::kSumSquares || o.kind == StepOpKind::kAdamW ||
                               o.kind == StepOpKind::kUpdated || o.kind == StepOpKind::kCheckGrad;
        if (per_piece) CHECK(trained.count(o.piece) == 1);
        CHECK(o.kind != StepOpKind::kTiedGradOut);  // the frozen embedding takes no gradient
        CHECK(o.kind != StepOpKind::kTiedGradIn);
        if (o.kind == StepOpKind::kBackward) CHECK(o.block >= 1);  // none for the embedding
        if (o.kind == StepOpKind::kZeroGrads) CHECK(o.block >= 1);
        if (o.kind == StepOpKind::kZeroGrads) CHECK(o.block < pl.head);  // the head's pieces are frozen
      }
      // The optimizer state is the adapters' only: 12 bytes (fp32 master, m, v) per element of each
      // layer's trained stretch (its tensors padded to 128 elements, each buffer to 256 bytes).
      EngineConfig full = cfg;
      full.lora.clear();
      const Placement pf = place(tiny(tied), full);
      uint64_t adapters = 0, largest = 0;
      for (int64_t b = 1; b < pl.head; ++b) {
        const auto [tb, te] = spec.layout(b).trainable_span();
        adapters += 3 * (((te - tb) * 4 + 255) / 256 * 256);
        largest = std::max<uint64_t>(largest, te - tb);
      }
      CHECK(pl.footprint.optimizer_host_bytes == adapters);
      CHECK(pl.footprint.optimizer_host_bytes * 4 < pf.footprint.optimizer_host_bytes);
      // A cache unit's gradient area: the largest layer's adapters, not the layer.
      CHECK(pl.footprint.unit_grad_elems == largest);
      CHECK(pl.footprint.unit_elems == pf.footprint.unit_elems + largest);
      CHECK(pl.footprint.unit_bytes < pf.footprint.unit_bytes);
    }
}

TEST_CASE("LoRA: offload changes nothing, and the frozen base keeps its bits", "[lora][engine]") {
  struct Variant {
    bool tied;
    double clip;
    std::string lora;
  };
  for (const auto& [tied, clip, lora] : {Variant{false, 0.5, kAllLinear}, Variant{true, 0.0, kAllLinear},
                                         Variant{false, 0.0, "r=2,alpha=3,targets=q_proj+v_proj,rslora=1"},
                                         Variant{false, 0.5, "r=4,alpha=8,targets=o_proj+up_proj,train=lm_head+embed_tokens"}}) {
    const ModelSpec spec = with_lora(tiny(tied), lora);
    const int64_t B = spec.num_blocks();
    Case resident{"reference: all resident", B};
    resident.lora = lora;
    const Result init = run(tiny(tied), resident, at::kFloat, clip, 0);
    const Result ref = run(tiny(tied), resident, at::kFloat, clip);
    INFO("tied " << tied << " clip " << clip << " lora " << lora);
    CHECK(ref.eval_loss != init.eval_loss);  // it trains: the adapted model computes something else
    CHECK(frozen_same(spec, init, ref));
    const auto [tb, te] = spec.layout(1).trainable_span();  // layer 0's adapters moved
    CHECK(std::memcmp(init.state[3].data() + tb, ref.state[3].data() + tb, (te - tb) * 4) != 0);
    for (Case c : cases(B)) {
      if (!c.nvme_compute.empty()) continue;  // a frozen base's compute copy stays in RAM (refused by placement)
      c.lora = lora;
      INFO("case: " << c.name);
      const Result r = run(tiny(tied), c, at::kFloat, clip);
      CHECK(same_bits(r, ref));
      CHECK(r.eval_loss == ref.eval_loss);
      CHECK(r.peak <= r.budget);
    }
    for (Case c : {Case{"K=2, chaos", 2, false, {}, true, 11}, Case{"host checkpoints, NVMe, chaos", 2, true, {1, 3}, true, 12},
                   Case{"3 vocabulary shards, kept activations and logits, chaos", 2, false, {}, true, 13, 3, 40,
                        {1, 2, 3}, true}})
      for (int n : {2, 3}) {
        c.devices = n;
        c.lora = lora;
        INFO("pool of " << n << ": " << c.name);
        const Result r = run(tiny(tied), c, at::kFloat, clip);
        CHECK(same_bits(r, ref));
        CHECK(r.eval_loss == ref.eval_loss);
      }
  }
}

TEST_CASE("LoRA: one engine step equals the resident reference's adapter gradients plus AdamW", "[lora][engine]") {
  // With a quantized base (test_lora_base.cpp) the reference computes with its dequantized values, which
  // the engine's param() gives.
  for (BaseFormat f : {BaseFormat::kCompute, BaseFormat::kInt8, BaseFormat::kNf4})
  for (bool tied : {false, true}) {
    EngineConfig cfg;
    cfg.seq = 9;
    cfg.micro_batch = 2;
    cfg.accumulation = 2;
    cfg.compute = {at::kFloat, 40};
    cfg.adam = {.lr = 1e-2, .weight_decay = 0.1};
    cfg.lora = tied ? kAllLinear : "r=4,alpha=8,targets=all-linear,train=lm_head";
    cfg.base_format = f;
    const ModelSpec spec = with_lora(tiny(tied), cfg.lora);
    Engine e(tiny(tied), cfg, make_device({.spec = "cpu", .chaos = {.enabled = true, .seed = 4}}));
    e.init_params(5);
    move_lora_b(e);
    ResidentModel ref(spec, cfg.compute);
    std::vector<std::vector<float>> before;
    for (const std::string& name : ref.param_names()) {
      before.push_back(e.param(name));
      ref.set_param(name, at::from_blob(before.back().data(), ref.param(name).sizes(), at::kFloat));
    }
    Batch b = batch(cfg.batch(), cfg.seq, spec.dims.vocab, 8);
    StepReport rep = e.step(b.ids.data(), b.labels.data());
    at::Tensor ids = at::from_blob(b.ids.data(), {cfg.batch(), cfg.seq}, at::kLong);
    at::Tensor labels = at::from_blob(b.labels.data(), {cfg.batch(), cfg.seq}, at::kLong);
    StepLoss rl = ref.forward_backward(ids, labels, cfg.accumulation);
    INFO("tied " << tied << ", base " << base_format_name(f));
    CHECK(rep.loss == rl.loss);
    size_t i = 0, trained = 0;
    for (int64_t blk = 0; blk < spec.num_blocks(); ++blk) {
      const ParamLayout layout = spec.layout(blk);  // named: slots() refers into it
      for (const TensorSlot& t : layout.slots()) {
        INFO(t.name);
        std::vector<float> p = before[i++], mm(p.size(), 0), vv(p.size(), 0);
        const std::vector<float> got = e.param(t.name);
        if (!t.trainable) {  // frozen: as it was, and the reference computed no gradient for it
          CHECK(std::memcmp(got.data(), p.data(), p.size() * 4) == 0);
          CHECK(ref.grad(t.name).abs().max().item<float>() == 0);
          continue;
        }
        ++trained;
        at::Tensor g = ref.grad(t.name).contiguous();
        CHECK(g.abs().max().item<float>() > 0);
        AdamHyper h = cfg.adam;
        if (!weight_decays(t.name)) h.weight_decay = 0;
        adam_update(Isa::kScalar, AdamStep::make(h, 1),
                    {p.data(), mm.data(), vv.data(), g.data_ptr<float>(), DType::kF32, nullptr, p.size()});
        CHECK(std::memcmp(got.data(), p.data(), p.size() * 4) == 0);
      }
    }
    CHECK(trained == size_t(3 * 14 + (tied ? 0 : 1)));
  }
}

TEST_CASE("LoRA on the simulated RTX 4090: less compute, the adapters' D2H and optimizer only", "[lora][sim]") {
  // Llama-3.1-8B, 8 sequences of 1024: the frozen base computes no weight
  // gradient (the backward is about half its compute), sends only the
  // adapters' gradients and updates only them.
  auto predict = [](const std::string& lora) {
    EngineConfig cfg;
    cfg.seq = 1024;
    cfg.accumulation = 8;
    cfg.window = 2;
    cfg.clip_norm = 1.0;
    cfg.lora = lora;
    Engine e(ModelSpec::from_json(model_preset("llama-3.1-8b"), "llama-3.1-8b"), cfg,
             make_device({.spec = "sim:rtx4090", .budget_bytes = 24ull << 30, .record_spans = true}));
    std::vector<int64_t> ids(size_t(cfg.batch() * cfg.seq), 0), labels(ids.size(), 0);
    StepReport r;
    for (int i = 0; i < 3; ++i) r = e.step(ids.data(), labels.data());
    return r;
  };
  const StepReport full = predict(""), lora = predict("r=16,alpha=32,targets=all-linear");
  const double full_compute = full.stats.lanes[size_t(Lane::kCompute)].busy_s;
  const double lora_compute = lora.stats.lanes[size_t(Lane::kCompute)].busy_s;
  // Recompute + backward: 3 forwards in full training, 2 with a frozen base
  // (plus the adapters' and the head's share): between 0.6 and 0.8 of it.
  CHECK(lora_compute < 0.8 * full_compute);
  CHECK(lora_compute > 0.6 * full_compute);
  CHECK(lora.d2h_bytes * 50 < full.d2h_bytes);  // r=16 adapters: 0.5% of the parameters
  CHECK(lora.stats.lanes[size_t(Lane::kOptimizer)].busy_s * 50 < full.stats.lanes[size_t(Lane::kOptimizer)].busy_s);
  CHECK(lora.tokens_per_s > full.tokens_per_s);
}

TEST_CASE("LoRA: the plan's activation choice prices a backward of input gradients", "[lora][plan]") {
  // Llama-3.1-8B, 8 sequences of 1024: recompute costs the forward again on
  // top of the backward, which under a frozen base is about the forward, not
  // twice it; kept activations spare that recompute either way.
  const ModelSpec full = ModelSpec::from_json(model_preset("llama-3.1-8b"), "llama-3.1-8b");
  const ModelSpec lora = with_lora(full, "r=16,alpha=32,targets=all-linear");
  PlanLimits l;
  l.seq = 1024;
  l.accumulation = 8;
  l.compute_flops_per_s = 80e12;
  l.link_bytes_per_s = 25e9;
  const ActivationCost f = activation_cost(full, l, 1 << 30), a = activation_cost(lora, l, 1 << 30);
  CHECK(f.backward_flops == Approx(2 * f.forward_flops));
  CHECK(a.backward_flops < 0.6 * f.backward_flops);
  CHECK(a.recompute_s < f.recompute_s);
  CHECK(a.recompute_s - a.saved_s < f.recompute_s - f.saved_s);  // keeping pays less: a cheaper backward hides its bytes less
}

TEST_CASE("LoRA: a base too large for the RAM is refused naming its compute copy, not the optimizer state",
          "[lora][plan]") {
  // Llama-3.1-70B in bf16 is 131.80 GiB of compute copy: 128 GiB of RAM cannot hold it, and NVMe, which takes
  // optimizer state, would not help; 256 GiB can.
  const ModelSpec spec = ModelSpec::from_json(model_preset("llama-3.1-70b"), "llama-3.1-70b");
  PlanLimits l;
  l.seq = 1024;
  l.accumulation = 16;
  l.device_bytes = uint64_t(24) << 30;
  l.lora = "r=16,alpha=32,targets=all-linear";
  l.host_bytes = uint64_t(128) << 30;
  for (const std::string nvme : {"", "/tmp/strider-lora-plan-nvme"}) {
    l.nvme_dir = nvme;
    const Plan p = Plan::make(spec, l);
    CHECK_FALSE(p.feasible);
    CHECK_THAT(p.reason, Catch::Contains("131.80 GiB of it the frozen base's compute copy (bf16"));
  }
  l.nvme_dir.clear();
  l.host_bytes = uint64_t(256) << 30;
  CHECK(Plan::make(spec, l).feasible);
}

TEST_CASE("the reference's log-probabilities are LoRA's frozen base's or the kept starting weights', on one device and a pool",
          "[lora][engine]") {
  for (const char* devices : {"1", "2"}) {
    INFO("devices " << devices);
    EngineConfig cfg = small_bf16();
    cfg.compute.dtype = at::kFloat;
    cfg.window = 2;
    DeviceOptions dopt{.spec = "cpu", .budget_bytes = size_t(64) << 20, .chaos = {.enabled = true, .seed = 5}};
    EngineConfig with = cfg;
    with.lora = kAllLinear;
    Engine adapted(tiny(false), with, make_devices(dopt, devices));
    adapted.init_params(7);
    move_lora_b(adapted);  // adapters that change the answer
    Engine base(tiny(false), cfg, make_devices(dopt, devices));
    base.init_params(7);  // the same values: initial_values is per tensor name and seed
    for (int64_t b = 0; b < base.spec().num_blocks(); ++b) {  // as the compute copies hold them
      const std::span<std::byte> mine = base.compute_copy(b), theirs = adapted.compute_copy(b);
      REQUIRE(theirs.size() >= mine.size());
      REQUIRE(std::memcmp(mine.data(), theirs.data(), mine.size()) == 0);
    }
    const Batch x = batch(cfg.batch(), cfg.seq, adapted.spec().dims.vocab, 31);
    const std::vector<float> reference = adapted.logprobs(x.ids.data(), x.labels.data(), nullptr, nullptr, true);
    CHECK(reference == base.logprobs(x.ids.data(), x.labels.data()));
    CHECK(reference != adapted.logprobs(x.ids.data(), x.labels.data()));
  }
  EngineConfig plain;
  plain.seq = 9;
  Engine full(tiny(false), plain, make_devices({.spec = "cpu"}, "1"));
  const Batch x = batch(full.config().batch(), full.config().seq, full.spec().dims.vocab, 31);
  CHECK_THROWS_WITH(full.logprobs(x.ids.data(), x.labels.data(), nullptr, nullptr, true),
                    Catch::Contains("keeps no copy of its starting weights; build it with keep_reference"));
  // Full training with keep_reference: the reference is the starting weights, kept while the compute copy
  // moves, on one device and a pool with chaos.
  for (const char* pool : {"1", "2"}) {
    EngineConfig kept = plain;
    kept.keep_reference = true;
    kept.adam.lr = 1e-2;
    Engine e(tiny(false), kept, make_devices({.spec = "cpu", .chaos = {.enabled = true, .seed = 6}}, pool));
    e.init_params(7);
    const std::vector<float> start = e.logprobs(x.ids.data(), x.labels.data());
    for (uint64_t s = 0; s < 2; ++s) {
      const Batch b = batch(e.config().batch(), e.config().seq, e.spec().dims.vocab, 40 + s);
      e.step(b.ids.data(), b.labels.data());
    }
    CHECK(e.logprobs(x.ids.data(), x.labels.data(), nullptr, nullptr, true) == start);
    CHECK(e.logprobs(x.ids.data(), x.labels.data()) != start);
  }
}
