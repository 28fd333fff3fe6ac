// BaseFormat: how a frozen LoRA base (engine/model/lora.h) is held on the host and
// sent to the device. The base never changes, so it need not be in the
// compute dtype: a decoder layer's frozen weight matrices may be quantized
// once, at load, and dequantized on the device at each visit
// (gpu/blocks/base_dequant.h), which cuts the host RAM and the H2D bytes the base
// takes.
//
//   compute  the compute copy (bf16, or fp32 for exactness runs): 2 or 4
//            bytes per parameter, no rounding. The default.
//   int8     per row (a weight's output feature) absmax: scale = absmax /
//            127, code = round(x / scale) in [-127, 127], value = code *
//            scale. 1 byte per parameter plus 4 per row.
//   nf4      QLoRA's 4-bit NormalFloat (arXiv 2305.14314): blocks of 64
//            consecutive elements, absmax per block, each element the nearest
//            of the 16 NF4 levels times its block's absmax. Half a byte per
//            parameter plus 4 per 64 (0.5625 in all; QLoRA's double
//            quantization of the absmax, which saves 0.06 more, is not built).
//
// What is quantized: a layer block's frozen 2-D tensors (its linear
// modules' weights) below its trained stretch. Its other frozen tensors
// (norms, biases) ride along in the compute dtype, bit-exact. Dequantization
// multiplies one fp32 code value by one fp32 scale and rounds once to the
// compute dtype, so every device (and the host reference below) gives the
// same bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "host/dtype.h"
#include "host/param_layout.h"

namespace strider {

enum class BaseFormat : uint8_t { kCompute, kInt8, kNf4 };

// "compute" / "int8" / "nf4".
std::string_view base_format_name(BaseFormat f);
// Throws naming `source`, the value and the choices.
BaseFormat parse_base_format(std::string_view name, std::string_view source);
// "compute, int8, nf4", for help texts.
std::string base_format_choices();

inline constexpr size_t kNf4BlockElems = 64;
// The 16 NF4 levels, ascending (QLoRA's table: the quantiles of N(0, 1)
// scaled to [-1, 1], with an exact zero).
extern const float kNf4Levels[16];

// One tensor of a block's base bytes.
struct BaseTensor {
  size_t elem_at = 0, numel = 0;  // where it lies in the block's flat layout
  int64_t rows = 0, cols = 0;     // a quantized one's shape (int8 scales per row)
  bool quantized = false;         // else: raw, in the compute dtype
  size_t codes_at = 0, codes_bytes = 0;  // bytes into the block's base bytes
  size_t scales_at = 0, scales = 0;      // fp32 scales (int8: per row; nf4: per block of 64)
};

// A block's frozen base [0, elems) as its base bytes hold it.
struct BaseLayout {
  BaseFormat format = BaseFormat::kCompute;
  DType raw_dtype = DType::kBF16;  // the compute dtype: raw tensors' bytes
  size_t elems = 0;                // the block elements it covers (0: none)
  size_t bytes = 0;                // the base bytes (records 256-byte aligned)
  std::vector<BaseTensor> tensors; // in block order
  bool empty() const { return elems == 0; }
};

// The layout of block `layout`'s elements [0, end) in `format` (end: its
// first trained element, ParamLayout::trainable_span). Every tensor there
// must be frozen; 2-D ones are quantized. kCompute gives an empty layout.
BaseLayout base_layout(const ParamLayout& layout, size_t end, BaseFormat format, DType compute_dtype);

// Quantizes the block's values [0, layout.elems) into `out` (layout.bytes;
// alignment gaps zero). Deterministic: round to nearest, ties to even in
// int8; NF4 picks the nearest level, the lower on a tie.
void quantize_base(const BaseLayout& layout, std::span<const float> values, std::span<std::byte> out);
// Quantizes again only the tensors whose values differ (bit for bit) from
// what `bytes` dequantize to: writing back what dequantize_base gave (a
// block written whole to set one of its tensors, a checkpoint's trained
// stretch laid over it) leaves the bytes as they are, where quantizing the
// dequantized values again could move a scale by a rounding.
void requantize_changed(const BaseLayout& layout, std::span<const float> values, std::span<std::byte> bytes);
// What the device computes from them, as fp32 before the compute dtype's
// rounding (fill `out`, layout.elems floats; gaps zero). With
// `round_to_compute` each value is rounded to the compute dtype as the
// device rounds it (bf16: to nearest even), so `out` is what the layer
// computes with.
void dequantize_base(const BaseLayout& layout, std::span<const std::byte> bytes, std::span<float> out,
                     bool round_to_compute = true);

}  // namespace strider
