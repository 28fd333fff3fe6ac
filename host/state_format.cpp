#include "host/state_format.h"

#include <fmt/format.h>

#include "host/error.h"

namespace strider {

std::string_view state_format_name(StateFormat f) { return f == StateFormat::kQ8 ? "q8" : "fp32"; }

std::string state_format_choices() { return "fp32, q8"; }

StateFormat parse_state_format(std::string_view name) {
  for (StateFormat f : {StateFormat::kFp32, StateFormat::kQ8})
    if (name == state_format_name(f)) return f;
  throw Error(fmt::format("optimizer state format '{}' is not one of {}", name, state_format_choices()));
}

size_t state_kind_bytes(StateFormat f, StateKind kind, size_t elems) {
  if (f == StateFormat::kFp32) return elems * sizeof(float);
  STRIDER_CHECK(elems % kQ8GroupElems == 0, "q8 state: {} elements are not a whole number of groups of {}", elems,
                kQ8GroupElems);
  if (kind == StateKind::kMaster) return elems;
  return elems + elems / kQ8GroupElems * sizeof(float);
}

double state_bytes_per_elem(StateFormat f) {
  return f == StateFormat::kFp32 ? 12.0 : 3.0 + 2.0 * sizeof(float) / double(kQ8GroupElems);
}

}  // namespace strider
