#include "gpu/blocks/base_dequant.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <string>

namespace strider {
namespace {

// NF4: a byte holds two codes (element 2j in its low nibble); a table of the
// 256 bytes' level pairs gives both at once. Made once per device: copied from
// host memory at every visit, it would make the launching thread wait for the
// stream's work so far.
at::Tensor nf4_pairs(c10::Device device) {
  static std::mutex mu;
  static auto* tables = new std::map<std::string, at::Tensor>();  // never destroyed: CUDA may be gone at exit
  std::lock_guard lk(mu);
  const std::string key = device.str();
  if (const auto it = tables->find(key); it != tables->end()) return it->second;
  at::Tensor pairs = at::empty({256, 2}, at::TensorOptions().dtype(at::kFloat));
  float* p = pairs.data_ptr<float>();
  for (int b = 0; b < 256; ++b) {
    p[2 * b] = kNf4Levels[b & 15];
    p[2 * b + 1] = kNf4Levels[b >> 4];
  }
  return tables->emplace(key, pairs.to(device)).first->second;
}

}  // namespace

void dequantize_base_on_device(const BaseLayout& l, const std::byte* staging, void* params, at::ScalarType dtype,
                               c10::Device device) {
  const auto on = [&](at::ScalarType t) { return at::TensorOptions().dtype(t).device(device); };
  auto* base = const_cast<std::byte*>(staging);  // from_blob takes a mutable pointer; nothing writes it
  at::Tensor out = at::from_blob(params, {int64_t(l.elems)}, on(dtype));
  const at::Tensor pairs = l.format == BaseFormat::kNf4 ? nf4_pairs(device) : at::Tensor();
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
    // NF4: whole blocks of 64 per call.
    const int64_t blocks = int64_t(t.scales), per = kDequantChunkElems / int64_t(kNf4BlockElems);
    at::Tensor codes = at::from_blob(base + t.codes_at, {blocks * int64_t(kNf4BlockElems) / 2}, on(at::kByte));
    for (int64_t k = 0; k < blocks; k += per) {
      const int64_t e = std::min(blocks, k + per), half = int64_t(kNf4BlockElems) / 2;
      at::Tensor idx = codes.slice(0, k * half, e * half).to(at::kInt);
      at::Tensor v = pairs.index_select(0, idx).view({e - k, int64_t(kNf4BlockElems)});
      v.mul_(scales.slice(0, k, e).unsqueeze(1));
      const int64_t lo = k * int64_t(kNf4BlockElems), hi = std::min(int64_t(t.numel), e * int64_t(kNf4BlockElems));
      dst.slice(0, lo, hi).copy_(v.view({-1}).slice(0, 0, hi - lo));
    }
  }
  if (int64_t(gap) < int64_t(l.elems)) out.slice(0, int64_t(gap), int64_t(l.elems)).zero_();
}

}  // namespace strider
