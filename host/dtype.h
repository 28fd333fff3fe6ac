// Element types that cross our folders: parameters, gradients, checkpoints on
// disk (safetensors names), token ids.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace strider {

enum class DType : uint8_t {
  kF64, kF32, kF16, kBF16, kF8E4M3, kF8E5M2,
  kI64, kI32, kI16, kI8, kU64, kU32, kU16, kU8, kBool,
};

// Bytes per element.
size_t dtype_size(DType t);
// The safetensors spelling: "F32", "BF16", "I64", ...
std::string_view dtype_name(DType t);
// Inverse of dtype_name; nullopt for an unknown spelling.
std::optional<DType> dtype_from_name(std::string_view name);

}  // namespace strider
