// LayerSaved's layout in a flat buffer (gpu/blocks.h).
#include "gpu/blocks.h"
#include "host/error.h"

namespace strider {

int64_t layer_saved_elems(const BlockDims& d, int64_t tokens) {
  const int64_t q = d.heads * d.head_dim, kv = d.kv_heads * d.head_dim;
  const int64_t mlp = d.moe.sparse() ? 0 : d.intermediate;  // a layer with experts recomputes its MLP
  return tokens * (q + 2 * kv + d.hidden + 2 * mlp);
}

LayerSaved layer_saved_views(const BlockDims& d, int64_t tokens, const at::Tensor& flat) {
  STRIDER_CHECK(flat.dim() == 1 && flat.numel() >= layer_saved_elems(d, tokens),
                "saved activations: a flat buffer of {} elements is smaller than {} tokens need ({})",
                flat.numel(), tokens, layer_saved_elems(d, tokens));
  int64_t at = 0;
  auto next = [&](int64_t features) {
    at::Tensor v = flat.slice(0, at, at + tokens * features).view({tokens, features});
    at += tokens * features;
    return v;
  };
  const int64_t q = d.heads * d.head_dim, kv = d.kv_heads * d.head_dim;
  LayerSaved s;
  s.q = next(q);
  s.k = next(kv);
  s.v = next(kv);
  s.x1 = next(d.hidden);
  const int64_t mlp = d.moe.sparse() ? 0 : d.intermediate;
  s.gate = next(mlp);
  s.up = next(mlp);
  return s;
}

}  // namespace strider
