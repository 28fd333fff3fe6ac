// Internal to engine/: the working memory of gpu/blocks' decoder layer, the
// part of ModelSpec::cost (engine/model/model_spec.cpp) that follows the layer's
// code phase by phase.
#pragma once

#include <cstdint>

#include "gpu/blocks/block_dims.h"
#include "gpu/memory/work_calibration.h"

namespace strider {

// The working memory of gpu/blocks' decoder layer for a micro-batch of
// batch x seq tokens: the peak of ATen's allocations above what was live
// before the call (its output included), phase by phase in the order
// gpu/blocks/blocks.cpp runs them. tests/engine/test_layer_memory measures it on the
// CPU and holds it within [0.7, 1] of this.
//
// Per token unless said otherwise; e = compute dtype bytes; H, Q, KV = hidden,
// heads x head_dim, kv_heads x head_dim; I = intermediate; t = the token
// tile; aq = the attention query tile (positions), T = batch x aq.
// Nothing grows with seq^2 (SDPA's flash kernels) and nothing with
// tokens x intermediate beyond one tile.
struct LayerWork {
  __int128 forward = 0, backward = 0;
};
LayerWork layer_work(const BlockDims& d, int64_t batch, int64_t seq, int64_t token_tile, int dtype_bytes,
                     const WorkCoefficients& k, bool packed);

}  // namespace strider
