// The sliding-window engine on CpuDevice: "offload changes nothing" (bit-identical
// parameters and optimizer state whatever K, the tiers, where checkpoints live
// or chaos delays), "same maths" as the resident reference + AdamW, and "the
// budget holds".
#include "tests/catch_torch.h"
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>

#include "engine/run/engine.h"
#include "engine/run/resident_model.h"
#include "host/error.h"
#include "tests/engine/engine_cases.h"

using namespace strider;
using namespace strider::test;

TEST_CASE("offload changes nothing: bit-identical across K, tiers, checkpoints and chaos", "[engine]") {
  for (bool tied : {false, true}) {
    for (double clip : {0.0, 0.5}) {
      ModelSpec spec = tiny(tied);
      Result ref = run(spec, {"reference: all resident", spec.num_blocks()}, at::kFloat, clip);
      CHECK(ref.losses.back() < ref.losses.front());  // it trains
      for (const Case& c : cases(spec.num_blocks())) {
        INFO("tied=" << tied << " clip=" << clip << " case: " << c.name);
        Result r = run(spec, c, at::kFloat, clip);
        CHECK(same_bits(r, ref));
        CHECK(r.peak <= r.budget);
      }
    }
  }
}

TEST_CASE("a pool of 2 and 3 CPU devices trains to one device's bits", "[engine][pool]") {
  // Block b's visits run on device b % N; block inputs and output gradients
  // are handed between devices through pinned host memory, and every
  // device has its own streams, units, budget and chaos. With 3 devices
  // and 5 blocks, the head's first shard runs on device 1 and layer 3 on
  // device 0; its vocabulary shards (3 and 2 in the cases that give rows, at
  // least as many as devices otherwise) go on over the devices, handing on
  // their state, log-sum-exp and hidden gradient. Training and evaluation.
  for (bool tied : {false, true}) {
    for (double clip : {0.0, 0.5}) {
      ModelSpec spec = tiny(tied);
      Result ref = run(spec, {"reference: all resident", spec.num_blocks()}, at::kFloat, clip);
      for (int n : {2, 3})
        for (Case c : cases(spec.num_blocks())) {
          // Of the compute-copy cases, the first (every layer's copy on NVMe, chaos) is enough for a pool.
          if (!c.nvme_compute.empty() && c.nvme_compute.size() < 3) continue;
          c.devices = n;
          c.seed += 100;  // other delays than the one-device cases'
          INFO("tied=" << tied << " clip=" << clip << " devices=" << n << " case: " << c.name);
          Result r = run(spec, c, at::kFloat, clip);
          CHECK(same_bits(r, ref));
          CHECK(r.eval_loss == ref.eval_loss);
          CHECK(r.peak <= r.budget);
        }
    }
  }
}

TEST_CASE("a pool of devices with bf16 gradients and q8 state: still one device's bits", "[engine][pool][q8]") {
  for (bool tied : {false, true})
    for (double clip : {1.0, 0.0})
      for (StateFormat format : {StateFormat::kFp32, StateFormat::kQ8}) {
        ModelSpec spec = tiny(tied);
        const int64_t B = spec.num_blocks();
        Result ref = run(spec, {"all resident", B}, at::kBFloat16, clip, 3, format);
        for (Case c : {Case{"K=2", 2}, Case{"chaos, host ckpt, NVMe", 2, true, {1, 2}, true, 5},
                       Case{"3 vocabulary shards, chaos, NVMe, ring of 1", 2, false, {0, 2, 4}, true, 7, 1, 40},
                       Case{"kept activations and logits, 2 vocabulary shards, chaos", 3, false, {2}, true, 6, 2, 80,
                            {1, 2, 3}, true}})
          for (int n : {2, 3}) {
            c.devices = n;
            INFO(c.name << " devices " << n << " tied " << tied << " clip " << clip << " "
                        << state_format_name(format));
            Result r = run(spec, c, at::kBFloat16, clip, 3, format);
            CHECK(same_bits(r, ref));
            CHECK(r.peak <= r.budget);
          }
      }
}

TEST_CASE("bf16 compute: offload still changes nothing", "[engine]") {
  // Gradients cross in bf16 (summed in fp32 on the device first), through own
  // buffers, the ring and NVMe spills alike.
  for (double clip : {1.0, 0.0}) {
    ModelSpec spec = tiny(false);
    Result ref = run(spec, {"all resident", spec.num_blocks()}, at::kBFloat16, clip);
    for (const Case& c : {Case{"K=2", 2}, Case{"chaos, host ckpt, NVMe", 2, true, {1, 2}, true, 5},
                          Case{"3 vocabulary shards, chaos, NVMe, ring of 1", 2, false, {0, 2, 4}, true, 7, 1, 40},
                          Case{"kept activations, chaos, host ckpt", 2, true, {}, true, 11, 3, 0, {1, 2, 3}},
                          Case{"kept activations in layer 1, chaos, K=3", 3, false, {}, true, 12, 3, 0, {1}},
                          Case{"kept logits, 2 vocabulary shards, chaos", 2, false, {}, true, 13, 3, 80, {}, true},
                          with_compute_on_nvme({"compute copies on NVMe, chaos, host ckpt", 2, true, {1, 2, 3}, true,
                                                16}, {1, 3})}) {
      INFO(c.name << " clip " << clip);
      CHECK(same_bits(run(spec, c, at::kBFloat16, clip), ref));
    }
  }
}


TEST_CASE("Granite's multipliers: offload and pools still change nothing", "[engine]") {
  // The embedding's scale (its shards', forward and backward), the
  // attention scale, the scaled residual branches (recomputed and kept) and
  // the divided logits (recomputed and kept) give the same bits however the
  // model is placed.
  nlohmann::json config = test::tiny_config(true);
  config["architectures"] = {"GraniteForCausalLM"};
  config.update({{"embedding_multiplier", 6.0}, {"attention_multiplier", 0.3}, {"residual_multiplier", 0.4},
                 {"logits_scaling", 3.0}});
  const ModelSpec spec = ModelSpec::from_json(config, "tiny granite");
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const Result ref = run(spec, {"all resident", spec.num_blocks()}, dtype, 0.5);
    CHECK(ref.losses.back() < ref.losses.front());
    placements_change_nothing(spec, dtype, ref);
  }
}

TEST_CASE("Gemma 2, Gemma 3 and OLMo 2: offload and pools still change nothing", "[engine]") {
  // Gemma 3: sandwich norms as 1 + w, GELU-tanh, the embedding scale in the
  // weights' dtype, q/k norms, a sliding window (4) below the sequence (9)
  // on layers 0 and 2 with their own RoPE, a padding token. OLMo 2: norms
  // after the branches (recomputed and kept), q/k norms over the whole
  // projections. Gemma 2: soft-capped attention scores (tiled attention) and
  // logits (recomputed and kept). Every placement gives the resident run's bits.
  nlohmann::json gemma = test::tiny_config(true);
  gemma["architectures"] = {"Gemma3ForCausalLM"};
  gemma.update({{"head_dim", 12}, {"query_pre_attn_scalar", 10}, {"sliding_window", 4}, {"pad_token_id", 3},
                {"layer_types", {"sliding_attention", "full_attention", "sliding_attention"}},
                {"rope_parameters", {{"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 100.0}}},
                                     {"full_attention", {{"rope_type", "default"}, {"rope_theta", 5000.0}}}}}});
  nlohmann::json olmo = test::tiny_config(false);
  olmo["architectures"] = {"Olmo2ForCausalLM"};
  nlohmann::json gemma2 = test::tiny_config(true);
  gemma2["architectures"] = {"Gemma2ForCausalLM"};
  gemma2.update({{"sliding_window", 4}, {"attn_logit_softcapping", 2.0}, {"final_logit_softcapping", 3.0}});
  for (const auto& [config, name] : {std::pair{gemma, "tiny gemma3"}, std::pair{olmo, "tiny olmo2"},
                                     std::pair{gemma2, "tiny gemma2"}}) {
    const ModelSpec spec = ModelSpec::from_json(config, name);
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      // That they train as transformers + AdamW do is tests/python/test_engine_vs_torch.py's.
      const Result ref = run(spec, {"all resident", spec.num_blocks()}, dtype, 0.5);
      INFO(name);
      CHECK(std::isfinite(ref.eval_loss));
      placements_change_nothing(spec, dtype, ref);
    }
  }
}

TEST_CASE("q8 optimizer state: offload changes nothing, and it trains as fp32 does", "[engine][q8]") {
  // The q8 format's stochastic rounding hashes (step, block, element), not
  // the piece or the thread: K, tiers, shards, ring and chaos change no bit.
  for (bool tied : {false, true}) {
    for (double clip : {1.0, 0.0}) {
      ModelSpec spec = tiny(tied);
      const int64_t B = spec.num_blocks();
      Result ref = run(spec, {"all resident", B}, at::kBFloat16, clip, 4, StateFormat::kQ8);
      Result fp32 = run(spec, {"all resident", B}, at::kBFloat16, clip, 4, StateFormat::kFp32);
      INFO("tied=" << tied << " clip=" << clip);
      CHECK(ref.losses.back() < ref.losses.front());
      CHECK_FALSE(same_bits(ref, fp32));  // q8 really ran: the comparisons below can fail
      for (size_t i = 0; i < ref.losses.size(); ++i) CHECK(ref.losses[i] == Approx(fp32.losses[i]).epsilon(0.02));
      for (const Case& c : {Case{"K=2", 2}, Case{"K=3, host checkpoints", 3, true},
                            Case{"state of blocks 1 and 3 on NVMe, chaos", 2, false, {1, 3}, true, 3},
                            Case{"all state on NVMe, ring of 1, 3 vocabulary shards", 2, true, {0, 1, 2, 3, 4}, false,
                                 1, 1, 40},
                            Case{"3 vocabulary shards, chaos, NVMe head and embedding", 2, false, {0, B - 1}, true, 5,
                                 3, 40},
                            Case{"kept activations and logits, 2 vocabulary shards, chaos", 2, false, {2}, true, 6, 2,
                                 80, {1, 2, 3}, true},
                            with_compute_on_nvme({"compute copies of every layer on NVMe, chaos", 2, false,
                                                  {0, 1, 2, 3, 4}, true, 7}, {1, 2, 3}),
                            with_compute_on_nvme({"compute copy of layer 2 on NVMe, K=3, host checkpoints, ring of 1",
                                                  3, true, {2, 3}, false, 1, 1}, {2})}) {
        INFO(c.name);
        Result r = run(spec, c, at::kBFloat16, clip, 4, StateFormat::kQ8);
        CHECK(same_bits(r, ref));
        CHECK(r.peak <= r.budget);
      }
    }
  }
}

TEST_CASE("a piece of two ranges trains to the bits of the same ranges cut as two pieces", "[engine][pieces]") {
  // "layernorm": one piece of two ranges of each layer (input_layernorm,
  // post_attention_layernorm), with the projections another two
  // (self_attn, mlp). Cut apart, the norms are two pieces of one range each.
  // Every operation a piece has (its H2D, its gradients' D2H, their landing,
  // sums of squares, ring slot and NVMe spill, AdamW, its state on NVMe)
  // works range by range; the layer's visit still sees the block's layout.
  const std::string two_ranges = "layernorm,self_attn+mlp", cut = "input_layernorm,post_attention_layernorm,self_attn+mlp";
  for (bool tied : {false, true}) {
    ModelSpec spec = tiny(tied);
    const int64_t B = spec.num_blocks();
    {
      EngineConfig cfg = small_bf16();
      cfg.layer_pieces = two_ranges;
      Engine e(spec, cfg, make_device({.spec = "cpu"}));
      const Sharding& sh = e.sharding();
      REQUIRE(sh.end_of(1) - sh.first_of(1) == 2);
      CHECK(sh.pieces[size_t(sh.first_of(1))].ranges.size() == 2);      // the norms
      CHECK(sh.pieces[size_t(sh.first_of(1)) + 1].ranges.size() == 2);  // the projections
      CHECK(sh.name(spec, sh.first_of(1)) == "layer.0[layernorm]");
    }
    for (double clip : {0.0, 0.5}) {
      // One piece per layer: the bits without clipping (with it, the norm
      // adds its parts range by range, so it may round apart).
      const Result whole = run(spec, {"all resident", B}, at::kFloat, clip);
      for (Case c : {Case{"K=2", 2}, Case{"chaos, host checkpoints, NVMe layers, ring of 1", 2, true, {1, 3}, true, 3, 1},
                     Case{"all state on NVMe, 3 vocabulary shards, chaos", 3, false, {0, 1, 2, 3, 4}, true, 4, 2, 40},
                     Case{"kept activations, K=3, chaos", 3, false, {}, true, 5, 3, 0, {1, 2, 3}}}) {
        INFO("tied=" << tied << " clip=" << clip << " case: " << c.name);
        c.layer_pieces = two_ranges;
        const Result a = run(spec, c, at::kFloat, clip);
        c.layer_pieces = cut;
        const Result b = run(spec, c, at::kFloat, clip);
        CHECK(a.losses.back() < a.losses.front());
        CHECK(same_bits(a, b));
        if (clip == 0) CHECK(same_bits(a, whole));
        CHECK(a.peak <= a.budget);
      }
    }
    // q8 state: its groups and their scales, in RAM and on NVMe, range by range.
    for (double clip : {0.0, 1.0}) {
      INFO("q8, tied=" << tied << " clip=" << clip);
      Case q{"q8, NVMe layers, chaos", 2, false, {1, 2}, true, 6};
      const Result whole_q8 = run(spec, q, at::kBFloat16, clip, 3, StateFormat::kQ8);
      q.layer_pieces = two_ranges;
      const Result a = run(spec, q, at::kBFloat16, clip, 3, StateFormat::kQ8);
      q.layer_pieces = cut;
      CHECK(same_bits(a, run(spec, q, at::kBFloat16, clip, 3, StateFormat::kQ8)));
      if (clip == 0) CHECK(same_bits(a, whole_q8));
    }
  }
}

TEST_CASE("layer pieces are refused naming the tensor or the group", "[engine][pieces]") {
  ModelSpec spec = tiny(false);
  EngineConfig cfg = small_bf16();
  auto refused = [&](const std::string& text) {
    cfg.layer_pieces = text;
    try {
      Engine e(spec, cfg, make_device({.spec = "cpu"}));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  CHECK_THAT(refused("layernorm,self_attn"), Catch::Contains("model.layers.0.mlp.gate_proj.weight matches no group"));
  CHECK_THAT(refused("layernorm,self_attn+mlp,proj"), Catch::Contains("matches two groups, 'self_attn+mlp' and 'proj'"));
  CHECK_THAT(refused("layernorm,self_attn+mlp,experts"), Catch::Contains("group 'experts' matches no tensor"));
  CHECK_THAT(refused("layernorm,,mlp+self_attn"), Catch::Contains("empty name fragment"));
  CHECK(refused("layernorm, self_attn + mlp") == "(accepted)");  // spaces around a fragment are not part of it
}

TEST_CASE("q8 optimizer state: refused with an fp32 compute copy, and vocabulary shards off its groups", "[engine][q8]") {
  ModelSpec spec = tiny(false);
  EngineConfig cfg = small_bf16();
  cfg.optimizer_state = StateFormat::kQ8;
  cfg.compute.dtype = at::kFloat;
  CHECK_THROWS_WITH(Engine(spec, cfg, make_device({.spec = "cpu"})),
                    Catch::Contains("q8 optimizer state keeps the master's high half in the bf16 compute copy"));
  cfg.compute.dtype = at::kBFloat16;
  cfg.vocab_shard_rows = 42;  // 42 x hidden 32 is not a multiple of 128
  CHECK_THROWS_WITH(Engine(spec, cfg, make_device({.spec = "cpu"})),
                    Catch::Contains("give a multiple of 4 rows"));
}

TEST_CASE("gradients cross to the host in bf16: half the bytes, the same training to bf16 rounding", "[engine]") {
  ModelSpec spec = tiny(false);
  auto train = [&](bool fp32_transfer, double* d2h_grad_bytes) {
    EngineConfig cfg = small_bf16();
    cfg.adam = {.lr = 1e-2, .weight_decay = 0.1};
    cfg.clip_norm = 1.0;
    cfg.fp32_grad_transfer = fp32_transfer;
    Engine e(spec, cfg, make_device({.spec = "cpu", .record_spans = true}));
    e.init_params(7);
    std::vector<double> losses;
    for (int s = 0; s < 4; ++s) {
      Batch b = batch(cfg.batch(), cfg.seq, spec.dims.vocab, 100 + s);
      losses.push_back(e.step(b.ids.data(), b.labels.data()).loss);
    }
    for (const Span& sp : e.timeline().spans())
      if (sp.step == 1 && sp.name == "d2h grads") *d2h_grad_bytes += double(sp.bytes);
    return losses;
  };
  double bf16_bytes = 0, fp32_bytes = 0;
  const auto bf16 = train(false, &bf16_bytes), fp32 = train(true, &fp32_bytes);
  size_t elems = 0;  // every parameter (and its padding) crosses once per step
  for (int64_t b = 0; b < spec.num_blocks(); ++b) elems += spec.layout(b).total_elems();
  CHECK(bf16_bytes == double(2 * elems));
  CHECK(fp32_bytes == double(4 * elems));
  CHECK(bf16.front() == fp32.front());  // the first loss precedes any update
  for (size_t i = 0; i < bf16.size(); ++i) CHECK(std::abs(bf16[i] - fp32[i]) <= 2e-2 * fp32[i]);
  CHECK(bf16.back() < bf16.front());
}

TEST_CASE("one engine step equals the resident reference's gradients plus AdamW", "[engine]") {
  // Untied and tied; in vocabulary shards; with token tiles of 5 of a
  // micro-batch's 18 tokens (the last one short) in the layers' MLP and the
  // head, which the engine and the reference share through ComputeOptions.
  // Kept activations in some layers: the resident reference recomputes.
  struct Variant {
    bool tied;
    int64_t shard_rows, tile;
    std::vector<int64_t> saved;
    bool keep_logits = false;
    bool decay_all = false;  // weight decay of norms and biases too
  };
  for (auto [tied, shard_rows, tile, saved, keep_logits, decay_all] :
       {Variant{false, 0, 0}, {true, 0, 0}, {false, 40, 0}, {true, 40, 0}, {false, 40, 5}, {true, 0, 5},
        {false, 0, 0, {1, 2, 3}}, {true, 40, 5, {1, 3}, true}, {false, 40, 0, {}, true}, {true, 40, 0, {}, false, true}}) {
    ModelSpec spec = tiny(tied);
    const Case c{"K=2 chaos", 2, false, {}, true, 9};
    EngineConfig cfg;
    cfg.seq = 9;
    cfg.micro_batch = 2;
    cfg.accumulation = 2;
    cfg.compute = {at::kFloat, 40, tile};
    cfg.adam = {.lr = 1e-2, .weight_decay = 0.1};
    cfg.vocab_shard_rows = shard_rows;
    cfg.saved_blocks = saved;
    cfg.keep_logits = keep_logits;
    cfg.decay_norms_and_biases = decay_all;
    Engine e(spec, cfg, make_device({.spec = "cpu", .chaos = {.enabled = true, .seed = 9}}));
    CHECK(e.sharding().shards == (shard_rows ? 3 : 1));
    e.init_params(3);
    ResidentModel ref(spec, cfg.compute);
    std::vector<std::vector<float>> before;
    for (const std::string& name : ref.param_names()) {
      before.push_back(e.param(name));
      ref.set_param(name, at::from_blob(before.back().data(), ref.param(name).sizes(), at::kFloat));
    }
    Batch b = batch(cfg.batch(), cfg.seq, spec.dims.vocab, 5);
    StepReport rep = e.step(b.ids.data(), b.labels.data());
    at::Tensor ids = at::from_blob(b.ids.data(), {cfg.batch(), cfg.seq}, at::kLong);
    at::Tensor labels = at::from_blob(b.labels.data(), {cfg.batch(), cfg.seq}, at::kLong);
    StepLoss rl = ref.forward_backward(ids, labels, cfg.accumulation);
    INFO("tied=" << tied << " shard rows " << shard_rows << " token tile " << tile << " kept layers "
                 << saved.size() << " kept logits " << keep_logits << " decay all " << decay_all);
    CHECK(rep.loss == rl.loss);
    size_t i = 0;
    for (const std::string& name : ref.param_names()) {
      std::vector<float> p = before[i++], mm(p.size(), 0), vv(p.size(), 0);
      at::Tensor g = ref.grad(name).contiguous();
      AdamHyper h = cfg.adam;
      if (!decay_all && !weight_decays(name)) h.weight_decay = 0;  // norms and biases are spared
      adam_update(Isa::kScalar, AdamStep::make(h, 1),
                  {p.data(), mm.data(), vv.data(), g.data_ptr<float>(), DType::kF32, nullptr, p.size()});
      std::vector<float> got = e.param(name);
      INFO(name);
      CHECK(std::memcmp(got.data(), p.data(), p.size() * 4) == 0);
    }
  }
}

TEST_CASE("the device registers what the engine copies, and every copy of a step lies in it", "[engine]") {
  // On the CPU device a copy whose host side is outside the registered memory
  // throws, as a GPU would copy it unpinned: a step with host checkpoints,
  // kept activations, the gradient ring, the tied embedding and NVMe state
  // passing proves every copy's memory is registered.
  ModelSpec spec = ModelSpec::from_json(test::tiny_config(true), "tiny");
  EngineConfig cfg;
  cfg.seq = 9;
  cfg.micro_batch = 2;
  cfg.accumulation = 2;
  cfg.window = 2;
  cfg.checkpoints_on_host = true;
  cfg.saved_blocks = {2};
  cfg.nvme_blocks = {1};
  cfg.nvme_dir = nvme_dir();
  cfg.clip_norm = 1.0;
  Engine e(spec, cfg, make_device({.spec = "cpu", .chaos = {.enabled = true, .seed = 4}}));
  e.init_params(3);
  // What the plan says the GPU pins is what the engine registered, to the alignment slack.
  const EngineFootprint f = place(spec, cfg).footprint;
  CHECK(e.registered_host_bytes() <= f.registered_host_bytes);
  CHECK(e.registered_host_bytes() + 8 * kHostAlign >= f.registered_host_bytes);
  CHECK(f.registered_host_bytes < f.host_bytes - f.optimizer_host_bytes);
  Batch b = batch(cfg.batch(), cfg.seq, spec.dims.vocab, 5);
  CHECK(std::isfinite(e.step(b.ids.data(), b.labels.data()).loss));
  e.finish_updates();
  // The check is on: the compute copy is registered, a plain buffer is not.
  DeviceBuffer buf = e.device().allocate(256, "probe");
  e.device().copy_h2d(StreamId::kH2D, buf.data(), e.compute_copy(1).data(), 256);
  std::vector<std::byte> plain(256);
  CHECK_THROWS_WITH(e.device().copy_h2d(StreamId::kH2D, buf.data(), plain.data(), 256),
                    Catch::Contains("did not register"));
  e.device().synchronize();
}

TEST_CASE("a compute copy damaged on NVMe stops the step naming its layer and the file", "[engine][nvme]") {
  ModelSpec spec = tiny(false);
  EngineConfig cfg = small_bf16();
  cfg.nvme_blocks = {1, 2, 3};
  cfg.nvme_compute_blocks = {2};
  char tmpl[] = "/tmp/strider-compute-nvme-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  cfg.nvme_dir = tmpl;
  Engine e(spec, cfg, make_device({.spec = "cpu"}));
  e.init_params(7);
  Batch b = batch(cfg.batch(), cfg.seq, spec.dims.vocab, 5);
  CHECK(std::isfinite(e.step(b.ids.data(), b.labels.data()).loss));
  e.finish_updates();
  // Python's view of the model aliases compute copies in RAM: this one has none.
  CHECK_THROWS_WITH(e.compute_copy(2), Catch::Contains("block 2's compute copy lives on NVMe"));
  // Every byte of the state file flipped: the step's first read from it is
  // layer 2's compute copy, before its forward.
  const std::string file = std::string(tmpl) + "/strider-state.bin";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    for (char& c : bytes) c = char(~c);
    f.seekp(0);
    f.write(bytes.data(), std::streamsize(bytes.size()));
  }
  CHECK_THROWS_WITH(e.step(b.ids.data(), b.labels.data()),
                    Catch::Contains("compute copy of layer.1") && Catch::Contains("checksum mismatch") &&
                        Catch::Contains(file));
  std::filesystem::remove_all(tmpl);
}

TEST_CASE("a budget too small for the window fails before any work, with the numbers", "[engine]") {
  ModelSpec spec = tiny(false);
  EngineConfig cfg;
  cfg.seq = 9;
  CHECK_THROWS_WITH(Engine(spec, cfg, make_device({.spec = "cpu", .budget_bytes = 4096})),
                    Catch::Contains("4096") && Catch::Contains("budget"));
  cfg.window = 1;
  CHECK_THROWS_WITH(Engine(spec, cfg, make_device({.spec = "cpu"})), Catch::Contains("K = 1"));
}

TEST_CASE("kept activations cross once each way per layer and micro-batch, and spare the recompute", "[engine]") {
  ModelSpec spec = tiny(false);
  EngineConfig cfg = small_bf16();
  cfg.saved_blocks = {1, 3};
  Engine e(spec, cfg, make_device({.spec = "cpu", .record_spans = true}));
  e.init_params(7);
  for (int s = 0; s < 2; ++s) {
    Batch b = batch(cfg.batch(), cfg.seq, spec.dims.vocab, 100 + s);
    e.step(b.ids.data(), b.labels.data());
  }
  e.finish_updates();
  const uint64_t per_mb = uint64_t(layer_saved_elems(spec.dims, cfg.micro_batch * cfg.seq, 2)) * 2;
  std::map<std::string, uint64_t> bytes;
  std::map<std::string, std::set<int32_t>> blocks;
  for (const Span& sp : e.timeline().spans()) {
    if (sp.step != 1) continue;
    bytes[sp.name] += sp.bytes;
    blocks[sp.name].insert(sp.block);
  }
  CHECK(bytes["d2h activations"] == 2 * 2 * per_mb);  // 2 layers x 2 micro-batches
  CHECK(bytes["h2d activations"] == 2 * 2 * per_mb);
  CHECK(blocks["d2h activations"] == std::set<int32_t>{1, 3});
  CHECK(blocks["backward"] == std::set<int32_t>{1, 3});
  CHECK(blocks["recompute+backward"] == std::set<int32_t>{2});
  const EngineFootprint fp = footprint(spec, cfg);
  CHECK(fp.saved_layers == 2);
  CHECK(fp.saved_bytes_per_layer >= 2 * per_mb);
  CHECK(fp.saved_host_bytes == 2 * fp.saved_bytes_per_layer);
  EngineConfig none = cfg;
  none.saved_blocks.clear();
  const EngineFootprint fp0 = footprint(spec, none);
  CHECK(fp.host_bytes == fp0.host_bytes + fp.saved_host_bytes);
  CHECK(fp.device_bytes >= fp0.device_bytes + 2 * per_mb);
  CHECK(e.arena_bytes() >= fp.host_bytes);  // the arena rounds up to its pages
}

TEST_CASE("kept activations name only decoder layers, once each", "[engine]") {
  ModelSpec spec = tiny(false);
  for (auto [saved, what] : {std::pair{std::vector<int64_t>{0}, "block 0 is not a decoder layer (blocks 1..3 are)"},
                             {{4}, "block 4 is not a decoder layer"},
                             {{2, 2}, "block 2 listed twice"}}) {
    EngineConfig cfg;
    cfg.seq = 9;
    cfg.saved_blocks = saved;
    CHECK_THROWS_WITH(Engine(spec, cfg, make_device({.spec = "cpu"})), Catch::Contains(what));
  }
}

TEST_CASE("kept logits spare one logits GEMM of the head and cost their bytes on the device", "[engine]") {
  ModelSpec spec = tiny(false);
  EngineConfig cfg = small_bf16();
  cfg.vocab_shard_rows = 40;
  auto head_flops = [&](bool keep) {
    EngineConfig c = cfg;
    c.keep_logits = keep;
    Engine e(spec, c, make_device({.spec = "cpu", .record_spans = true}));
    e.init_params(7);
    Batch b = batch(c.batch(), c.seq, spec.dims.vocab, 100);
    e.step(b.ids.data(), b.labels.data());
    e.finish_updates();
    double flops = 0;
    for (const Span& sp : e.timeline().spans())
      if (sp.name == "head backward" || sp.name == "head log-sum-exp") flops += sp.flops;
    return flops;
  };
  const double logits = 2.0 * cfg.batch() * cfg.seq * spec.dims.hidden * spec.dims.vocab;
  CHECK(head_flops(false) == Approx(4 * logits));
  CHECK(head_flops(true) == Approx(3 * logits));
  EngineConfig keep = cfg;
  keep.keep_logits = true;
  const EngineFootprint with = footprint(spec, keep), without = footprint(spec, cfg);
  CHECK(with.logits_bytes >= uint64_t(cfg.batch() * cfg.seq * spec.dims.vocab * 2));
  CHECK(with.device_bytes == without.device_bytes + with.logits_bytes);
  // A pool keeps on each device its own shards' logits: with as many shards
  // as devices, one shard's rows each, and a pool's run gives one device's bits.
  EngineConfig pool = keep;
  pool.devices = 2;
  const Placement pl = place(spec, pool);
  REQUIRE(pl.shards().shards >= 2);
  int64_t most = 0;
  for (int d = 0; d < 2; ++d) most = std::max(most, pl.head_rows(d));
  CHECK(most < spec.dims.vocab);
  CHECK(pl.head_rows(0) + pl.head_rows(1) == spec.dims.vocab);
  CHECK(pl.footprint.logits_bytes ==
        uint64_t(cfg.accumulation) * ((uint64_t(cfg.micro_batch * cfg.seq * most * 2) + 255) / 256 * 256));
}
