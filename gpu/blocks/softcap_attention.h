// Attention with soft-capped scores (Gemma 2): cap * tanh(scale * q k^T / cap)
// before the causal (and sliding-window) mask and the softmax, which no SDPA
// kernel computes (transformers runs it eagerly, the whole [s, s] scores at
// once). Here the queries go in tiles: one tile's scores, [b, kv_heads,
// group * tile, keys], are alive at a time, in the forward and in the backward,
// which recomputes each tile's scores (a custom autograd function), so the
// working memory is O(tile x seq), counted by ModelSpec::cost.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "gpu/blocks/block_dims.h"  // softcap_query_tile

namespace strider {

// q [b, heads, s, head_dim], k and v [b, kv_heads, s, head_dim] (heads a
// multiple of kv_heads; query head h reads key/value head h / (heads /
// kv_heads)) -> [b, heads, s, head_dim], as transformers' eager attention
// computes it: scores = (q k^T) * scale, then / cap, tanh, * cap, plus the
// mask (causal; within `window` positions, itself included, when window > 0;
// within a document where `docs` [b, s] numbers each token's, as TokenLayout
// does), softmax in fp32 cast back, times v. Differentiable in q, k and v.
// `tile`: queries per tile, 0 for softcap_query_tile's.
at::Tensor softcap_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, double cap,
                             int64_t window, int64_t tile = 0, const at::Tensor& docs = {});

}  // namespace strider
