// A quantized LoRA base (host/base_format.h, EngineConfig::base_format): the
// int8 and NF4 formats' codes and bytes, the device's dequantization against
// the host's, the program's dequantize operations, offload changing nothing
// with the base quantized, setting one tensor, and what the plan says of
// Llama-3.1-70B. One step against the resident reference on the dequantized
// base: test_lora.cpp.
#include "tests/catch_torch.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "engine/model/model_presets.h"
#include "engine/plan/plan.h"
#include "engine/program/step_program.h"
#include "engine/run/engine.h"
#include "gpu/blocks/base_dequant.h"
#include "host/bf16.h"
#include "tests/engine/engine_cases.h"

using namespace strider;
using namespace strider::test;

namespace {

constexpr const char* kAllLinear = "r=4,alpha=8,targets=all-linear";

// A layout of one 2-D tensor, a norm and a 2-D tensor, all frozen.
ParamLayout three_tensors(int64_t rows, int64_t cols) {
  ParamLayout l("layer");
  l.add("a.weight", {rows, cols}, true, false);
  l.add("norm.weight", {cols}, false, false);
  l.add("b.weight", {cols, rows}, true, false);
  return l;
}

std::vector<float> normal_values(size_t n, uint64_t seed) {
  // Box-Muller over a fixed generator: the same values on every machine.
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(1e-12, 1.0);
  std::vector<float> out(n);
  for (float& x : out) x = float(std::sqrt(-2 * std::log(u(g))) * std::cos(6.283185307179586 * u(g)));
  return out;
}

}  // namespace

TEST_CASE("base formats: int8 per-row absmax and NF4 blocks of 64 hold what they say", "[lora][base]") {
  const ParamLayout l = three_tensors(12, 100);  // 1200 elements: 18.75 NF4 blocks, the last one partial
  const std::vector<float> x = normal_values(l.total_elems(), 3);
  for (BaseFormat f : {BaseFormat::kInt8, BaseFormat::kNf4})
    for (DType raw : {DType::kF32, DType::kBF16}) {
      INFO(base_format_name(f) << " raw " << dtype_name(raw));
      const BaseLayout b = base_layout(l, l.total_elems(), f, raw);
      REQUIRE(b.tensors.size() == 3);
      CHECK(b.tensors[0].quantized);
      CHECK_FALSE(b.tensors[1].quantized);  // the norm rides along in the compute dtype
      CHECK(b.tensors[2].quantized);
      CHECK(b.tensors[0].scales == (f == BaseFormat::kInt8 ? 12u : 19u));
      std::vector<std::byte> q(b.bytes);
      quantize_base(b, x, q);
      std::vector<float> y(l.total_elems(), -1.0f), exact(l.total_elems());
      dequantize_base(b, q, y);
      dequantize_base(b, q, exact, false);
      const TensorSlot& a = l.at("a.weight");
      for (int64_t r = 0; r < 12; ++r) {
        float amax = 0;
        for (int64_t c = 0; c < 100; ++c) amax = std::max(amax, std::fabs(x[size_t(r * 100 + c)]));
        for (int64_t c = 0; c < 100; ++c) {
          const size_t i = a.offset_elems + size_t(r * 100 + c);
          // int8: within half a step of the row's scale; NF4: within the widest gap between levels (0.33 of
          // the block's absmax, which is at most the row's here).
          CHECK(std::fabs(exact[i] - x[i]) <= (f == BaseFormat::kInt8 ? 0.5001f * amax / 127 : 0.17f * amax));
          if (raw == DType::kBF16) CHECK(y[i] == bf16_to_float(float_to_bf16(exact[i])));
          else CHECK(y[i] == exact[i]);
        }
      }
      // The norm: exact in fp32, rounded once in bf16.
      const TensorSlot& n = l.at("norm.weight");
      for (size_t i = n.offset_elems; i < n.offset_elems + n.numel; ++i)
        CHECK(y[i] == (raw == DType::kF32 ? x[i] : bf16_to_float(float_to_bf16(x[i]))));
      // Padding between tensors: zero.
      for (size_t i = a.offset_elems + a.numel; i < n.offset_elems; ++i) CHECK(y[i] == 0.0f);
      // The bytes: 1 per parameter (int8) or 1/2 (NF4), plus fp32 scales per row or per 64.
      const double per = f == BaseFormat::kInt8 ? 1.0 + 4.0 / 100 : 0.5 + 4.0 / 64;
      CHECK(double(b.bytes) < per * 2400 + 100 * dtype_size(raw) + 6 * 256);
      // Quantizing what it gives back gives it back (the absmax's own element is exact).
      if (raw == DType::kF32) {
        std::vector<std::byte> again(b.bytes);
        quantize_base(b, exact, again);
        std::vector<float> z(l.total_elems());
        dequantize_base(b, again, z);
        CHECK(std::memcmp(z.data(), y.data(), z.size() * 4) == 0);
      }
    }
  // NF4's levels: the element at its block's absmax is exactly +-1 times it, and zero is zero.
  std::vector<float> v(64, 0.0f);
  v[5] = -3.0f;
  v[9] = 1.5f;
  ParamLayout one("x");
  one.add("w.weight", {1, 64}, true, false);
  const BaseLayout b = base_layout(one, 128, BaseFormat::kNf4, DType::kF32);
  std::vector<std::byte> q(b.bytes);
  v.resize(128, 0.0f);
  quantize_base(b, v, q);
  std::vector<float> y(128);
  dequantize_base(b, q, y);
  CHECK(y[5] == -3.0f);
  CHECK(y[0] == 0.0f);
  CHECK(std::fabs(y[9] - 1.5f) <= 0.17f * 3.0f);
  CHECK_THROWS_WITH(parse_base_format("fp4", "--base-format"), Catch::Contains("--base-format") &&
                    Catch::Contains("compute, int8, nf4"));
}

TEST_CASE("base formats: the device's dequantization gives the host's bits", "[lora][base]") {
  const ParamLayout l = three_tensors(40, 300);  // several NF4 blocks per row, a partial one at the end
  const std::vector<float> x = normal_values(l.total_elems(), 5);
  for (BaseFormat f : {BaseFormat::kInt8, BaseFormat::kNf4})
    for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
      INFO(base_format_name(f) << " " << dt);
      const BaseLayout b = base_layout(l, l.total_elems(), f, dt == at::kFloat ? DType::kF32 : DType::kBF16);
      std::vector<std::byte> q(b.bytes);
      quantize_base(b, x, q);
      std::vector<float> want(l.total_elems());
      dequantize_base(b, q, want);
      at::Tensor out = at::full({int64_t(l.total_elems())}, 7.0, at::TensorOptions().dtype(dt));  // padding must be zeroed
      dequantize_base_on_device(b, q.data(), out.data_ptr(), dt, c10::Device(c10::kCPU));
      at::Tensor got = out.to(at::kFloat).contiguous();
      CHECK(std::memcmp(got.data_ptr<float>(), want.data(), want.size() * 4) == 0);
    }
}

TEST_CASE("base formats: a quantized base's pieces load its bytes and dequantize first", "[lora][base]") {
  const ModelSpec spec = tiny(false).with_lora(kAllLinear, "test");
  EngineConfig cfg = small_bf16();
  cfg.lora = kAllLinear;
  cfg.clip_norm = 1.0;
  const Placement plain = place(spec, cfg);
  for (BaseFormat f : {BaseFormat::kInt8, BaseFormat::kNf4}) {
    cfg.base_format = f;
    const Placement pl = place(spec, cfg);
    INFO(base_format_name(f));
    int64_t quantized = 0;
    for (int64_t p = 0; p < pl.num_pieces(); ++p) {
      const Piece& pc = pl.piece(p);
      quantized += pc.quantized;
      CHECK(pc.quantized == (pc.frozen && pc.block >= 1 && pc.block < pl.head));  // layers' bases only
    }
    CHECK(quantized == spec.layers);
    // Host: the layers' base bytes instead of their compute copy; device: each unit stages one base.
    CHECK(pl.footprint.host_bytes < plain.footprint.host_bytes);
    CHECK(pl.base_staging_bytes == pl.store_blocks[1].base.bytes);
    CHECK(pl.footprint.unit_bytes > plain.footprint.unit_bytes);
    const StepProgram prog = compile_step(pl, program_inputs(cfg, 1));
    int64_t dequant = 0;
    for (size_t i = 0; i < prog.ops.size(); ++i) {
      const StepOp& o = prog.ops[i];
      if (o.kind != StepOpKind::kDequantize) continue;
      ++dequant;
      CHECK(o.first_of_visit);  // it waits for the load, and the visit's compute follows it
      CHECK(pl.piece(o.piece).quantized);
      CHECK(prog.ops[i + 1].visit == o.visit);
    }
    CHECK(dequant == 2 * spec.layers);  // forward and backward
    const StepProgram eval = compile_eval(pl, program_inputs(cfg, 1));
    CHECK(std::count_if(eval.ops.begin(), eval.ops.end(),
                        [](const StepOp& o) { return o.kind == StepOpKind::kDequantize; }) == spec.layers);  // forward
  }
  cfg.lora.clear();
  CHECK_THROWS_WITH(check_config(tiny(false), cfg), Catch::Contains("only a frozen LoRA base is quantized"));
  cfg.lora = kAllLinear;
  cfg.layer_pieces = "layernorm,self_attn+mlp";
  CHECK_THROWS_WITH(check_config(spec, cfg), Catch::Contains("leave layer_pieces empty"));
}

TEST_CASE("base formats: offload changes nothing, and the quantized base keeps its bits", "[lora][base][engine]") {
  for (BaseFormat f : {BaseFormat::kNf4, BaseFormat::kInt8}) {
    const std::string lora = f == BaseFormat::kNf4 ? kAllLinear : "r=4,alpha=8,targets=q_proj+down_proj,train=lm_head";
    const ModelSpec spec = tiny(false).with_lora(lora, "test");
    const int64_t B = spec.num_blocks();
    Case resident{"reference: all resident", B};
    resident.lora = lora;
    resident.base_format = f;
    const Result init = run(tiny(false), resident, at::kFloat, 0.5, 0);
    const Result ref = run(tiny(false), resident, at::kFloat, 0.5);
    Case plain = resident;
    plain.base_format = BaseFormat::kCompute;
    const Result full = run(tiny(false), plain, at::kFloat, 0.5);
    INFO(base_format_name(f));
    CHECK(ref.eval_loss != init.eval_loss);
    CHECK(ref.losses != full.losses);  // the quantized base computes something else than the exact one
    CHECK(std::fabs(ref.losses[0] - full.losses[0]) < 0.05 * full.losses[0]);  // but close to it
    for (int64_t b = 1; b + 1 < B; ++b) {  // the layers' bases: as quantized at the start, bit for bit
      const auto [tb, te] = spec.layout(b).trainable_span();
      CHECK(std::memcmp(init.state[size_t(3 * b)].data(), ref.state[size_t(3 * b)].data(), tb * 4) == 0);
    }
    for (Case c : {Case{"K=2", 2}, Case{"K=3, chaos", 3, false, {}, true, 3},
                   Case{"host checkpoints, NVMe, chaos", 2, true, {1, 3}, true, 2},
                   Case{"3 vocabulary shards, kept activations and logits, chaos", 2, false, {}, true, 13, 3, 40,
                        {1, 2, 3}, true}}) {
      c.lora = lora;
      c.base_format = f;
      INFO("case: " << c.name);
      const Result r = run(tiny(false), c, at::kFloat, 0.5);
      CHECK(same_bits(r, ref));
      CHECK(r.eval_loss == ref.eval_loss);
      CHECK(r.peak <= r.budget);
      c.devices = 2;
      INFO("a pool of 2");
      CHECK(same_bits(run(tiny(false), c, at::kFloat, 0.5), ref));
    }
  }
}

TEST_CASE("base formats: setting one tensor quantizes it alone", "[lora][base][engine]") {
  // (One step against the resident reference over the dequantized base: test_lora.cpp.)
  EngineConfig cfg = small_bf16();
  cfg.compute.dtype = at::kFloat;  // what param() gives is then exactly a level times its block's absmax
  cfg.lora = kAllLinear;
  cfg.base_format = BaseFormat::kNf4;
  Engine e(tiny(false), cfg, make_device({.spec = "cpu"}));
  e.init_params(5);
  const std::string q = "model.layers.0.self_attn.q_proj.weight", k = "model.layers.0.self_attn.k_proj.weight";
  const std::vector<float> wq = e.param(q), wk = e.param(k);
  e.set_param("model.layers.0.self_attn.q_proj.lora_A.weight", e.param("model.layers.0.self_attn.q_proj.lora_A.weight"));
  CHECK(e.param(q) == wq);  // the block written back whole: its base's bytes as they were
  std::vector<float> twice = wq;
  for (float& x : twice) x *= 2;
  e.set_param(q, twice);
  const std::vector<float> now = e.param(q);
  for (size_t i = 0; i < wq.size(); ++i) CHECK(now[i] == 2 * wq[i]);  // x2 doubles each block's absmax exactly: the codes stay
  CHECK(e.param(k) == wk);  // its neighbour: not quantized again
}

TEST_CASE("base formats: Llama-3.1-70B LoRA fits 128 GiB of RAM with an NF4 or int8 base", "[lora][base][plan]") {
  const ModelSpec spec = ModelSpec::from_json(model_preset("llama-3.1-70b"), "llama-3.1-70b");
  PlanLimits l;
  l.seq = 1024;
  l.accumulation = 16;
  l.device_bytes = uint64_t(24) << 30;
  l.host_bytes = uint64_t(128) << 30;
  l.lora = "r=16,alpha=32,targets=all-linear";
  CHECK_FALSE(Plan::make(spec, l).feasible);  // bf16: 131.80 GiB of base alone
  uint64_t host[2] = {0, 0};
  for (BaseFormat f : {BaseFormat::kInt8, BaseFormat::kNf4}) {
    l.base_format = f;
    const Plan p = Plan::make(spec, l);
    INFO(base_format_name(f) << ": " << p.reason);
    CHECK(p.feasible);
    host[f == BaseFormat::kNf4] = p.host_bytes;
  }
  CHECK(host[1] < host[0]);
}
