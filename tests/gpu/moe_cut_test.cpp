// gpu/blocks/moe_cut.h: a mixture-of-experts MLP cut into its router and groups of
// experts gives the whole MLP's bits (moe_forward, moe_backward), forward and
// backward, in fp32 and bf16, for Qwen3-MoE's, Mixtral's and Qwen2-MoE's
// (shared expert) routing, whatever the groups and whether a group's tensors
// hold every expert or only its own; the load-balancing loss's statistics
// and gradient are the whole MLP's too.
#include "tests/catch_torch.h"

#include <string>
#include <utility>
#include <vector>

#include "gpu/blocks/moe.h"
#include "gpu/blocks/moe_cut.h"

using namespace strider;

namespace {

enum class Routing { kQwen3, kMixtral, kQwen2Shared };

BlockDims moe_dims(Routing routing) {
  BlockDims d;
  d.hidden = 32;
  d.moe.experts = 6;
  d.moe.top_k = 2;
  d.moe.intermediate = 16;
  d.moe.norm_topk = routing != Routing::kQwen2Shared;
  d.moe.scores_fp32 = routing == Routing::kMixtral;
  if (routing == Routing::kQwen2Shared) d.moe.shared_intermediate = 24;
  return d;
}

// Random MoE weights in `dtype` and zeroed fp32 accumulators.
std::pair<TensorMap, TensorMap> random_moe(const BlockDims& d, at::ScalarType dtype, uint64_t seed) {
  at::manual_seed(seed);
  const int64_t E = d.moe.experts, H = d.hidden, I = d.moe.intermediate, S = d.moe.shared_intermediate;
  TensorMap w, grads;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    w.emplace(name, (at::randn(shape) * 0.3).to(dtype));
    grads.emplace(name, at::zeros(shape, at::kFloat));
  };
  add("mlp.gate.weight", {E, H});
  add("mlp.experts.gate_up_proj", {E, 2 * I, H});
  add("mlp.experts.down_proj", {E, H, I});
  if (S > 0) {
    add("mlp.shared_expert.gate_proj.weight", {S, H});
    add("mlp.shared_expert.up_proj.weight", {S, H});
    add("mlp.shared_expert.down_proj.weight", {H, S});
    add("mlp.shared_expert_gate.weight", {1, H});
  }
  return {w, grads};
}

TensorMap zeros_like_map(const TensorMap& m) {
  TensorMap out;
  for (const auto& [k, v] : m) out.emplace(k, at::zeros_like(v));
  return out;
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

const char* name(Routing r) {
  return r == Routing::kQwen3 ? "qwen3" : r == Routing::kMixtral ? "mixtral" : "qwen2 shared";
}

}  // namespace

TEST_CASE("moe cut: the router and groups of experts give the whole MLP's bits, forward and backward",
          "[gpu][moe_cut]") {
  const std::vector<std::vector<std::pair<int64_t, int64_t>>> cuts = {
      {{0, 6}}, {{0, 1}, {1, 2}, {2, 3}, {3, 4}, {4, 5}, {5, 6}}, {{0, 2}, {2, 3}, {3, 6}}};
  for (Routing routing : {Routing::kQwen3, Routing::kMixtral, Routing::kQwen2Shared})
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const BlockDims d = moe_dims(routing);
      const int64_t n = 37, E = d.moe.experts;
      auto [w, grads] = random_moe(d, dtype, 5);
      at::manual_seed(6);
      const at::Tensor h = at::randn({n, d.hidden}).to(dtype);
      const at::Tensor gy = (at::randn({n, d.hidden}) * 0.1).to(dtype);
      // The load-balancing loss's statistics and weight, as the engine gives them.
      auto step_of = [&](at::Tensor& stats) {
        stats = at::zeros({2, E}, at::kFloat);
        MoeStep st;
        st.stats = stats;
        st.aux_scale = 0.01;
        st.rows = double(n);
        return st;
      };
      at::Tensor whole_stats;
      MoeStep whole_step = step_of(whole_stats);
      const at::Tensor out = moe_forward(d, w, h, &whole_step);
      const at::Tensor dh = moe_backward(d, w, grads, h, gy, &whole_step);

      for (size_t c = 0; c < cuts.size(); ++c) {
        INFO(name(routing) << " " << (dtype == at::kFloat ? "fp32" : "bf16") << ", cut " << c);
        at::Tensor stats;
        MoeStep st = step_of(stats);
        const MoeRoute r = moe_route(d, w, h, &st);
        at::Tensor sum = at::zeros_like(h);
        for (auto [e0, e1] : cuts[c]) moe_experts_forward(d, w, e0, e1, h, r, sum);
        if (d.moe.shared_intermediate > 0) sum.add_(moe_shared_forward(d, w, h));
        CHECK(same_bits(sum, out));
        CHECK(same_bits(stats, whole_stats));

        // Backward: the routing made again, the groups in reverse; odd groups
        // hold only their own experts' tensors and gradients, as a cache
        // unit's piece does.
        TensorMap g = zeros_like_map(grads);
        const MoeRoute again = moe_route(d, w, h);
        at::Tensor dsum = at::zeros_like(h);
        at::Tensor dscores = at::zeros({n * d.moe.top_k}, at::kFloat);
        for (size_t i = cuts[c].size(); i-- > 0;) {
          const auto [e0, e1] = cuts[c][i];
          if (i % 2 == 0) {
            moe_experts_backward(d, w, g, e0, e1, h, gy, again, dsum, dscores);
            continue;
          }
          TensorMap wg = w, gg;
          for (const char* t : {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}) {
            wg[t] = w.at(t).slice(0, e0, e1).clone();
            gg.emplace(t, at::zeros_like(g.at(t).slice(0, e0, e1)));
          }
          moe_experts_backward(d, wg, gg, e0, e1, h, gy, again, dsum, dscores);
          for (const auto& [t, v] : gg) g.at(t).slice(0, e0, e1).copy_(v);
        }
        if (d.moe.shared_intermediate > 0) moe_shared_backward(d, w, g, h, gy, dsum);
        moe_router_backward(d, w, g, h, dscores, dsum, &st);
        CHECK(same_bits(dsum, dh));
        for (const auto& [t, v] : grads) {
          INFO(t);
          CHECK(same_bits(g.at(t), v));
        }
      }
    }
}

TEST_CASE("moe cut: a group outside the experts, or tensors of another group's size, are refused by name",
          "[gpu][moe_cut]") {
  const BlockDims d = moe_dims(Routing::kQwen3);
  auto [w, grads] = random_moe(d, at::kFloat, 1);
  const at::Tensor h = at::randn({5, d.hidden});
  const MoeRoute r = moe_route(d, w, h);
  at::Tensor out = at::zeros_like(h);
  CHECK_THROWS_WITH(moe_experts_forward(d, w, 4, 7, h, r, out),
                    Catch::Contains("moe_experts_forward") && Catch::Contains("experts [4, 7) of 6"));
  CHECK_THROWS_WITH(moe_experts_forward(d, w, 2, 2, h, r, out), Catch::Contains("experts [2, 2) of 6"));
  TensorMap wg = w;
  wg["mlp.experts.down_proj"] = w.at("mlp.experts.down_proj").slice(0, 0, 3);
  CHECK_THROWS_WITH(moe_experts_forward(d, wg, 0, 2, h, r, out),
                    Catch::Contains("mlp.experts.down_proj: 3 experts, expected 6 (every expert) or 2"));
  BlockDims dense = d;
  dense.moe = {};
  CHECK_THROWS_WITH(moe_route(dense, w, h), Catch::Contains("moe_route") && Catch::Contains("layer with experts"));
}
