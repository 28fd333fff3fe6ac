// The decoder layer's working memory against ModelSpec::cost: the peak ATen
// bytes of a layer's forward and backward, counted by gpu/memory/aten_memory's CPU
// allocator, must lie in [0.7, 1] x the predicted forward_work_bytes / (fp16: [0.6, 1])
// backward_work_bytes, for short and long sequences, tiled and untiled, fp32
// and bf16, grouped and plain attention. The model's kernel-dependent terms
// are this machine's, measured first by gpu/memory/work_calibration on shapes of its
// own (a CPU with bf16 units stages no fp32 copy of a bf16 GEMM's output);
// ctest runs it again under ATEN_CPU_CAPABILITY=avx2, another kernel path. Without S x S scores and with the
// MLP in tiles, the measurement grows with S x hidden; a kernel that
// materialised the scores (S = 4096: 8 heads x 4096^2 x 4 B = 512 MiB) would
// break the upper bound.
#include "tests/catch_torch.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "engine/model/model_spec.h"
#include "engine/run/block_runner.h"
#include "gpu/device/device.h"
#include "gpu/memory/aten_memory.h"
#include "gpu/memory/work_calibration.h"

using namespace strider;

namespace {

ModelSpec llama(int64_t kv_heads, bool qwen3 = false) {
  nlohmann::json cfg = {{"architectures", {qwen3 ? "Qwen3ForCausalLM" : "LlamaForCausalLM"}},
                        {"hidden_size", 256}, {"intermediate_size", 688}, {"num_hidden_layers", 1},
                        {"num_attention_heads", 8}, {"num_key_value_heads", kv_heads},
                        {"vocab_size", 64}, {"max_position_embeddings", 8192}};
  if (qwen3) cfg["head_dim"] = 48;
  return ModelSpec::from_json(cfg, "test");
}

// Gemma 3 and Gemma 2 (layer 0 slides, window 512) and OLMo 2: their norms
// around the branches, Gemma's GELU-tanh, the sliding window's mask, Gemma
// 2's soft-capped attention in query tiles.
ModelSpec other(const char* arch) {
  nlohmann::json cfg = {{"architectures", {arch}}, {"hidden_size", 256}, {"intermediate_size", 688},
                        {"num_hidden_layers", 2}, {"num_attention_heads", 8}, {"num_key_value_heads", 4},
                        {"vocab_size", 64}, {"max_position_embeddings", 8192}};
  if (std::string(arch) != "Olmo2ForCausalLM")
    cfg.update({{"head_dim", 48}, {"sliding_window", 512}, {"layer_types", {"sliding_attention", "full_attention"}}});
  if (std::string(arch) == "Gemma2ForCausalLM") cfg.update({{"attn_logit_softcapping", 50.0}});
  return ModelSpec::from_json(cfg, "test");
}

// Qwen3-MoE: 8 experts of 128, top 2, in a layer of hidden 256. The model
// bounds an expert's rows by the tile's tokens (a token goes to an expert
// once); measure() zeroes the router, so that every token ties on every
// expert and all go to the same two: the bound's case.
ModelSpec moe() {
  nlohmann::json cfg = {{"architectures", {"Qwen3MoeForCausalLM"}}, {"hidden_size", 256}, {"intermediate_size", 688},
                        {"moe_intermediate_size", 128}, {"num_experts", 8}, {"num_experts_per_tok", 2},
                        {"norm_topk_prob", true}, {"num_hidden_layers", 1}, {"num_attention_heads", 8},
                        {"num_key_value_heads", 4}, {"head_dim", 32}, {"vocab_size", 64},
                        {"max_position_embeddings", 8192}};
  return ModelSpec::from_json(cfg, "test");
}
// Qwen2-MoE's: the same experts with q/k/v biases and no q/k norms, and a
// shared expert as wide as the dense MLP (its buffers outweigh the experts').
ModelSpec moe_shared() {
  nlohmann::json cfg = {{"architectures", {"Qwen2MoeForCausalLM"}}, {"hidden_size", 256}, {"intermediate_size", 688},
                        {"moe_intermediate_size", 128}, {"shared_expert_intermediate_size", 688}, {"num_experts", 8},
                        {"num_experts_per_tok", 2}, {"num_hidden_layers", 1}, {"num_attention_heads", 8},
                        {"num_key_value_heads", 4}, {"vocab_size", 64}, {"max_position_embeddings", 8192}};
  return ModelSpec::from_json(cfg, "test");
}

struct Shape {
  const char* model;
  ModelSpec spec;
  int64_t batch, seq, tile;
  at::ScalarType dtype;
  bool packed = false;  // rows of three documents (EngineConfig::packed_documents): a mask per row
};

struct Measured {
  int64_t forward = 0, backward = 0;
};

// Peak bytes above what was live before each call, the returned tensor included.
Measured measure(const Shape& s) {
  const int64_t layer = 1;
  BlockRunner run(s.spec, ComputeOptions{s.dtype, 8192, s.tile}, s.seq, at::kCPU);
  const int64_t n = int64_t(s.spec.layout(layer).total_elems());
  at::manual_seed(1);
  at::Tensor params = (at::randn({n}) * 0.05 + 0.1).to(s.dtype);
  if (const TensorSlot* router = s.spec.layout(layer).find("model.layers.0.mlp.gate.weight"))
    params.slice(0, int64_t(router->offset_elems), int64_t(router->offset_elems + router->numel)).zero_();
  at::Tensor grads = at::zeros({n});
  at::Tensor x = at::randn({s.batch, s.seq, s.spec.dims.hidden}).to(s.dtype);
  at::Tensor gout = at::randn({s.batch, s.seq, s.spec.dims.hidden}).to(s.dtype);
  BatchPositions pos;
  if (s.packed) {  // documents of a fifth, two fifths and the rest of each row
    const int64_t a = s.seq / 5, b = 2 * s.seq / 5;
    const at::Tensor row = at::cat({at::arange(a), at::arange(b), at::arange(s.seq - a - b)});
    pos = {row.repeat({s.batch, 1}), s.seq - a - b};
  }
  // The peak above what is live when it is reset.
  auto start = [] {
    reset_aten_cpu_peak();
    return aten_cpu_counts().live_bytes;
  };
  auto peak_since = [](uint64_t base) { return int64_t(aten_cpu_counts().peak_bytes - base); };
  Measured m;
  uint64_t base = start();
  at::Tensor out = run.forward(layer, params, x, {}, &pos);
  m.forward = peak_since(base);
  out.reset();
  base = start();
  at::Tensor dx = run.backward(layer, params, x, gout, grads, {}, 0, &pos);
  m.backward = peak_since(base);
  return m;
}

}  // namespace

TEST_CASE("a layer's measured working memory is between 0.7 and 1 times the cost model's", "[memory]") {
  // The CPU flash-attention kernel keeps a scratch block per thread; fix the
  // thread count so that the measurement does not depend on the machine.
  at::set_num_threads(2);
  install_aten_cpu_counter();
  REQUIRE(aten_cpu_counter_installed());
  // Calibrated in each half dtype, as a run calibrates in its own.
  const auto calibrate = [](DType dtype) {
    auto device = make_device({.spec = "cpu"});
    return measure_work_coefficients(*device, dtype);
  };
  const WorkCoefficients work = calibrate(DType::kBF16), work_fp16 = calibrate(DType::kF16);
  std::printf("measured on this machine: a bf16 GEMM stages %.1f bytes per output element, silu's backward %.1f; "
              "fp16: %.1f and %.1f\n",
              work.gemm_staging_bytes, work.silu_back_staging_bytes, work_fp16.gemm_staging_bytes,
              work_fp16.silu_back_staging_bytes);
  const ModelSpec gqa = llama(2), mha = llama(8), qwen3 = llama(4, true);
  std::vector<Shape> shapes;
  // STRIDER_LAYER_MEMORY_FP32_ONLY=1 measures the fp32 shapes only: for a run
  // with ATEN_CPU_CAPABILITY=avx2 but oneDNN left at AVX-512 BF16, where
  // torch 2.15's bf16 flash attention throws "pack_vnni2 is only supported
  // when avx512 is supported" (ctest's avx2 entry sets ONEDNN_MAX_CPU_ISA=AVX2
  // instead, and measures both dtypes).
  const char* fp32_only = std::getenv("STRIDER_LAYER_MEMORY_FP32_ONLY");
  const bool bf16 = fp32_only == nullptr || std::string(fp32_only) != "1";
  if (!bf16) std::printf("fp32 shapes only (STRIDER_LAYER_MEMORY_FP32_ONLY=1)\n");
  std::vector<at::ScalarType> dtypes{at::kFloat};
  if (bf16) dtypes.push_back(at::kBFloat16);
  for (at::ScalarType dtype : dtypes)
    for (int64_t seq : {256, 1024, 4096})
      for (int64_t tile : {int64_t{0}, int64_t{192}}) shapes.push_back({"gqa", gqa, 1, seq, tile, dtype});
  // fp16 (loss scaling): the same bytes as bf16, its own GEMM's calibration.
  if (bf16)
    for (int64_t tile : {int64_t{0}, int64_t{192}}) shapes.push_back({"gqa", gqa, 1, 1024, tile, at::kHalf});
  if (bf16) shapes.push_back({"mha", mha, 2, 1024, 0, at::kBFloat16});
  shapes.push_back({"mha", mha, 2, 1024, 500, at::kFloat});
  if (bf16) shapes.push_back({"qwen3", qwen3, 1, 2048, 0, at::kBFloat16});
  shapes.push_back({"qwen3", qwen3, 1, 2048, 256, at::kFloat});
  const ModelSpec gemma3 = other("Gemma3ForCausalLM"), olmo2 = other("Olmo2ForCausalLM"),
                  gemma2 = other("Gemma2ForCausalLM");
  for (const auto& [name, spec] :
       {std::pair{"gemma3", &gemma3}, std::pair{"olmo2", &olmo2}, std::pair{"gemma2", &gemma2}}) {
    if (bf16) shapes.push_back({name, *spec, 1, 2048, 0, at::kBFloat16});
    shapes.push_back({name, *spec, 1, 2048, 256, at::kFloat});
  }
  const ModelSpec experts = moe();
  for (at::ScalarType dtype : dtypes)
    for (int64_t tile : {int64_t{0}, int64_t{256}}) shapes.push_back({"qwen3-moe", experts, 1, 2048, tile, dtype});
  const ModelSpec shared = moe_shared();
  for (at::ScalarType dtype : dtypes)
    for (int64_t tile : {int64_t{0}, int64_t{256}}) shapes.push_back({"qwen2-moe", shared, 1, 2048, tile, dtype});
  // fp16 on every architecture, in the bf16 shapes' sizes.
  if (bf16) {
    shapes.push_back({"mha", mha, 2, 1024, 0, at::kHalf});
    for (const auto& [name, spec] : {std::pair{"qwen3", &qwen3}, std::pair{"gemma3", &gemma3}, std::pair{"olmo2", &olmo2},
                                     std::pair{"gemma2", &gemma2}, std::pair{"qwen3-moe", &experts},
                                     std::pair{"qwen2-moe", &shared}})
      for (int64_t tile : {int64_t{0}, int64_t{256}}) shapes.push_back({name, *spec, 1, 2048, tile, at::kHalf});
  }
  // Packed documents: the attention mask per row (and Gemma 2's per tile).
  for (at::ScalarType dtype : dtypes)
    for (int64_t tile : {int64_t{0}, int64_t{256}}) shapes.push_back({"gqa+docs", gqa, 2, 1024, tile, dtype, true});
  if (bf16) shapes.push_back({"gemma3+docs", gemma3, 1, 2048, 0, at::kBFloat16, true});
  shapes.push_back({"gemma2+docs", gemma2, 2, 1024, 256, at::kFloat, true});

  std::printf("%-11s %5s %5s %5s %5s  %12s %12s %6s  %12s %12s %6s\n", "model", "b", "s", "tile", "dtype",
              "fwd meas", "fwd pred", "ratio", "bwd meas", "bwd pred", "ratio");
  for (const Shape& s : shapes) {
    const int dtype_bytes = s.dtype == at::kFloat ? 4 : 2;
    const BlockCost c =
        s.spec.cost(1, s.batch, s.seq, 8192, dtype_bytes, s.tile, s.dtype == at::kHalf ? work_fp16 : work, s.packed);
    const Measured m = measure(s);
    std::printf("%-11s %5lld %5lld %5lld %5s  %12lld %12lld %6.3f  %12lld %12lld %6.3f\n", s.model,
                (long long)s.batch, (long long)s.seq, (long long)s.tile, std::string(compute_dtype_name(s.dtype)).c_str(),
                (long long)m.forward, (long long)c.forward_work_bytes,
                double(m.forward) / double(c.forward_work_bytes), (long long)m.backward,
                (long long)c.backward_work_bytes, double(m.backward) / double(c.backward_work_bytes));
    INFO(s.model << " b " << s.batch << " s " << s.seq << " tile " << s.tile << " "
                 << c10::toString(s.dtype) << ": forward " << m.forward << " of " << c.forward_work_bytes
                 << ", backward " << m.backward << " of " << c.backward_work_bytes);
    // How tight the model must be. fp16 0.6: on an Intel Xeon with AVX-512
    // FP16 and AMX, oneDNN's fp16 GEMM packs its weight, a cost per GEMM (not
    // per output element) that the calibration's 256 rows charge to each
    // element: it stages 2.6 bytes per element at the calibration's
    // [256, 96] x [96, 320], 1.2 at 1024 rows of it, 1.0 at [1024, 256] x
    // [256, 768] and 0.5 at 2048 rows of that, so an untiled forward of 1024
    // tokens measured 0.63-0.69 of the prediction. bf16 0.65: on an AMD EPYC
    // with AVX-512 BF16, whose calibration measured 1.5 bytes of GEMM staging
    // per output element, the smallest tiled shape (256 tokens in tiles of
    // 192) measured 0.689 of its backward's prediction (every other bf16
    // shape 0.707 or more): the same per-GEMM cost charged per element. The
    // upper bound holds for every dtype.
    const double tight = s.dtype == at::kHalf ? 0.6 : s.dtype == at::kBFloat16 ? 0.65 : 0.7;
    CHECK(m.forward <= c.forward_work_bytes);
    CHECK(double(m.forward) >= tight * double(c.forward_work_bytes));
    CHECK(m.backward <= c.backward_work_bytes);
    CHECK(double(m.backward) >= tight * double(c.backward_work_bytes));
  }
}
