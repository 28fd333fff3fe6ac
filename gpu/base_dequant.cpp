#include "gpu/base_dequant.h"

#include <algorithm>

namespace strider {

void dequantize_base_on_device(const BaseLayout& l, const std::byte* staging, void* params, at::ScalarType dtype,
                               c10::Device device) {
  const auto on = [&](at::ScalarType t) { return at::TensorOptions().dtype(t).device(device); };
  auto* base = const_cast<std::byte*>(staging);  // from_blob takes a mutable pointer; nothing writes it
  at::Tensor out = at::from_blob(params, {int64_t(l.elems)}, on(dtype));
  at::Tensor levels;
  if (l.format == BaseFormat::kNf4)
    levels = at::from_blob(const_cast<float*>(kNf4Levels), {16}, at::TensorOptions().dtype(at::kFloat)).to(device);
  size_t gap = 0;  // the end of the last tensor: what lies between tensors is padding, zero
  for (const BaseTensor& t : l.tensors) {
    if (t.elem_at > gap) out.slice(0, int64_t(gap), int64_t(t.elem_at)).zero_();
    gap = t.elem_at + t.numel;
    at::Tensor dst = out.slice(0, int64_t(t.elem_at), int64_t(gap));
    if (!t.quantized) {
      dst.copy_(at::from_blob(base + t.codes_at, {int64_t(t.numel)}, on(dtype)));
      continue;
    }
    at::Tensor scales = at::from_blob(base + t.scales_at, {int64_t(t.scales)}, on(at::kFloat));
    if (l.format == BaseFormat::kInt8) {
      // Whole rows per call: code * its row's scale, in fp32, then one rounding.
      at::Tensor codes = at::from_blob(base + t.codes_at, {t.rows, t.cols}, on(at::kChar));
      const int64_t step = std::max<int64_t>(1, kDequantChunkElems / std::max<int64_t>(t.cols, 1));
      at::Tensor rows = dst.view({t.rows, t.cols});
      for (int64_t r = 0; r < t.rows; r += step) {
        const int64_t e = std::min(t.rows, r + step);
        rows.slice(0, r, e).copy_(codes.slice(0, r, e).to(at::kFloat).mul_(scales.slice(0, r, e).unsqueeze(1)));
      }
      continue;
    }
    // NF4: whole blocks of 64 per call; element 2j in byte j's low nibble.
    const int64_t blocks = int64_t(t.scales), per = kDequantChunkElems / int64_t(kNf4BlockElems);
    at::Tensor codes = at::from_blob(base + t.codes_at, {blocks, int64_t(kNf4BlockElems) / 2}, on(at::kByte));
    for (int64_t k = 0; k < blocks; k += per) {
      const int64_t e = std::min(blocks, k + per);
      at::Tensor c = codes.slice(0, k, e);
      at::Tensor idx = at::stack({at::bitwise_and(c, 15), at::bitwise_right_shift(c, 4)}, 2).to(at::kLong);
      at::Tensor v = levels.index_select(0, idx.view({-1})).view({e - k, int64_t(kNf4BlockElems)});
      v.mul_(scales.slice(0, k, e).unsqueeze(1));
      const int64_t lo = k * int64_t(kNf4BlockElems), hi = std::min(int64_t(t.numel), e * int64_t(kNf4BlockElems));
      dst.slice(0, lo, hi).copy_(v.view({-1}).slice(0, 0, hi - lo));
    }
  }
  if (int64_t(gap) < int64_t(l.elems)) out.slice(0, int64_t(gap), int64_t(l.elems)).zero_();
}

}  // namespace strider
