// Internal to gpu/: a decoder layer's attention core (gpu/blocks.cpp), from
// its q, k and v projections to o_proj's input: the q/k norms, RoPE and
// SDPA (Gemma 2's soft-capped attention: gpu/softcap_attention.h), forward
// and backward.
//
// A kept layer (gpu/blocks.h, LayerSaved) keeps the core's output and the
// fused kernel's log-sum-exp, and its backward calls the kernel's own
// backward with them: the core is not run again. Autograd's SDPA node calls
// that same backward with the same tensors, so the gradients are the
// recomputing backward's bits. That holds where the kernel is ATen's flash
// attention (the CPU's, for fp32 and 16 bits, with grouped K/V and masks; on
// CUDA the flash kernel, 16 bits without a mask); elsewhere (soft-capped
// scores, another CUDA kernel) the backward rebuilds the core with autograd,
// as a layer that keeps nothing does.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "gpu/blocks.h"

namespace strider {

// x * cos + rotate_half(x) * sin for x [b, s, heads, head_dim], as
// transformers computes it (gpu/attention.cpp).
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope);

// The core of the projections ([b, s, features] each) as [b, s, heads *
// head_dim], on tensors that may require grad. `keep` (a kept layer's
// LayerSaved, no grad): receives the output (`attn`) and, where the kernel
// has a backward to call, its log-sum-exp (`lse`); the output is the same
// bits either way.
at::Tensor attention_core(const BlockDims& d, const TensorMap& w, const TokenLayout& layout, at::Tensor q_proj,
                          at::Tensor k_proj, at::Tensor v_proj, const LayerSaved* keep = nullptr);

// The core for a backward, on `inputs`: leaves of q_proj, k_proj and v_proj
// (and of the q/k norms' weights where they train; `w` has them under their
// names). `out` is o_proj's input, [b, s, heads * head_dim], without a graph.
// With `kept` (what attention_core kept for these projections) and a kernel
// whose backward can be called, only the elementwise steps before SDPA are
// rebuilt; otherwise the whole core is, with autograd.
struct AttentionGraph {
  at::Tensor out;
  // Rebuilt: the core's output with autograd's graph. Direct: SDPA's
  // inputs with theirs, the kept output (in the kernel's layout) and
  // log-sum-exp, and what the kernel was called with.
  at::Tensor graph_out, q, k, v, kept_out, lse, mask;
  bool causal = true;
  std::optional<double> scale;
  bool direct() const { return lse.defined(); }
};
AttentionGraph attention_graph(const BlockDims& d, const TensorMap& w, const TokenLayout& layout,
                               const std::vector<at::Tensor>& inputs, const LayerSaved* kept);

// d(loss)/d(inputs) given da = d(loss)/d(out) ([b, s, heads * head_dim]).
// Consumes the graph.
std::vector<at::Tensor> attention_grads(AttentionGraph& g, const std::vector<at::Tensor>& inputs,
                                        const at::Tensor& da);

}  // namespace strider
