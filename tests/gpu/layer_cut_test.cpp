// A decoder layer cut into sub-layer pieces (gpu/blocks/layer_cut.h): with one MLP
// slice it is the uncut layer (gpu/blocks/blocks.h) bit for bit, forward and
// backward, tiled or not; with several, within fp32 rounding of it (the
// slices' partial outputs and input gradients are summed in another order),
// and within bf16's tolerance in bf16. Layers it cannot cut are refused by
// name.
#include "tests/catch_torch.h"

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "gpu/blocks/blocks.h"
#include "gpu/blocks/layer_cut.h"
#include "gpu/blocks/moe.h"
#include "tests/gpu/layer_pass.h"
#include "tests/gpu/random_layer.h"

using namespace strider;
using namespace strider::layer_test;

namespace {

bool mlp_tensor(const std::string& name) { return name.rfind("mlp.", 0) == 0; }

// The attention half's weights and accumulators: the layer's own tensors
// (its accumulators add into the layer's).
Layer attention_part(const Layer& l) {
  Layer a;
  for (const auto& [name, t] : l.w)
    if (!mlp_tensor(name)) a.w.emplace(name, t);
  for (const auto& [name, g] : l.grads)
    if (!mlp_tensor(name)) a.grads.emplace(name, g);
  return a;
}

// The MLP slice [i0, i1) as a piece's visit sees it: contiguous copies of
// gate's and up's rows and down's columns (and the biases' elements; down's
// bias in the first slice), with zeroed fp32 accumulators of their shapes.
Layer slice_part(const Layer& l, int64_t i0, int64_t i1) {
  Layer s;
  auto add = [&](const std::string& name, const at::Tensor& t) {
    s.w.emplace(name, t.contiguous());
    s.grads.emplace(name, at::zeros(t.sizes(), at::kFloat));
  };
  for (const char* p : {"mlp.gate_proj", "mlp.up_proj"}) {
    add(std::string(p) + ".weight", l.w.at(std::string(p) + ".weight").slice(0, i0, i1));
    if (l.w.count(std::string(p) + ".bias")) add(std::string(p) + ".bias", l.w.at(std::string(p) + ".bias").slice(0, i0, i1));
  }
  add("mlp.down_proj.weight", l.w.at("mlp.down_proj.weight").slice(1, i0, i1));
  if (i0 == 0 && l.w.count("mlp.down_proj.bias")) add("mlp.down_proj.bias", l.w.at("mlp.down_proj.bias"));
  return s;
}

// Adds a slice's gradients into the layer's accumulators at their places.
void add_slice_grads(Layer& l, const Layer& s, int64_t i0, int64_t i1) {
  for (const auto& [name, g] : s.grads) {
    at::Tensor whole = l.grads.at(name);
    if (name == "mlp.down_proj.weight") whole = whole.slice(1, i0, i1);
    else if (name != "mlp.down_proj.bias") whole = whole.slice(0, i0, i1);
    whole.add_(g);
  }
}

// The layer's pass cut at `bounds` (0 = i_0 < i_1 < ... = intermediate):
// the attention half, the slices in order (their sum in fp32), the output;
// then the slices in reverse, the attention half.
Pass cut_pass(const BlockDims& d, Layer l, const RopeTables& rope, const at::Tensor& x, const at::Tensor& gout,
              const std::vector<int64_t>& bounds, int64_t tile) {
  Layer attn = attention_part(l);
  std::vector<Layer> slices;
  for (size_t j = 0; j + 1 < bounds.size(); ++j) slices.push_back(slice_part(l, bounds[j], bounds[j + 1]));
  Pass p;
  const AttentionHalf half = attention_half_forward(d, attn.w, rope, x, tile);
  const at::Tensor sum = at::zeros(x.sizes(), at::kFloat);
  for (const Layer& s : slices) mlp_slice_forward(d, s.w, half.h2, sum, tile);
  p.out = mlp_slices_output(d, half.x1, sum);
  const at::Tensor dsum = at::zeros(x.sizes(), at::kFloat);
  for (size_t j = slices.size(); j-- > 0;) mlp_slice_backward(d, slices[j].w, slices[j].grads, half.h2, gout, dsum, tile);
  p.dx = attention_half_backward(d, attn.w, attn.grads, rope, x, gout, dsum, tile);
  for (size_t j = 0; j < slices.size(); ++j) add_slice_grads(l, slices[j], bounds[j], bounds[j + 1]);
  p.grads = l.grads;
  return p;
}

void check_same(const Pass& got, const Pass& want) {
  CHECK(same_bits(got.out, want.out));
  CHECK(same_bits(got.dx, want.dx));
  REQUIRE(got.grads.size() == want.grads.size());
  for (const auto& [name, g] : want.grads) {
    INFO(name);
    CHECK(same_bits(got.grads.at(name), g));
  }
}

}  // namespace

TEST_CASE("a layer cut into one MLP slice is the uncut layer bit for bit", "[layer_cut]") {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (bool qwen3 : {false, true}) {
      for (double multiplier : {1.0, 0.25}) {
        BlockDims d = dims(/*gqa=*/true, qwen3);
        d.residual_multiplier = multiplier;  // Granite's
        const Inputs in = inputs(d, dtype, 2, 13);
        for (int64_t tile : {int64_t{0}, int64_t{7}}) {
          INFO("dtype " << c10::toString(dtype) << " qwen3 " << qwen3 << " multiplier " << multiplier << " tile "
                        << tile);
          const Pass want = strider_pass(d, random_layer(d, dtype, 11), in.rope, in.x, in.gout, tile);
          check_same(cut_pass(d, random_layer(d, dtype, 11), in.rope, in.x, in.gout, {0, d.intermediate}, tile),
                     want);
        }
      }
    }
  }
}

TEST_CASE("a layer cut into MLP slices agrees with the uncut layer to fp32 rounding", "[layer_cut]") {
  for (bool qwen3 : {false, true}) {
    BlockDims d = dims(/*gqa=*/true, qwen3);
    const Inputs in = inputs(d, at::kFloat, 3, 11);
    // Even slices, uneven ones, slices of one element.
    for (const std::vector<int64_t>& bounds : std::vector<std::vector<int64_t>>{
             {0, 40, 80}, {0, 16, 48, 80}, {0, 1, 79, 80}}) {
      for (int64_t tile : {int64_t{0}, int64_t{5}}) {
        INFO("qwen3 " << qwen3 << " slices " << bounds.size() - 1 << " from " << bounds[1] << " tile " << tile);
        const Pass want = strider_pass(d, random_layer(d, at::kFloat, 12), in.rope, in.x, in.gout, tile);
        check_close(cut_pass(d, random_layer(d, at::kFloat, 12), in.rope, in.x, in.gout, bounds, tile), want, 1e-6);
      }
    }
  }
}

TEST_CASE("a layer cut into MLP slices in bf16 is within bf16 tolerance of the uncut layer", "[layer_cut]") {
  // Each slice's partial output and input gradient is rounded to bf16
  // before the fp32 sums add them; the uncut layer rounds the whole.
  const BlockDims d = dims(/*gqa=*/true);
  const Inputs in = inputs(d, at::kBFloat16, 2, 24);
  const Pass want = strider_pass(d, random_layer(d, at::kBFloat16, 13), in.rope, in.x, in.gout, 0);
  check_close(cut_pass(d, random_layer(d, at::kBFloat16, 13), in.rope, in.x, in.gout, {0, 24, 56, 80}, 0), want,
              2e-2);
}

TEST_CASE("a layer the MLP slices cannot cut is refused by name", "[layer_cut]") {
  BlockDims d = dims(/*gqa=*/false);
  const Inputs in = inputs(d, at::kFloat, 1, 4);
  {
    BlockDims post = d;
    post.norm_placement = NormPlacement::kSandwich;
    CHECK_THROWS_WITH(attention_half_forward(post, random_layer(d, at::kFloat, 14).w, in.rope, in.x, 0),
                      Catch::Contains("post_feedforward_layernorm"));
  }
  {
    TensorMap w = random_layer(d, at::kFloat, 14).w;
    w.emplace("self_attn.q_proj.lora_A.weight", at::zeros({4, d.hidden}));
    CHECK_THROWS_WITH(check_cuttable(d, w), Catch::Contains("self_attn.q_proj.lora_A.weight"));
  }
  {
    BlockDims moe = d;
    moe.moe.experts = 4;
    moe.moe.top_k = 2;
    moe.moe.intermediate = 16;
    CHECK_THROWS_WITH(check_cuttable(moe, {}), Catch::Contains("groups of experts"));
    CHECK_THROWS_WITH(check_moe_cuttable(d, {}), Catch::Contains("MLP slices"));
  }
}

namespace {

// A Qwen3-MoE-like layer (or Mixtral's fp32 scores, or Qwen2-MoE's shared
// expert): the attention's tensors, a router and 6 experts of top-2.
Layer random_moe_layer(const BlockDims& d, at::ScalarType dtype, uint64_t seed) {
  Layer l = random_layer(d, dtype, seed);
  for (const char* t : {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "mlp.gate_proj.bias",
                        "mlp.up_proj.bias", "mlp.down_proj.bias"}) {
    l.w.erase(t);
    l.grads.erase(t);
  }
  const int64_t E = d.moe.experts, H = d.hidden, I = d.moe.intermediate;
  for (auto [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"mlp.gate.weight", {E, H}}, {"mlp.experts.gate_up_proj", {E, 2 * I, H}}, {"mlp.experts.down_proj", {E, H, I}}}) {
    l.w.emplace(name, (at::randn(shape) * 0.3).to(dtype));
    l.grads.emplace(name, at::zeros(shape, at::kFloat));
  }
  const int64_t S = d.moe.shared_intermediate;
  if (S > 0)
    for (auto [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"mlp.shared_expert.gate_proj.weight", {S, H}}, {"mlp.shared_expert.up_proj.weight", {S, H}},
             {"mlp.shared_expert.down_proj.weight", {H, S}}, {"mlp.shared_expert_gate.weight", {1, H}}}) {
      l.w.emplace(name, (at::randn(shape) * 0.3).to(dtype));
      l.grads.emplace(name, at::zeros(shape, at::kFloat));
    }
  return l;
}

}  // namespace

TEST_CASE("a layer with experts cut into its attention-and-router half and groups of experts is the uncut layer "
          "bit for bit", "[layer_cut]") {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16})
    for (int kind : {0, 1, 2})  // Qwen3-MoE, Mixtral, Qwen2-MoE (a shared expert)
      for (int64_t tile : {0, 5}) {
        const bool mixtral = kind == 1;
        INFO((dtype == at::kFloat ? "fp32" : "bf16") << " kind " << kind << " tile " << tile);
        BlockDims d = dims(/*gqa=*/true, /*qwen3=*/!mixtral);
        d.mlp_bias = false;
        d.moe.experts = 6;
        d.moe.top_k = 2;
        d.moe.intermediate = 16;
        d.moe.norm_topk = kind != 2;
        d.moe.scores_fp32 = mixtral;
        if (kind == 2) d.moe.shared_intermediate = 24;
        const Inputs in = inputs(d, dtype, 2, 9);
        const int64_t n = 2 * 9;
        // The load-balancing loss's statistics and weight, one set per run.
        auto step_of = [&](at::Tensor& stats) {
          stats = at::zeros({2, d.moe.experts}, at::kFloat);
          MoeStep st;
          st.stats = stats;
          st.aux_scale = 0.02;
          st.rows = double(n);
          return st;
        };
        at::Tensor whole_stats, cut_stats;
        Layer whole = random_moe_layer(d, dtype, 21);
        MoeStep whole_step = step_of(whole_stats);
        Pass want;
        want.out = layer_forward(d, whole.w, in.rope, in.x, tile, nullptr, &whole_step);
        want.dx = layer_backward(d, whole.w, in.rope, in.x, in.gout, whole.grads, tile, nullptr, &whole_step);
        want.grads = whole.grads;

        // The half holds every tensor but the experts' (the router with it);
        // the groups 0-2, 2-3, 3-6 see every expert's tensors (moe_cut_test
        // holds a group's own).
        Layer l = random_moe_layer(d, dtype, 21);
        Layer half;
        for (const auto& [name, t] : l.w)
          if (name.rfind("mlp.experts.", 0) != 0) half.w.emplace(name, t);
        for (const auto& [name, g] : l.grads)
          if (name.rfind("mlp.experts.", 0) != 0) half.grads.emplace(name, g);
        MoeStep cut_step = step_of(cut_stats);
        const int64_t k = d.moe.top_k;
        MoeCut cut{at::empty({n, k}, at::kLong), at::empty({n, k}, at::kFloat), at::zeros({n * k}, at::kFloat),
                   d.moe.shared_intermediate > 0 ? at::empty(in.x.sizes(), in.x.options()) : at::Tensor(), &cut_step};
        const std::vector<std::pair<int64_t, int64_t>> groups = {{0, 2}, {2, 3}, {3, 6}};
        const AttentionHalf h = attention_half_forward(d, half.w, in.rope, in.x, tile);
        moe_cut_route(d, half.w, h.h2, cut, tile);
        moe_cut_shared(d, half.w, h.h2, cut, tile);
        const at::Tensor sum = at::zeros_like(h.h2);
        for (auto [e0, e1] : groups) moe_group_forward(d, l.w, e0, e1, h.h2, cut, sum, tile);
        Pass got;
        got.out = moe_groups_output(d, h.x1, sum, cut.shared);
        // Backward: the routing again (no statistics), groups in reverse, the half.
        MoeCut again = cut;
        again.step = nullptr;
        moe_cut_route(d, half.w, attention_half_forward(d, half.w, in.rope, in.x, tile).h2, again, tile);
        const at::Tensor dsum = at::zeros_like(h.h2);
        for (size_t i = groups.size(); i-- > 0;)
          moe_group_backward(d, l.w, l.grads, groups[i].first, groups[i].second, h.h2, in.gout, cut, dsum, tile);
        got.dx = moe_half_backward(d, half.w, half.grads, in.rope, in.x, in.gout, dsum, cut, tile);
        got.grads = l.grads;
        check_same(got, want);
        CHECK(same_bits(cut_stats, whole_stats));
      }
}
