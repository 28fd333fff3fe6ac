// Long context on the CPU device: a small Llama (2 layers, grouped-query
// attention, tied embeddings, K = 2 of 4 blocks, 2 vocabulary shards) trains
// at a sequence of 32768 in the tiles its plan picks (the head and the
// layers in token tiles, their attention in query tiles), under a device
// whose ATen working-memory limit is the plan's own figure: every visit's
// measured peak must stay within it (the limit fails any op that would pass
// it), and the figure must not be padded (the largest visit reaches 0.7 of
// it).
#include "tests/catch_torch.h"

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>

#include "engine/plan/plan.h"
#include "engine/run/engine.h"
#include "tests/engine/tiny_model.h"

using namespace strider;

TEST_CASE("a 32768-token sequence trains in query tiles with every visit's working memory within the plan's figure",
          "[engine][memory][long]") {
  // The cost model counts the CPU flash kernel's scratch for 2 threads.
  at::set_num_threads(2);
  const nlohmann::json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 64},
                              {"intermediate_size", 160}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                              {"num_key_value_heads", 2}, {"vocab_size", 256}, {"max_position_embeddings", 32768},
                              {"rms_norm_eps", 1e-5}, {"tie_word_embeddings", true}};
  const ModelSpec spec = ModelSpec::from_json(cfg, "long-context llama");
  PlanLimits l{.device_bytes = 128ull << 20, .seq = 32768, .micro_batch = 1, .accumulation = 1,
               .dtype = at::kFloat, .vocab_chunk = 64, .window = 2, .vocab_shard_rows = 128};
  const Plan p = Plan::make(spec, l);
  INFO(p.explain());
  REQUIRE(p.feasible);
  REQUIRE(p.token_tile > 0);  // chosen: untiled does not fit
  CHECK(attention_query_tile(spec.dims, 1, l.seq, p.token_tile) < l.seq);
  EngineConfig c = p.engine_config(l);
  c.adam = {.lr = 1e-2};
  c.clip_norm = 1.0;
  c.optimizer_threads = 1;
  Engine e(spec, c,
           make_device({.spec = "cpu", .budget_bytes = l.device_bytes, .record_spans = true,
                        .work_limit_bytes = p.device_work_bytes}));
  REQUIRE(e.sharding().shards == 2);
  e.init_params(11);
  // One sequence of ids that repeat with a short period: learnable at once.
  std::vector<int64_t> ids(size_t(l.seq)), labels(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int64_t((i * 7) % 31);
  for (size_t i = 0; i + 1 < ids.size(); ++i) labels[i] = ids[i + 1];
  labels.back() = -100;
  const StepReport r1 = e.step(ids.data(), labels.data());
  const StepReport r2 = e.step(ids.data(), labels.data());
  CHECK(std::isfinite(r1.loss));
  CHECK(r2.loss < r1.loss);
  uint64_t most = 0;
  for (const Span& sp : e.timeline().spans())
    if (sp.lane == Lane::kCompute) {
      INFO(sp.name << " block " << sp.block << ": " << sp.work_peak_bytes << " of " << p.device_work_bytes);
      CHECK(sp.work_peak_bytes <= p.device_work_bytes);
      most = std::max(most, sp.work_peak_bytes);
    }
  std::printf("seq %lld: token tile %lld, attention query tile %lld; the largest visit's working memory %llu of the "
              "plan's %llu bytes (%.3f)\n", (long long)l.seq, (long long)p.token_tile,
              (long long)attention_query_tile(spec.dims, 1, l.seq, p.token_tile), (unsigned long long)most,
              (unsigned long long)p.device_work_bytes, double(most) / double(p.device_work_bytes));
  CHECK(most >= 0.7 * double(p.device_work_bytes));
  CHECK(e.device().peak_allocated_bytes() <= p.device_buffer_bytes);
}
