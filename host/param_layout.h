// ParamLayout: the flat layout of one block's named tensors. Every kind of the
// block's state (fp32 master, Adam m and v, bf16 compute copy, gradients) uses
// the same element offsets, so one block moves as one copy and the optimizer
// walks one flat array. Offsets are multiples of 128 elements: 256-byte aligned
// for 2-byte and 4-byte kinds alike.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strider {

// One tensor inside a block's flat buffers.
struct TensorSlot {
  std::string name;            // the checkpoint's name, e.g. "model.layers.3.mlp.up_proj.weight"
  std::vector<int64_t> shape;
  size_t offset_elems = 0;     // from the start of the block's flat buffer
  size_t numel = 0;
  // AdamW's weight decay applies to it (the model's rule says which: norms and
  // biases are exempt in transformers' Trainer; engine/model/model_spec.h).
  bool decay = true;
  // The optimizer trains it. A frozen tensor (a base weight under LoRA
  // adapters, engine/model/model_spec.h) has no gradient, no master and no Adam
  // state: its compute copy is all the engine keeps of it.
  bool trainable = true;
};

// Elements [begin, end) of a block's flat layout that are updated alike.
struct DecayRun {
  size_t begin = 0, end = 0;
  bool decay = true;
};

class ParamLayout {
 public:
  static constexpr size_t kAlignElems = 128;  // 256 B for bf16, 512 B for fp32

  ParamLayout() = default;
  explicit ParamLayout(std::string block_name) : block_name_(std::move(block_name)) {}

  // Appends a tensor at the next aligned offset. Throws on a duplicate name,
  // a negative dimension or an empty name. Returns its slot.
  const TensorSlot& add(std::string name, std::vector<int64_t> shape, bool decay = true, bool trainable = true);

  // The slot called `name`; throws naming the block and the tensor when absent.
  const TensorSlot& at(std::string_view name) const;
  // nullptr when absent.
  const TensorSlot* find(std::string_view name) const;

  const std::vector<TensorSlot>& slots() const { return slots_; }
  const std::string& block_name() const { return block_name_; }
  // Elements of the flat buffer, including alignment padding (padding is zero
  // in every kind and stays zero through updates).
  size_t total_elems() const { return total_elems_; }
  // Elements that belong to tensors (no padding).
  size_t param_elems() const { return param_elems_; }
  // [begin, end) cut where the decay changes, in order, neighbours of the same
  // kind merged (a tensor's padding goes with it). Cuts fall on tensor offsets,
  // so on multiples of kAlignElems.
  std::vector<DecayRun> decay_runs(size_t begin, size_t end) const;
  // [begin, end) from the first trainable tensor's offset to the end of the
  // last one's padding; {0, 0} when every tensor is frozen. The optimizer
  // state of the block covers this span (host/param_store.h, state_begin).
  std::pair<size_t, size_t> trainable_span() const;
  // Some tensor is frozen.
  bool any_frozen() const;

 private:
  std::string block_name_;
  std::vector<TensorSlot> slots_;
  size_t total_elems_ = 0;
  size_t param_elems_ = 0;
};

}  // namespace strider
