// The block's linear projections with their LoRA adapters: forward (one GEMM
// for a group's adapters), the weight and bias gradients, and the input's
// gradient with the adapters' share. gpu/blocks/blocks.cpp calls them for the
// attention half and the MLP.
#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "gpu/blocks/block_parts.h"
#include "gpu/blocks/weight_grad.h"
#include "host/error.h"

namespace strider {
namespace block_parts {

namespace {  // what only this file's functions use

at::Tensor optional_weight(const TensorMap& w, std::string_view name) {
  auto it = w.find(name);
  return it == w.end() ? at::Tensor() : it->second;
}

// The LoRA adapters of projections that read one input (q, k and v; gate
// and up; o; down), those of them the block has: A [r, in] and B [out, r]
// each. x A^T is one GEMM for the group, over the A's stacked: a GEMM of r
// (16) output columns costs far more than its FLOPs (on a CPU its fixed
// overhead dominates), so the adapters' GEMMs are grouped wherever they share
// an operand (bench/bench_vs_torch.py --lora times the LoRA step).
struct Adapters {
  std::vector<std::string> projs;
  std::vector<at::Tensor> b;
  std::vector<int64_t> at;  // each adapter's first row of `a`
  at::Tensor a;             // the A's stacked: [sum of r, in]
  bool empty() const { return projs.empty(); }
};
Adapters adapters(const TensorMap& w, std::initializer_list<const char*> projs) {
  Adapters g;
  std::vector<at::Tensor> a;
  int64_t rows = 0;
  for (const char* proj : projs) {
    auto it = w.find(std::string(proj) + ".lora_A.weight");
    if (it == w.end()) continue;
    g.projs.emplace_back(proj);
    g.at.push_back(rows);
    rows += it->second.size(0);
    a.push_back(it->second);
    g.b.push_back(weight(w, std::string(proj) + ".lora_B.weight"));
  }
  if (!a.empty()) g.a = a.size() == 1 ? a[0] : at::cat(a);
  return g;
}

at::Tensor base_linear(const at::Tensor& x, const TensorMap& w, const std::string& proj) {
  return at::linear(x, weight(w, proj + ".weight"), optional_weight(w, proj + ".bias"));
}

}  // namespace

// The projections `projs` of x (one input), each x W^T (+ b) plus its
// adapter's scale (x A^T) B^T: PEFT's lora.Linear's sum, with the adapter's
// GEMM accumulating into the base's output (addmm_, scaled there), so the
// adapters add no pass over the [tokens, out] outputs.
std::vector<at::Tensor> linears(const BlockDims& d, const at::Tensor& x, const TensorMap& w,
                                std::initializer_list<const char*> projs) {
  std::vector<at::Tensor> y;
  for (const char* proj : projs) y.push_back(base_linear(x, w, proj));
  const Adapters g = adapters(w, projs);
  if (g.empty()) return y;
  const at::Tensor u = at::linear(x, g.a).reshape({-1, g.a.size(0)});
  for (size_t i = 0; i < g.projs.size(); ++i) {
    const size_t k = size_t(std::find(projs.begin(), projs.end(), g.projs[i]) - projs.begin());
    const at::Tensor& b = g.b[i];
    y[k].view({-1, b.size(0)}).addmm_(u.narrow(1, g.at[i], b.size(1)), b.t(), 1.0, d.lora_scale);
  }
  return y;
}
at::Tensor linear(const BlockDims& d, const at::Tensor& x, const TensorMap& w, const char* proj) {
  return linears(d, x, w, {proj})[0];
}

// y = x W^T (+ b) for 2-D dy = dL/dy and x: adds dL/dW = dy^T x (and dL/db,
// summed in fp32) into the fp32 accumulators of `proj`, with no rounding to
// the compute dtype (gpu/blocks/weight_grad.h). A tensor without an
// accumulator is frozen (BlockRunner gives accumulators to the trainable
// tensors only): its gradient is not computed.
void add_linear_grads(TensorMap& grads, const std::string& proj, const at::Tensor& dy, const at::Tensor& x) {
  if (auto it = grads.find(proj + ".weight"); it != grads.end()) add_weight_grad(it->second, dy.t(), x);
  if (auto it = grads.find(proj + ".bias"); it != grads.end()) it->second.add_(dy.sum({0}, false, at::kFloat));
}

// d(loss)/dx of the projections `projs` of one 2-D input x, given their
// output gradients `dys` (2-D, in the same order): the sum of dy W, plus
// their adapters' share. On the way, adds the adapters' gradients: dB =
// s dy^T (x A^T), dA = du^T x with du = s dy B, and dx gains du A (the
// group's du side by side: du A is one GEMM for the group; the scale goes on
// dB's sum and the [tokens, r] product, not on dy).
at::Tensor linears_input_grad(const BlockDims& d, const TensorMap& w, TensorMap& grads,
                              std::initializer_list<const char*> projs, const std::vector<at::Tensor>& dys,
                              const at::Tensor& x) {
  at::Tensor dx;
  size_t k = 0;
  for (const char* proj : projs) {
    const at::Tensor part = at::mm(dys[k++], weight(w, std::string(proj) + ".weight"));
    dx = dx.defined() ? dx.add_(part) : part;
  }
  const Adapters g = adapters(w, projs);
  if (g.empty()) return dx;
  const at::Tensor u = at::mm(x, g.a.t());
  at::Tensor du = at::empty({x.size(0), g.a.size(0)}, x.options());
  for (size_t i = 0; i < g.projs.size(); ++i) {
    const int64_t r = g.b[i].size(1);
    const at::Tensor& dy = dys[size_t(std::find(projs.begin(), projs.end(), g.projs[i]) - projs.begin())];
    if (auto it = grads.find(g.projs[i] + ".lora_B.weight"); it != grads.end())
      add_weight_grad(it->second, dy.t(), u.narrow(1, g.at[i], r), d.lora_scale);
    du.narrow(1, g.at[i], r).copy_(at::mm(dy, g.b[i]).mul_(d.lora_scale));
  }
  for (size_t i = 0; i < g.projs.size(); ++i)
    if (auto it = grads.find(g.projs[i] + ".lora_A.weight"); it != grads.end())
      add_weight_grad(it->second, du.narrow(1, g.at[i], g.b[i].size(1)).t(), x);
  return dx.add_(at::mm(du, g.a));
}

}  // namespace block_parts
}  // namespace strider
