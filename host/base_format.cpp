#include "host/base_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "host/bf16.h"
#include "host/error.h"

namespace strider {
namespace {

constexpr size_t kAlignBytes = 256;
size_t aligned(size_t x) { return (x + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

// Ascending levels: the index of the nearest, the lower one on a tie (the
// midpoints decide, as bitsandbytes' tree of comparisons does).
uint8_t nearest_level(float x) {
  uint8_t i = 0;
  while (i < 15 && x > 0.5f * (kNf4Levels[i] + kNf4Levels[i + 1])) ++i;
  return i;
}

}  // namespace

const float kNf4Levels[16] = {-1.0f,
                              -0.6961928009986877f,
                              -0.5250730514526367f,
                              -0.39491748809814453f,
                              -0.28444138169288635f,
                              -0.18477343022823334f,
                              -0.09105003625154495f,
                              0.0f,
                              0.07958029955625534f,
                              0.16093020141124725f,
                              0.24611230194568634f,
                              0.33791524171829224f,
                              0.44070982933044434f,
                              0.5626170039176941f,
                              0.7229568362236023f,
                              1.0f};

std::string_view base_format_name(BaseFormat f) {
  switch (f) {
    case BaseFormat::kCompute: return "compute";
    case BaseFormat::kInt8: return "int8";
    case BaseFormat::kNf4: return "nf4";
  }
  return "?";
}

BaseFormat parse_base_format(std::string_view name, std::string_view source) {
  for (BaseFormat f : {BaseFormat::kCompute, BaseFormat::kInt8, BaseFormat::kNf4})
    if (name == base_format_name(f)) return f;
  throw Error(fmt::format("{}: base format '{}' is not one of {}", source, name, base_format_choices()));
}

std::string base_format_choices() { return "compute, int8, nf4"; }

BaseLayout base_layout(const ParamLayout& layout, size_t end, BaseFormat format, DType compute_dtype) {
  BaseLayout out;
  out.format = format;
  out.raw_dtype = compute_dtype;
  if (format == BaseFormat::kCompute || end == 0) return out;
  out.elems = end;
  const size_t raw = dtype_size(compute_dtype);
  for (const TensorSlot& t : layout.slots()) {
    if (t.offset_elems >= end) break;
    STRIDER_CHECK(!t.trainable && t.offset_elems + t.numel <= end,
                  "base format {}: '{}' of block '{}' trains; only a frozen base is quantized",
                  base_format_name(format), t.name, layout.block_name());
    BaseTensor b{.elem_at = t.offset_elems, .numel = t.numel};
    b.quantized = t.shape.size() == 2 && t.numel > 0;
    b.codes_at = out.bytes;
    if (!b.quantized) {
      b.codes_bytes = t.numel * raw;
    } else {
      b.rows = t.shape[0];
      b.cols = t.shape[1];
      if (format == BaseFormat::kInt8) {
        b.codes_bytes = t.numel;
        b.scales = size_t(b.rows);
      } else {
        b.scales = (t.numel + kNf4BlockElems - 1) / kNf4BlockElems;
        b.codes_bytes = b.scales * kNf4BlockElems / 2;
      }
    }
    out.bytes += aligned(b.codes_bytes);
    b.scales_at = out.bytes;
    out.bytes += aligned(b.scales * sizeof(float));
    out.tensors.push_back(b);
  }
  return out;
}

namespace {

// One tensor's record: its codes (and scales) from its values.
void quantize_tensor(const BaseLayout& l, const BaseTensor& t, const float* x, std::span<std::byte> out) {
  std::byte* codes = out.data() + t.codes_at;
  auto* scales = reinterpret_cast<float*>(out.data() + t.scales_at);
  std::memset(codes, 0, t.codes_bytes);
  if (!t.quantized) {
    if (l.raw_dtype == DType::kF32) std::memcpy(codes, x, t.numel * sizeof(float));
    else float_to_bf16({x, t.numel}, {reinterpret_cast<uint16_t*>(codes), t.numel});
    return;
  }
  if (l.format == BaseFormat::kInt8) {
    auto* q = reinterpret_cast<int8_t*>(codes);
    const size_t cols = size_t(t.cols);
    for (size_t r = 0; r < size_t(t.rows); ++r) {
      float amax = 0;
      for (size_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(x[r * cols + c]));
      const float scale = amax / 127.0f;
      scales[r] = scale;
      for (size_t c = 0; c < cols; ++c)
        q[r * cols + c] = scale > 0 ? int8_t(std::clamp(std::nearbyint(x[r * cols + c] / scale), -127.0f, 127.0f))
                                    : int8_t{0};
    }
    return;
  }
  auto* q = reinterpret_cast<uint8_t*>(codes);
  for (size_t blk = 0; blk < t.scales; ++blk) {
    const size_t lo = blk * kNf4BlockElems, hi = std::min(t.numel, lo + kNf4BlockElems);
    float amax = 0;
    for (size_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(x[i]));
    scales[blk] = amax;
    for (size_t i = lo; i < lo + kNf4BlockElems; ++i) {
      // Past the tensor's end (its last block): the zero level.
      const uint8_t c = i < hi && amax > 0 ? nearest_level(x[i] / amax) : uint8_t{7};
      q[i / 2] |= uint8_t(i % 2 == 0 ? c : c << 4);  // element 2j in the low nibble
    }
  }
}

void check_sizes(const char* what, const BaseLayout& l, size_t values, size_t bytes) {
  STRIDER_CHECK(values >= l.elems && bytes == l.bytes, "{}: {} values and {} bytes for a base of {} elements in {} bytes",
                what, values, bytes, l.elems, l.bytes);
}

}  // namespace

void quantize_base(const BaseLayout& l, std::span<const float> values, std::span<std::byte> out) {
  check_sizes("quantize_base", l, values.size(), out.size());
  std::memset(out.data(), 0, out.size());
  for (const BaseTensor& t : l.tensors) quantize_tensor(l, t, values.data() + t.elem_at, out);
}

void requantize_changed(const BaseLayout& l, std::span<const float> values, std::span<std::byte> bytes) {
  check_sizes("requantize_changed", l, values.size(), bytes.size());
  std::vector<float> now(l.elems);
  dequantize_base(l, bytes, now);
  for (const BaseTensor& t : l.tensors)
    if (std::memcmp(now.data() + t.elem_at, values.data() + t.elem_at, t.numel * sizeof(float)) != 0)
      quantize_tensor(l, t, values.data() + t.elem_at, bytes);
}

void dequantize_base(const BaseLayout& l, std::span<const std::byte> bytes, std::span<float> out,
                     bool round_to_compute) {
  check_sizes("dequantize_base", l, out.size(), bytes.size());
  std::fill(out.begin(), out.begin() + ptrdiff_t(l.elems), 0.0f);
  for (const BaseTensor& t : l.tensors) {
    float* y = out.data() + t.elem_at;
    const std::byte* codes = bytes.data() + t.codes_at;
    const auto* scales = reinterpret_cast<const float*>(bytes.data() + t.scales_at);
    if (!t.quantized) {
      if (l.raw_dtype == DType::kF32) std::memcpy(y, codes, t.numel * sizeof(float));
      else bf16_to_float({reinterpret_cast<const uint16_t*>(codes), t.numel}, {y, t.numel});
      continue;
    }
    if (l.format == BaseFormat::kInt8) {
      const auto* q = reinterpret_cast<const int8_t*>(codes);
      const size_t cols = size_t(t.cols);
      for (size_t i = 0; i < t.numel; ++i) y[i] = float(q[i]) * scales[i / cols];
    } else {
      const auto* q = reinterpret_cast<const uint8_t*>(codes);
      for (size_t i = 0; i < t.numel; ++i)
        y[i] = kNf4Levels[i % 2 == 0 ? q[i / 2] & 15 : q[i / 2] >> 4] * scales[i / kNf4BlockElems];
    }
    if (round_to_compute && l.raw_dtype == DType::kBF16)
      for (size_t i = 0; i < t.numel; ++i) y[i] = bf16_to_float(float_to_bf16(y[i]));
  }
}

}  // namespace strider
