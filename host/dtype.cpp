#include "host/dtype.h"

#include <array>
#include <utility>

namespace strider {
namespace {

struct Info { DType t; std::string_view name; size_t size; };
constexpr std::array kInfo = {
    Info{DType::kF64, "F64", 8},  Info{DType::kF32, "F32", 4},
    Info{DType::kF16, "F16", 2},  Info{DType::kBF16, "BF16", 2},
    Info{DType::kF8E4M3, "F8_E4M3", 1}, Info{DType::kF8E5M2, "F8_E5M2", 1},
    Info{DType::kI64, "I64", 8},  Info{DType::kI32, "I32", 4},
    Info{DType::kI16, "I16", 2},  Info{DType::kI8, "I8", 1},
    Info{DType::kU64, "U64", 8},  Info{DType::kU32, "U32", 4},
    Info{DType::kU16, "U16", 2},  Info{DType::kU8, "U8", 1},
    Info{DType::kBool, "BOOL", 1},
};

const Info& info(DType t) { return kInfo[static_cast<size_t>(t)]; }

}  // namespace

size_t dtype_size(DType t) { return info(t).size; }
std::string_view dtype_name(DType t) { return info(t).name; }

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& i : kInfo)
    if (i.name == name) return i.t;
  return std::nullopt;
}

}  // namespace strider
