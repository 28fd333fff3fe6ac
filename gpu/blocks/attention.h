// Internal to gpu/: a decoder layer's attention core (gpu/blocks/blocks.cpp), from
// its q, k and v projections to o_proj's input: the q/k norms, RoPE and
// SDPA (Gemma 2's soft-capped attention: gpu/blocks/softcap_attention.h), forward
// and backward.
//
// Query tiles (long context): K and V are built whole (with grouped-query
// attention they are small), the queries go a tile of positions at a time
// (attention_query_tile), each tile's q/k norm, RoPE and SDPA on its own, so
// that no [tokens, heads x head_dim] intermediate beyond the core's input
// and output is alive for all tokens at once. SDPA's is_causal aligns a
// short query block top-left, so a tile's keys are cut at its first query:
// the keys before it (all seen, no causal mask) and the tile's own square
// (causal), two kernel calls whose outputs are merged by their log-sum-exp.
// An untiled layer is the one tile [0, s): a single call, as ever.
//
// A kept layer (gpu/blocks/blocks.h, LayerSaved) keeps the core's output and the
// fused kernel's log-sum-exp (a tiled one, the merged ones), and its
// backward calls the kernel's own backward with them: the core is not run
// again. The flash kernels' backward, given a part's keys and the merged
// output and log-sum-exp, gives that part's share of the gradients (the
// probabilities it rebuilds are the merged softmax's), so the tiles' parts
// add up to the whole. A layer that keeps nothing runs the tiled forward
// again in its backward to get the same output and log-sum-exp, so its
// gradients are the kept layer's bits. The kernels with a backward to call
// are ATen's flash attention (the CPU's, for fp32 and 16 bits, with grouped
// K/V and masks; on CUDA the flash kernel, 16 bits without a mask).
// Elsewhere (soft-capped scores, another CUDA kernel) each tile is one SDPA
// call over all the keys it sees (a mask gives its causal offset), rebuilt
// with autograd in the backward.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "gpu/blocks/blocks.h"

namespace strider {

// x * cos + rotate_half(x) * sin for x [b, s, heads, head_dim], as
// transformers computes it (gpu/blocks/attention.cpp).
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope);

// Which backward a core gets: kAuto, the kernel's own where it has one (the
// core is rebuilt with autograd elsewhere); kRebuilt, rebuilt with autograd
// whatever the kernel, the path CUDA's kernels without a backward to call
// take, so that it runs on the CPU device in the tests too.
enum class AttentionPath { kAuto, kRebuilt };

// The core of the projections ([b, s, features] each) as [b, s, heads *
// head_dim], in query tiles of `tile` positions (attention_query_tile; s:
// untiled), without grad. `keep` (a kept layer's LayerSaved): receives the
// output (`attn`) and, where the kernel has a backward to call, its
// log-sum-exp (`lse`; zeros elsewhere); the output is the same bits either
// way. `w`: the q/k norms' weights where the layer has them.
at::Tensor attention_core(const BlockDims& d, const TensorMap& w, const TokenLayout& layout, at::Tensor q_proj,
                          at::Tensor k_proj, at::Tensor v_proj, int64_t tile, const LayerSaved* keep = nullptr,
                          AttentionPath path = AttentionPath::kAuto);

// The core for a backward, from the projections (kept, or recomputed; no
// grad) and what attention_core kept for them (`kept`, or nullptr: the core
// runs again here, tiles as attention_core's). `w`: the q/k norms' weights,
// leaves where their gradients are wanted (`norm_grads`). `out` is o_proj's
// input, [b, s, heads * head_dim], without a graph.
// SDPA's keys and values, [b, kv_heads (heads where repeated), s,
// head_dim] each, after the k norm and RoPE, and how SDPA is called: with
// grouped K/V, under a mask (a window below s, packed documents), by the
// kernel's own backward (direct), the kernel ATen chose (choice: its
// sdp::SDPBackend number, 0 math).
struct AttentionKeys {
  at::Tensor k, v;
  bool grouped = false, masked = false, direct = false;
  std::optional<double> scale;
  int64_t choice = 0;
  AttentionKeys detached() const {
    AttentionKeys c = *this;
    c.k = k.detach(), c.v = v.detach();
    return c;
  }
};

struct AttentionGraph {
  const BlockDims* d = nullptr;
  const TokenLayout* layout = nullptr;
  TensorMap w;
  bool norm_grads = false;
  int64_t tile = 0;
  at::Tensor q_proj, out, lse;   // the projections' q; the core's output and (direct) log-sum-exp
  at::Tensor k_leaf, v_leaf;     // leaves of the k and v projections
  AttentionKeys keys;            // K and V with their graph from the leaves
  at::Tensor q_leaf, graph_out;  // a one-tile core rebuilt with autograd (not direct)
};
AttentionGraph attention_graph(const BlockDims& d, const TensorMap& w, bool norm_grads, const TokenLayout& layout,
                               const at::Tensor& q_proj, const at::Tensor& k_proj, const at::Tensor& v_proj,
                               int64_t tile, const LayerSaved* kept, AttentionPath path = AttentionPath::kAuto);

// d(loss)/d(projections) ([b, s, features] each, the compute dtype) given
// da = d(loss)/d(out) ([b, s, heads * head_dim]), and the q/k norms'
// weights' gradients where the graph wants them. Consumes the graph.
struct AttentionGrads {
  at::Tensor q, k, v, q_norm, k_norm;
};
AttentionGrads attention_grads(AttentionGraph& g, const at::Tensor& da);

}  // namespace strider
