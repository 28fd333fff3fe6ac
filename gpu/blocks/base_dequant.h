// A quantized LoRA base (host/base_format.h) turned back into the compute
// dtype on the device, with ATen ops, so the CPU device runs the same code a
// GPU does: at each visit of a layer whose base is int8 or NF4, its base
// bytes (landed in the cache unit's staging) become the parameters the
// layer computes with.
#pragma once

#include <cstddef>
#include <cstdint>

#include <ATen/ATen.h>

#include "host/base_format.h"

namespace strider {

// Elements dequantized per ATen call: the temporaries (NF4's code bytes
// widened to int32 indices, the looked-up fp32 values; int8's codes as fp32)
// are at most 6 bytes per element, so 6 MiB of working memory whatever the
// layer's size. Unfused, the ops move about 23 bytes per element.
inline constexpr int64_t kDequantChunkElems = int64_t{1} << 20;
// The most working memory dequantize_base_on_device takes (ModelSpec::cost counts it).
inline constexpr int64_t kDequantWorkBytes = 8 * kDequantChunkElems;

// Writes block elements [0, layout.elems) into `params` (compute dtype
// `dtype`, on `device`) from the base bytes at `staging` (layout.bytes, on
// the same device): each value one fp32 product of a level or code and its
// scale, rounded once to `dtype`, as host/base_format.h's dequantize_base
// gives it; the alignment gaps between tensors zero.
void dequantize_base_on_device(const BaseLayout& layout, const std::byte* staging, void* params,
                               at::ScalarType dtype, c10::Device device);

}  // namespace strider
