// RMSNorm and RoPE's cos/sin tables (gpu/blocks/blocks.h), as transformers computes them.
#include <cmath>

#include "gpu/blocks/blocks.h"

namespace strider {
namespace {

// Inverse frequencies in fp32, including the rope_type's scaling.
at::Tensor inv_freq(const RopeDims& r, int64_t head_dim) {
  at::Tensor exps = at::arange(0, head_dim, 2, at::kLong).to(at::kFloat) / double(head_dim);
  at::Tensor inv = at::pow(r.theta, exps).reciprocal();
  switch (r.type) {
    case RopeType::kDefault: return inv;
    case RopeType::kLinear: return inv / r.factor;
    case RopeType::kLongrope: break;  // per sequence length: rope_tables
    case RopeType::kLlama3: {
      const double old_ctx = double(r.original_max_position);
      const double low_wavelen = old_ctx / r.low_freq_factor;
      const double high_wavelen = old_ctx / r.high_freq_factor;
      at::Tensor wavelen = 2 * M_PI / inv;
      at::Tensor scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
      at::Tensor smooth = (old_ctx / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
      at::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
      at::Tensor medium = at::logical_not(wavelen < high_wavelen) & at::logical_not(wavelen > low_wavelen);
      return at::where(medium, smoothed, scaled);
    }
  }
  return inv;
}

}  // namespace

RopeTables rope_tables(const RopeDims& rope, int64_t head_dim, int64_t seq, at::ScalarType dtype,
                       at::Device device, int64_t longest) {
  if (longest < 0) longest = seq;
  const int64_t dim = rope.rotary_dim(head_dim);
  at::Tensor inv;
  if (rope.type == RopeType::kLongrope) {  // transformers' 1 / (factors * base^(2i / dim))
    const std::vector<double>& f = longest > rope.original_max_position ? rope.long_factor : rope.short_factor;
    const at::Tensor ext = at::tensor(f, at::kDouble).to(at::kFloat);
    inv = (ext * at::pow(rope.theta, at::arange(0, dim, 2, at::kLong).to(at::kFloat) / double(dim))).reciprocal();
  } else {
    inv = inv_freq(rope, dim);
  }
  at::Tensor pos = at::arange(seq, at::kLong).to(at::kFloat);
  at::Tensor freqs = at::outer(pos, inv);           // [seq, dim / 2], fp32
  at::Tensor emb = at::cat({freqs, freqs}, -1);     // [seq, dim]
  at::Tensor cos = emb.cos(), sin = emb.sin();
  if (rope.attention_factor != 1.0) {
    cos = cos * rope.attention_factor;
    sin = sin * rope.attention_factor;
  }
  return {cos.to(dtype).to(device), sin.to(dtype).to(device)};
}

TokenLayout token_layout(const RopeTables& tables, const at::Tensor& positions) {
  const int64_t b = positions.size(0), s = positions.size(1), dim = tables.cos.size(-1);
  const at::Tensor flat = positions.reshape({-1});
  RopeTables rows{tables.cos.index_select(0, flat).view({b, s, dim}), tables.sin.index_select(0, flat).view({b, s, dim})};
  const at::Tensor starts = positions.slice(1, 1).sub(positions.slice(1, 0, s - 1)).ne_(1);  // [b, s - 1]
  at::Tensor docs = at::zeros({b, s}, positions.options());
  docs.slice(1, 1).copy_(starts.cumsum(1));
  return {std::move(rows), std::move(docs)};
}


at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, NormKind kind) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  at::Tensor n = xf * at::rsqrt(var + eps);
  switch (kind) {
    case NormKind::kLlama: break;
    case NormKind::kFp32Weight: return (weight * n).to(x.scalar_type());
    case NormKind::kGemma: return (n * (weight.to(at::kFloat) + 1.0)).to(x.scalar_type());
  }
  return weight * n.to(x.scalar_type());
}

}  // namespace strider
