#include "engine/config/compute_options.h"

#include <fmt/format.h>

#include "host/error.h"

namespace strider {

std::string_view compute_dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return "bf16";
    case at::kHalf: return "fp16";
    case at::kFloat: return "fp32";
    default: throw Error(fmt::format("compute dtype {} is not bf16, fp16 or fp32", c10::toString(dtype)));
  }
}

at::ScalarType parse_compute_dtype(std::string_view text, std::string_view where) {
  for (at::ScalarType t : {at::kBFloat16, at::kHalf, at::kFloat})
    if (text == compute_dtype_name(t)) return t;
  throw Error(fmt::format("{} = '{}' is not bf16, fp16 or fp32", where, text));
}

DType host_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat ? DType::kF32 : dtype == at::kHalf ? DType::kF16 : DType::kBF16;
}

}  // namespace strider
