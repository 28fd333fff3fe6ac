// Rows that pack documents (EngineConfig::packed_documents, Engine::step's
// positions) on CpuDevice: every placement gives the resident run's bits, the
// resident reference computes the same loss, and bad positions are refused.
#include "tests/catch_torch.h"
#include <nlohmann/json.hpp>

#include "engine/run/engine.h"
#include "tests/engine/engine_cases.h"

using namespace strider;
using namespace strider::test;

TEST_CASE("packed documents: offload and pools change nothing, and the resident reference agrees", "[engine]") {
  // Rows that pack documents (engine_cases.h, packed_positions): attention
  // masked per row, RoPE at each document's positions; a micro-batch of
  // plain rows beside them. Llama, Gemma 3's sliding window, Gemma 2's
  // soft-capped (tiled) attention. That they train as transformers does with
  // packed position_ids is tests/python/test_packed_documents.py's.
  nlohmann::json gemma3 = test::tiny_config(true);
  gemma3["architectures"] = {"Gemma3ForCausalLM"};
  gemma3.update({{"head_dim", 12}, {"query_pre_attn_scalar", 10}, {"sliding_window", 4},
                 {"layer_types", {"sliding_attention", "full_attention", "sliding_attention"}}});
  nlohmann::json gemma2 = test::tiny_config(true);
  gemma2["architectures"] = {"Gemma2ForCausalLM"};
  gemma2.update({{"sliding_window", 4}, {"attn_logit_softcapping", 2.0}, {"final_logit_softcapping", 3.0}});
  for (const auto& [config, name] : {std::pair{test::tiny_config(false), "tiny"}, std::pair{gemma3, "tiny gemma3"},
                                     std::pair{gemma2, "tiny gemma2"}}) {
    const ModelSpec spec = ModelSpec::from_json(config, name);
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      INFO(name << (dtype == at::kFloat ? " fp32" : " bf16"));
      Case resident{"all resident", spec.num_blocks()};
      const Result plain = run(spec, resident, dtype, 0.5);
      resident.packed = true;
      const Result ref = run(spec, resident, dtype, 0.5);
      CHECK(ref.losses.front() != plain.losses.front());  // the documents change what a token sees
      placements_change_nothing(spec, dtype, ref, /*packed=*/true);

      // The first step's loss is the resident model's with the same positions.
      EngineConfig cfg = small_bf16();
      cfg.compute.dtype = dtype;
      cfg.packed_documents = true;
      const auto [engine_loss, resident_loss] = first_step_losses(spec, cfg);
      CHECK(engine_loss == resident_loss);
    }
  }
}

TEST_CASE("positions outside the sequence, or packed without the config, are refused before any work", "[engine]") {
  const ModelSpec spec = tiny(false);
  EngineConfig cfg = small_bf16();
  Engine plain(spec, cfg, make_device({.spec = "cpu"}));
  plain.init_params(1);
  Batch b = batch(cfg.batch(), cfg.seq, spec.dims.vocab, 3);
  std::vector<int64_t> pos = packed_positions(cfg.batch(), cfg.seq);
  CHECK_THROWS_WITH(plain.step(b.ids.data(), b.labels.data(), pos.data()),
                    Catch::Contains("micro-batch 0 packs several documents") && Catch::Contains("packed_documents"));
  std::vector<int64_t> arange;  // 0..seq-1 in every row: accepted without the config
  for (int64_t i = 0; i < cfg.batch() * cfg.seq; ++i) arange.push_back(i % cfg.seq);
  CHECK_NOTHROW(plain.step(b.ids.data(), b.labels.data(), arange.data()));
  cfg.packed_documents = true;
  Engine packed(spec, cfg, make_device({.spec = "cpu"}));
  packed.init_params(1);
  pos[20] = cfg.seq;
  CHECK_THROWS_WITH(packed.step(b.ids.data(), b.labels.data(), pos.data()),
                    Catch::Contains("position 9 at token 20 of the batch is outside [0, seq = 9)"));
  CHECK(packed.steps_done() == 0);
}
