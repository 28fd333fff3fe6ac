// bench_work_memory: ATen's working memory inside each kind of block visit,
// measured on the CPU device (each compute op's peak above its start, every
// ATen CPU allocation of every thread counted: gpu/memory/aten_memory.h), next to
// the plan's estimate of it (ModelSpec::cost: forward_work_bytes,
// backward_work_bytes), for a few sequence lengths. For calibrating the plan's
// model; a benchmark, not a test: it prints and never fails on the figures.
// The last line is one JSON object.
//
// What the CPU counts is ATen's CPU allocations: a CUDA run allocates through
// other kernels (cuBLAS and the attention kernels pick their own algorithms and
// workspaces), so these figures say how the estimate scales, and by how much
// it errs on the CPU, not what a GPU needs to the byte.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <random>
#include <sstream>

#include "engine/model/builtin.h"
#include "engine/plan/plan.h"
#include "engine/run/engine.h"

using namespace strider;

namespace {

// The built-in model (hidden 256, 8/4 heads of 32, vocabulary 2048), and a
// wider one (hidden 1024, 16/8 heads of 64, intermediate 2816, vocabulary
// 8192, one layer): heads of a real model's size and a vocabulary that
// outweighs a layer, small enough for a CPU to step through at seq 1024.
nlohmann::json model_config(const std::string& name, int64_t max_seq) {
  nlohmann::json c = builtin_model_config();
  if (name == "wide") {
    c["hidden_size"] = 1024;
    c["intermediate_size"] = 2816;
    c["num_hidden_layers"] = 1;
    c["num_attention_heads"] = 16;
    c["num_key_value_heads"] = 8;
    c["vocab_size"] = 8192;
  } else if (name != "builtin") {
    throw std::runtime_error("--models: " + name + " is not builtin or wide");
  }
  c["max_position_embeddings"] = std::max<int64_t>(c["max_position_embeddings"].get<int64_t>(), max_seq);
  return c;
}

const char* kind_name(BlockKind k) {
  switch (k) {
    case BlockKind::kEmbedding: return "embedding";
    case BlockKind::kLayer: return "layer";
    case BlockKind::kHead: return "head";
  }
  return "?";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_work_memory: ATen's working memory per block visit on the CPU device vs ModelSpec::cost"};
  std::vector<int64_t> seqs{256, 1024};
  std::vector<std::string> models{"builtin", "wide"};
  int64_t micro_batch = 1, vocab_chunk = 8192;
  app.add_option("--seqs", seqs, "sequence lengths")->delimiter(',');
  app.add_option("--models", models, "builtin, wide")->delimiter(',');
  app.add_option("--micro-batch", micro_batch);
  app.add_option("--vocab-chunk", vocab_chunk);
  CLI11_PARSE(app, argc, argv);

  nlohmann::json out = nlohmann::json::array();
  for (const std::string& model : models) {
    for (int64_t seq : seqs) {
      const ModelSpec spec = ModelSpec::from_json(model_config(model, seq), model);
      EngineConfig cfg;
      cfg.seq = seq;
      cfg.micro_batch = micro_batch;
      cfg.accumulation = 1;
      cfg.compute.vocab_chunk = vocab_chunk;
      cfg.window = 2;
      cfg.optimizer_threads = 1;
      const EngineFootprint fp = footprint(spec, cfg);
      Engine e(spec, cfg,
               make_device({.spec = "cpu", .budget_bytes = size_t(fp.device_bytes + (64 << 20)), .record_spans = true}));
      e.init_params(1);
      std::mt19937 rng(5);
      std::vector<int64_t> ids(size_t(cfg.batch() * seq)), labels(ids.size());
      // Step 1 warms up (oneDNN's primitive caches and the like stay allocated
      // once made); step 2 is measured.
      StepReport r;
      for (int s = 0; s < 2; ++s) {
        for (size_t i = 0; i < ids.size(); ++i) {
          ids[i] = int64_t(rng() % uint64_t(spec.dims.vocab));
          labels[i] = int64_t(rng() % uint64_t(spec.dims.vocab));
        }
        r = e.step(ids.data(), labels.data());
      }
      e.finish_updates();
      // The largest per (op, block kind) in the measured step.
      std::map<std::pair<std::string, BlockKind>, uint64_t> measured;
      for (const Span& s : e.timeline().spans()) {
        if (s.lane != Lane::kCompute || s.step != r.step || s.block < 0 || s.name == "zero grads") continue;
        auto& m = measured[{s.name, spec.block(s.block).kind}];
        m = std::max(m, s.work_peak_bytes);
      }
      fmt::print("{} ({}), micro-batch {} x seq {}, bf16, vocab chunk {}: step {:.2f} s, work peak {}\n", model,
                 spec.summary(), micro_batch, seq, vocab_chunk, r.step_s, format_bytes(r.work_peak_bytes));
      fmt::print("  {:<20} {:<10} {:>12} {:>14} {:>15} {:>9}\n", "op", "block", "measured", "forward_work",
                 "backward_work", "measured/estimate");
      for (const auto& [key, bytes] : measured) {
        const auto& [op, kind] = key;
        int64_t b = 0;
        while (spec.block(b).kind != kind) ++b;
        const BlockCost c = spec.cost(b, micro_batch, seq, vocab_chunk, 2);
        // forward: the forward estimate; recompute+backward: the backward's;
        // the head's one op runs its loss forward and backward: the larger.
        const int64_t estimate = op == "forward"              ? c.forward_work_bytes
                                 : op == "recompute+backward" ? c.backward_work_bytes
                                                              : std::max(c.forward_work_bytes, c.backward_work_bytes);
        const double ratio = estimate > 0 ? double(bytes) / double(estimate) : 0.0;
        fmt::print("  {:<20} {:<10} {:>12} {:>14} {:>15} {:>9.2f}\n", op, kind_name(kind), format_bytes(bytes),
                   format_bytes(uint64_t(c.forward_work_bytes)), format_bytes(uint64_t(c.backward_work_bytes)), ratio);
        out.push_back({{"model", model}, {"seq", seq}, {"micro_batch", micro_batch}, {"vocab_chunk", vocab_chunk},
                       {"op", op}, {"block", kind_name(kind)}, {"measured_bytes", bytes},
                       {"forward_work_bytes", c.forward_work_bytes}, {"backward_work_bytes", c.backward_work_bytes},
                       {"estimate_bytes", estimate}});
      }
      std::fflush(stdout);
    }
  }
  fmt::print("{}\n", nlohmann::json{{"bench", "work_memory"}, {"device", "cpu"}, {"rows", out}}.dump());
  return 0;
}
