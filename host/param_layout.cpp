#include "host/param_layout.h"

#include <limits>

#include "host/error.h"

namespace strider {

const TensorSlot& ParamLayout::add(std::string name, std::vector<int64_t> shape) {
  STRIDER_CHECK(!name.empty(), "block '{}': a tensor needs a name", block_name_);
  STRIDER_CHECK(find(name) == nullptr, "block '{}': tensor '{}' added twice", block_name_, name);
  size_t numel = 1;
  for (int64_t d : shape) {
    STRIDER_CHECK(d >= 0, "block '{}': tensor '{}' has negative dimension {}", block_name_, name, d);
    STRIDER_CHECK(d == 0 || numel <= std::numeric_limits<size_t>::max() / static_cast<size_t>(d),
                  "block '{}': tensor '{}' has too many elements", block_name_, name);
    numel *= static_cast<size_t>(d);
  }
  TensorSlot slot{std::move(name), std::move(shape), total_elems_, numel};
  total_elems_ += (numel + kAlignElems - 1) / kAlignElems * kAlignElems;
  param_elems_ += numel;
  slots_.push_back(std::move(slot));
  return slots_.back();
}

const TensorSlot* ParamLayout::find(std::string_view name) const {
  for (const auto& s : slots_)
    if (s.name == name) return &s;
  return nullptr;
}

const TensorSlot& ParamLayout::at(std::string_view name) const {
  const TensorSlot* s = find(name);
  STRIDER_CHECK(s != nullptr, "block '{}' has no tensor '{}'", block_name_, name);
  return *s;
}

}  // namespace strider
