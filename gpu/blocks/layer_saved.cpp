// LayerSaved's layout in a flat buffer (gpu/blocks/blocks.h).
#include "gpu/blocks/blocks.h"
#include "host/error.h"

namespace strider {
namespace {

// Whether the layer keeps its attention core's output and log-sum-exp:
// all but soft-capped attention, whose backward rebuilds the core.
bool keeps_core(const BlockDims& d) { return d.attn_softcap == 0; }

// The log-sum-exp's elements in the compute dtype: tokens x heads fp32
// values, rounded up to 16 bytes so that what follows stays aligned.
int64_t lse_elems(const BlockDims& d, int64_t tokens, int64_t dtype_bytes) {
  if (!keeps_core(d)) return 0;
  const int64_t bytes = (tokens * d.heads * 4 + 15) / 16 * 16;
  return bytes / dtype_bytes;
}

}  // namespace

int64_t layer_saved_elems(const BlockDims& d, int64_t tokens, int64_t dtype_bytes) {
  STRIDER_CHECK(dtype_bytes == 2 || dtype_bytes == 4, "saved activations: a compute dtype of {} bytes (2 or 4)",
                dtype_bytes);
  const int64_t q = d.heads * d.head_dim, kv = d.kv_heads * d.head_dim;
  const int64_t attn = keeps_core(d) ? q : 0;
  const int64_t mlp = d.moe.sparse() ? 0 : d.intermediate;  // a layer with experts recomputes its MLP
  return lse_elems(d, tokens, dtype_bytes) + tokens * (q + 2 * kv + attn + d.hidden + 2 * mlp);
}

LayerSaved layer_saved_views(const BlockDims& d, int64_t tokens, const at::Tensor& flat) {
  const int64_t e = int64_t(flat.element_size());
  STRIDER_CHECK(flat.dim() == 1 && flat.numel() >= layer_saved_elems(d, tokens, e),
                "saved activations: a flat buffer of {} elements is smaller than {} tokens need ({})",
                flat.numel(), tokens, layer_saved_elems(d, tokens, e));
  STRIDER_CHECK(reinterpret_cast<uintptr_t>(flat.data_ptr()) % 4 == 0,
                "saved activations: the flat buffer's first element must be 4-byte aligned (the log-sum-exp is fp32)");
  int64_t at = 0;
  auto next = [&](int64_t features) {
    at::Tensor v = flat.slice(0, at, at + tokens * features).view({tokens, features});
    at += tokens * features;
    return v;
  };
  const int64_t q = d.heads * d.head_dim, kv = d.kv_heads * d.head_dim;
  LayerSaved s;
  if (keeps_core(d)) {
    at = lse_elems(d, tokens, e);
    s.lse = flat.slice(0, 0, at).view(at::kFloat).slice(0, 0, tokens * d.heads);
  }
  s.q = next(q);
  s.k = next(kv);
  s.v = next(kv);
  if (keeps_core(d)) s.attn = next(q);
  s.x1 = next(d.hidden);
  const int64_t mlp = d.moe.sparse() ? 0 : d.intermediate;
  s.gate = next(mlp);
  s.up = next(mlp);
  return s;
}

}  // namespace strider
