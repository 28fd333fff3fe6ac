// The embedding and its vocabulary shards, forward and backward (gpu/blocks/blocks.h).
#include "gpu/blocks/blocks.h"

namespace strider {

double embedding_scale(const BlockDims& d, at::ScalarType dtype) {
  if (!d.embedding_multiplier_in_dtype) return d.embedding_multiplier;
  return at::scalar_tensor(d.embedding_multiplier, at::kDouble).to(dtype).item<double>();
}

at::Tensor embedding_forward(const at::Tensor& weight, const at::Tensor& ids, double scale) {
  at::Tensor out = at::embedding(weight, ids);
  return scale == 1.0 ? out : out.mul_(scale);
}

namespace {
// Adds rows `from` ([tokens, hidden]) into the rows `at` of `acc`, a token's
// rows summed first (in token order) and added to its accumulator row once:
// the micro-batch's gradient, then the sum over micro-batches. So one process
// with M micro-batches adds ((g0 + g1) + g2) per row, exactly as M
// data-parallel ranks with one micro-batch each sum theirs (rank order),
// rather than folding each token's row into the running sum by itself.
// `scale`: the embedding's output scale (BlockDims::embedding_multiplier),
// applied to each row of `from` (in fp32) before it is summed.
// `skip` (>= 0): the row of the padding token (BlockDims::pad_token, in
// acc's rows), whose positions add nothing, as torch's padding_idx.
void add_rows_per_token(const at::Tensor& acc, at::Tensor at, at::Tensor from, double scale, int64_t skip) {
  if (skip >= 0) {
    const at::Tensor keep = (at != skip).nonzero().squeeze(1);
    if (keep.size(0) < at.size(0)) {
      at = at.index_select(0, keep);
      from = from.index_select(0, keep);
    }
  }
  auto [tokens, slot] = at::_unique(at, /*sorted=*/true, /*return_inverse=*/true);
  at::Tensor sums = at::zeros({tokens.size(0), from.size(1)}, from.options().dtype(at::kFloat));
  sums.index_add_(0, slot, scale == 1.0 ? from.to(at::kFloat) : from.to(at::kFloat) * scale);
  acc.index_add_(0, tokens, sums);
}
}  // namespace

void embedding_backward(const at::Tensor& ids, const at::Tensor& grad_out, at::Tensor& grad_weight, double scale,
                        int64_t pad) {
  const int64_t hidden = grad_weight.size(1);
  add_rows_per_token(grad_weight, ids.reshape({-1}), grad_out.reshape({-1, hidden}), scale, pad);
}

void embedding_shard_forward(const at::Tensor& rows, int64_t v0, const at::Tensor& ids, const at::Tensor& out,
                             double scale) {
  const int64_t n = rows.size(0), hidden = rows.size(1);
  at::Tensor flat_ids = ids.reshape({-1});
  at::Tensor sel = ((flat_ids >= v0) & (flat_ids < v0 + n)).nonzero().squeeze(1);  // token positions, in order
  at::Tensor flat_out = out.view({-1, hidden});
  at::Tensor picked = rows.index_select(0, flat_ids.index_select(0, sel) - v0);
  flat_out.index_copy_(0, sel, scale == 1.0 ? picked : picked.mul_(scale));
}

void embedding_shard_backward(const at::Tensor& ids, int64_t v0, const at::Tensor& grad_out,
                              const at::Tensor& grad_rows, double scale, int64_t pad) {
  const int64_t n = grad_rows.size(0), hidden = grad_rows.size(1);
  at::Tensor flat_ids = ids.reshape({-1});
  at::Tensor sel = ((flat_ids >= v0) & (flat_ids < v0 + n)).nonzero().squeeze(1);
  add_rows_per_token(grad_rows, flat_ids.index_select(0, sel) - v0, grad_out.reshape({-1, hidden}).index_select(0, sel),
                     scale, pad >= v0 && pad < v0 + n ? pad - v0 : -1);
}

}  // namespace strider
