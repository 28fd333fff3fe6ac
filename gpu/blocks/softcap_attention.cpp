#include "gpu/blocks/softcap_attention.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <limits>

#include "host/error.h"

namespace strider {
namespace {

// Query rows [t0, t1) read keys [k0, t1): the causal mask hides every later
// key, the window every key at or before t0 - window.
int64_t first_key(int64_t t0, int64_t window) { return window > 0 ? std::max<int64_t>(0, t0 - window + 1) : 0; }

// The tile's additive mask in `options`' dtype: 0 where query i sees key j
// (j <= i, i - j < window, the same document), -inf elsewhere;
// [t1 - t0, t1 - k0], or [b, 1, 1, t1 - t0, t1 - k0] with documents (docs
// [b, s]: each token's document; empty: one per row).
at::Tensor tile_mask(int64_t t0, int64_t t1, int64_t k0, int64_t window, const at::Tensor& docs,
                     const at::TensorOptions& options) {
  const at::Tensor i = at::arange(t0, t1, options.dtype(at::kLong)).unsqueeze(1);
  const at::Tensor j = at::arange(k0, t1, options.dtype(at::kLong)).unsqueeze(0);
  at::Tensor hidden = j > i;
  if (window > 0) hidden.logical_or_(j <= i - window);
  if (docs.numel() > 0)
    hidden = hidden.logical_or(docs.slice(1, t0, t1).unsqueeze(2) != docs.slice(1, k0, t1).unsqueeze(1))
                 .view({docs.size(0), 1, 1, t1 - t0, t1 - k0});
  return at::zeros(hidden.sizes(), options).masked_fill_(hidden, -std::numeric_limits<double>::infinity());
}

// One tile's output [b, heads, tq, hd] from its queries qt [b, heads, tq, hd]
// and its keys and values [b, kv, keys, hd], with the ops (and their order)
// of transformers' eager attention; under autograd when the caller enables it.
at::Tensor tile_attention(const at::Tensor& qt, const at::Tensor& kt, const at::Tensor& vt, const at::Tensor& mask,
                          double scale, double cap) {
  const int64_t b = qt.size(0), heads = qt.size(1), tq = qt.size(2), hd = qt.size(3), kv = kt.size(1);
  const int64_t g = heads / kv, keys = kt.size(2);
  // The group's queries side by side: one GEMM per K/V head, K/V read in place.
  const at::Tensor q = qt.reshape({b, kv, g * tq, hd});
  at::Tensor scores = at::matmul(q, kt.transpose(-1, -2)) * scale;  // [b, kv, g * tq, keys]
  scores = at::tanh(scores / cap) * cap;
  scores = (scores.view({b, kv, g, tq, keys}) + mask).view({b, kv, g * tq, keys});
  const at::Tensor p = at::softmax(scores, -1, at::kFloat).to(qt.scalar_type());
  return at::matmul(p, vt).view({b, heads, tq, hd});
}

struct SoftcapAttention : public torch::autograd::Function<SoftcapAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& docs, double scale, double cap, int64_t window,
                            int64_t tile) {
    ctx->save_for_backward({q, k, v});
    ctx->saved_data["docs"] = docs;  // empty: one document per row
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["cap"] = cap;
    ctx->saved_data["window"] = window;
    ctx->saved_data["tile"] = tile;
    const int64_t s = q.size(2);
    at::Tensor out = at::empty(q.sizes(), q.options());
    for (int64_t t0 = 0; t0 < s; t0 += tile) {
      const int64_t t1 = std::min(s, t0 + tile), k0 = first_key(t0, window);
      const at::Tensor mask = tile_mask(t0, t1, k0, window, docs, q.options());
      out.narrow(2, t0, t1 - t0)
          .copy_(tile_attention(q.narrow(2, t0, t1 - t0), k.narrow(2, k0, t1 - k0), v.narrow(2, k0, t1 - k0), mask,
                                scale, cap));
    }
    return out;
  }

  // Tile by tile: the tile's scores recomputed under autograd from leaves
  // that alias the inputs, and back-propagated; d(k) and d(v) add up over
  // the tiles that read each key.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    const double scale = ctx->saved_data["scale"].toDouble(), cap = ctx->saved_data["cap"].toDouble();
    const int64_t window = ctx->saved_data["window"].toInt(), tile = ctx->saved_data["tile"].toInt();
    const at::Tensor docs = ctx->saved_data["docs"].toTensor();
    const int64_t s = q.size(2);
    at::Tensor dq = at::empty(q.sizes(), q.options()), dk = at::zeros(k.sizes(), k.options()),
               dv = at::zeros(v.sizes(), v.options());
    at::AutoGradMode enable(true);
    for (int64_t t0 = 0; t0 < s; t0 += tile) {
      const int64_t t1 = std::min(s, t0 + tile), k0 = first_key(t0, window);
      const at::Tensor mask = tile_mask(t0, t1, k0, window, docs, q.options());
      at::Tensor qt = q.narrow(2, t0, t1 - t0).detach().requires_grad_(true);
      at::Tensor kt = k.narrow(2, k0, t1 - k0).detach().requires_grad_(true);
      at::Tensor vt = v.narrow(2, k0, t1 - k0).detach().requires_grad_(true);
      const at::Tensor o = tile_attention(qt, kt, vt, mask, scale, cap);
      const std::vector<at::Tensor> g =
          torch::autograd::grad({o}, {qt, kt, vt}, {grad_out[0].narrow(2, t0, t1 - t0)});
      dq.narrow(2, t0, t1 - t0).copy_(g[0]);
      dk.narrow(2, k0, t1 - k0).add_(g[1]);
      dv.narrow(2, k0, t1 - k0).add_(g[2]);
    }
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

int64_t softcap_query_tile(int64_t b, int64_t heads, int64_t s) {
  const int64_t per_query = std::max<int64_t>(1, b * heads * s);
  return std::clamp<int64_t>((int64_t{1} << 22) / per_query, std::min<int64_t>(16, s), std::max<int64_t>(s, 1));
}

at::Tensor softcap_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, double cap,
                             int64_t window, int64_t tile, const at::Tensor& docs) {
  STRIDER_CHECK(cap > 0 && q.size(1) % k.size(1) == 0 && tile >= 0, "softcap attention: cap {} must be > 0, {} "
                "heads a multiple of {} K/V heads and the tile {} >= 0", cap, q.size(1), k.size(1), tile);
  if (tile == 0) tile = softcap_query_tile(q.size(0), q.size(1), q.size(2));
  // An autograd Function takes no undefined tensor: no documents travel as an empty one.
  const at::Tensor d = docs.defined() ? docs : at::empty({0}, q.options().dtype(at::kLong));
  return SoftcapAttention::apply(q, k, v, d, scale, cap, window, tile);
}

}  // namespace strider
