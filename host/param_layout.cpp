#include "host/param_layout.h"

#include <algorithm>
#include <limits>

#include "host/error.h"

namespace strider {

const TensorSlot& ParamLayout::add(std::string name, std::vector<int64_t> shape, bool decay, bool trainable) {
  STRIDER_CHECK(!name.empty(), "block '{}': a tensor needs a name", block_name_);
  STRIDER_CHECK(find(name) == nullptr, "block '{}': tensor '{}' added twice", block_name_, name);
  size_t numel = 1;
  for (int64_t d : shape) {
    STRIDER_CHECK(d >= 0, "block '{}': tensor '{}' has negative dimension {}", block_name_, name, d);
    STRIDER_CHECK(d == 0 || numel <= std::numeric_limits<size_t>::max() / static_cast<size_t>(d),
                  "block '{}': tensor '{}' has too many elements", block_name_, name);
    numel *= static_cast<size_t>(d);
  }
  TensorSlot slot{std::move(name), std::move(shape), total_elems_, numel, decay, trainable};
  total_elems_ += (numel + kAlignElems - 1) / kAlignElems * kAlignElems;
  param_elems_ += numel;
  slots_.push_back(std::move(slot));
  return slots_.back();
}

std::vector<DecayRun> ParamLayout::decay_runs(size_t begin, size_t end) const {
  STRIDER_CHECK(begin <= end && end <= total_elems_, "block '{}' has {} elements, not [{}, {})", block_name_,
                total_elems_, begin, end);
  std::vector<DecayRun> runs;
  // From the slot that holds `begin` (slots ascend; a sub-layer piece asks
  // for one run per row of down_proj, so a scan from the first is too slow).
  auto first = std::upper_bound(slots_.begin(), slots_.end(), begin,
                                [](size_t x, const TensorSlot& t) { return x < t.offset_elems; });
  for (size_t i = size_t(std::max<ptrdiff_t>(0, first - slots_.begin() - 1)); i < slots_.size(); ++i) {
    if (slots_[i].offset_elems >= end) break;
    // The slot and its padding: up to the next slot (or the block's end).
    const size_t lo = std::max(begin, slots_[i].offset_elems);
    const size_t hi = std::min(end, i + 1 < slots_.size() ? slots_[i + 1].offset_elems : total_elems_);
    if (lo >= hi) continue;
    if (!runs.empty() && runs.back().decay == slots_[i].decay) runs.back().end = hi;
    else runs.push_back({lo, hi, slots_[i].decay});
  }
  if (runs.empty() && begin < end) runs.push_back({begin, end, true});  // no tensors: padding only
  return runs;
}

std::pair<size_t, size_t> ParamLayout::trainable_span() const {
  size_t begin = 0, end = 0;
  bool any = false;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!slots_[i].trainable) continue;
    if (!any) begin = slots_[i].offset_elems;
    any = true;
    end = i + 1 < slots_.size() ? slots_[i + 1].offset_elems : total_elems_;
  }
  return {begin, end};
}

bool ParamLayout::any_frozen() const {
  for (const TensorSlot& s : slots_)
    if (!s.trainable) return true;
  return false;
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
