#include "engine/run/block_runner.h"

#include "gpu/blocks/layer_cut.h"
#include "host/error.h"

namespace strider {
namespace {

// A block's weights without its LoRA adapters ("<proj>.lora_A/B.weight"): the
// linears then compute the frozen base alone, bit for bit.
void drop_adapters(TensorMap& w) {
  for (auto it = w.begin(); it != w.end();) it = it->first.find(".lora_") != std::string::npos ? w.erase(it) : std::next(it);
}

// The checkpoint-name prefix each block's roles are stated without.
std::string prefix_of(const ModelSpec& spec, int64_t b) {
  switch (spec.block(b).kind) {
    case BlockKind::kEmbedding: return "model.embed_tokens.";
    case BlockKind::kHead: return "";
    case BlockKind::kLayer: break;
  }
  return fmt::format("model.layers.{}.", spec.block(b).layer);
}

}  // namespace

TensorMap block_views(const ModelSpec& spec, int64_t block, const ParamLayout& layout,
                      const at::Tensor& flat, bool trainable_only, size_t from) {
  STRIDER_CHECK(flat.dim() == 1 && from <= layout.total_elems() && size_t(flat.numel()) >= layout.total_elems() - from,
                "block '{}': flat buffer of {} elements from element {} is smaller than its layout ({})",
                layout.block_name(), flat.numel(), from, layout.total_elems());
  const std::string prefix = prefix_of(spec, block);
  TensorMap out;
  for (const TensorSlot& s : layout.slots()) {
    if (trainable_only && !s.trainable) continue;
    STRIDER_CHECK(s.offset_elems >= from, "block '{}': tensor {} lies before element {}, where the buffer starts",
                  layout.block_name(), s.name, from);
    std::string role = s.name;
    if (!prefix.empty() && role.rfind(prefix, 0) == 0) role = role.substr(prefix.size());
    else if (role.rfind("model.", 0) == 0) role = role.substr(6);  // head: model.norm.weight
    at::Tensor view = flat.slice(0, int64_t(s.offset_elems - from), int64_t(s.offset_elems - from + s.numel)).view(s.shape);
    // Fused projections (Phi-3): the blocks read and accumulate each
    // projection's rows, a contiguous slice of the fused tensor.
    const BlockDims& d = spec.dims;
    const int64_t q = d.heads * d.head_dim, kv = d.kv_heads * d.head_dim;
    if (role == "self_attn.qkv_proj.weight") {
      out.emplace("self_attn.q_proj.weight", view.slice(0, 0, q));
      out.emplace("self_attn.k_proj.weight", view.slice(0, q, q + kv));
      out.emplace("self_attn.v_proj.weight", view.slice(0, q + kv, q + 2 * kv));
    } else if (role == "mlp.gate_up_proj.weight") {
      out.emplace("mlp.gate_proj.weight", view.slice(0, 0, d.intermediate));
      out.emplace("mlp.up_proj.weight", view.slice(0, d.intermediate, 2 * d.intermediate));
    } else {
      out.emplace(std::move(role), std::move(view));
    }
  }
  return out;
}

TensorMap piece_views(const ModelSpec& spec, const Piece& pc, const ParamLayout& layout, const at::Tensor& flat) {
  STRIDER_CHECK(pc.sub_layer && spec.block(pc.block).kind == BlockKind::kLayer && flat.dim() == 1 &&
                    size_t(flat.numel()) >= pc.elems(),
                "piece_views: {} is not a sub-layer piece of {} elements in a buffer that holds it", layout.block_name(),
                pc.elems());
  const std::string prefix = prefix_of(spec, pc.block);
  const int64_t H = spec.dims.hidden, w = pc.mlp_end - pc.mlp_begin;
  const size_t i0 = size_t(pc.mlp_begin);
  const MoeDims moe = spec.layer_dims(spec.block(pc.block).layer).moe;
  TensorMap out;
  // `shape`'s elements at block element `at` on, which the piece must hold back to back.
  auto view = [&](const TensorSlot& s, std::string role, size_t at, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    const size_t lo = pc.before(at), hi = pc.before(s.offset_elems + s.numel);
    STRIDER_CHECK(hi >= lo + size_t(n), "piece_views: {}[{}] does not hold {} elements of {} from element {}",
                  layout.block_name(), pc.part, n, s.name, at);
    out.emplace(std::move(role), flat.slice(0, int64_t(lo), int64_t(lo) + n).view(shape));
  };
  for (const TensorSlot& s : layout.slots()) {
    const std::string role = s.name.substr(prefix.size());
    if (moe.sparse()) {  // the attention-and-router half, or a group's experts [i0, i0 + w)
      const bool expert = role.rfind("mlp.experts.", 0) == 0;
      if (!pc.mlp_slice() && !expert) view(s, role, s.offset_elems, s.shape);
      if (!pc.mlp_slice() || !expert) continue;
      std::vector<int64_t> shape = s.shape;
      shape[0] = w;
      view(s, role, s.offset_elems + i0 * (s.numel / size_t(moe.experts)), shape);
      continue;
    }
    const bool mlp = role.rfind("mlp.", 0) == 0;
    if (!pc.mlp_slice()) {
      if (!mlp) view(s, role, s.offset_elems, s.shape);
    } else if (role == "mlp.gate_proj.weight" || role == "mlp.up_proj.weight") {
      view(s, role, s.offset_elems + i0 * size_t(H), {w, H});
    } else if (role == "mlp.down_proj.weight") {
      view(s, role, s.offset_elems + i0, {H, w});
    } else if (role == "mlp.gate_proj.bias" || role == "mlp.up_proj.bias") {
      view(s, role, s.offset_elems + i0, {w});
    } else if (role == "mlp.down_proj.bias" && i0 == 0) {
      view(s, role, s.offset_elems, s.shape);
    }
  }
  return out;
}

BlockRunner::BlockRunner(const ModelSpec& spec, ComputeOptions options, int64_t seq, at::Device device)
    : spec_(spec), options_(options) {
  STRIDER_CHECK(options.dtype == at::kBFloat16 || options.dtype == at::kHalf || options.dtype == at::kFloat,
                "compute dtype {} is not supported (bf16, fp16 or fp32)", c10::toString(options.dtype));
  STRIDER_CHECK(options.token_tile >= 0, "token tile {} must be >= 0 (0: untiled)", options.token_tile);
  for (int64_t b = 0; b < spec.num_blocks(); ++b) layouts_.push_back(spec.layout(b));
  rope_ = rope_tables(spec.dims.rope, spec.dims.head_dim, seq, options.dtype, device);
  if (!spec.sliding_layers.empty())
    local_rope_ = rope_tables(spec.local_rope, spec.dims.head_dim, seq, options.dtype, device);
  const RopeDims& r = spec.dims.rope;
  if (r.type == RopeType::kLongrope && seq > r.original_max_position)
    short_rope_ = rope_tables(r, spec.dims.head_dim, seq, options.dtype, device, r.original_max_position);
}

int64_t packed_longest(std::span<const int64_t> positions, int64_t seq, size_t first) {
  int64_t longest = 0;
  bool plain = true;
  for (size_t i = 0; i < positions.size(); ++i) {
    const int64_t p = positions[i];
    STRIDER_CHECK(p >= 0 && p < seq, "position {} at token {} of the batch is outside [0, seq = {})", p, first + i,
                  seq);
    plain = plain && p == int64_t(i % size_t(seq));
    longest = std::max(longest, p + 1);
  }
  return plain ? 0 : longest;
}

TokenLayout BlockRunner::layout_of(int64_t layer, const BatchPositions* positions) const {
  const bool local = spec_.slides(layer);
  if (!positions || !positions->ids.defined()) return local ? local_rope_ : rope_;
  const bool short_factors = !local && short_rope_.cos.defined() &&
                             positions->longest <= spec_.dims.rope.original_max_position;
  return token_layout(local ? local_rope_ : short_factors ? short_rope_ : rope_, positions->ids);
}

at::Tensor BlockRunner::forward(int64_t b, const at::Tensor& params, const at::Tensor& input,
                                const at::Tensor& save, const BatchPositions* positions,
                                const MoeStep* moe, bool adapters) const {
  TensorMap w = block_views(spec_, b, layouts_[b], params);
  if (!adapters) drop_adapters(w);
  switch (spec_.block(b).kind) {
    case BlockKind::kEmbedding: return embedding_forward(w.at("weight"), input, embedding_scale(spec_.dims, params.scalar_type()));
    case BlockKind::kLayer: {
      const int64_t l = spec_.block(b).layer;
      const BlockDims d = spec_.layer_dims(l);
      const TokenLayout layout = layout_of(l, positions);
      if (!save.defined()) return layer_forward(d, w, layout, input, options_.token_tile, nullptr, moe);
      const LayerSaved s = layer_saved_views(d, input.size(0) * input.size(1), save);
      return layer_forward(d, w, layout, input, options_.token_tile, &s, moe);
    }
    case BlockKind::kHead: break;
  }
  throw Error("BlockRunner::forward: the head has no plain forward; use head_eval or head_backward");
}

at::Tensor BlockRunner::backward(int64_t b, const at::Tensor& params, const at::Tensor& input,
                                 const at::Tensor& grad_out, const at::Tensor& grads, const at::Tensor& saved,
                                 size_t grads_from, const BatchPositions* positions, const MoeStep* moe) const {
  TensorMap w = block_views(spec_, b, layouts_[b], params);
  TensorMap g = block_views(spec_, b, layouts_[b], grads, /*trainable_only=*/true, grads_from);
  switch (spec_.block(b).kind) {
    case BlockKind::kEmbedding:
      if (auto it = g.find("weight"); it != g.end())
        embedding_backward(input, grad_out, it->second, embedding_scale(spec_.dims, params.scalar_type()),
                           spec_.dims.pad_token);
      return {};
    case BlockKind::kLayer: {
      const int64_t l = spec_.block(b).layer;
      const BlockDims d = spec_.layer_dims(l);
      const TokenLayout layout = layout_of(l, positions);
      if (!saved.defined()) return layer_backward(d, w, layout, input, grad_out, g, options_.token_tile, nullptr, moe);
      const LayerSaved s = layer_saved_views(d, input.size(0) * input.size(1), saved);
      return layer_backward(d, w, layout, input, grad_out, g, options_.token_tile, &s, moe);
    }
    case BlockKind::kHead: break;
  }
  throw Error("BlockRunner::backward: use head_backward for the head");
}

namespace {

// In the fp32 sum buffer, x1's shape: a dense layer's fp32 sum (its first
// elements); a layer with experts' sum in the compute dtype (slot 0) and a
// shared expert's output after it (slot 1).
at::Tensor dense_sum(const CutBuffers& cut) {
  return cut.sum.view({-1}).slice(0, 0, cut.x1.numel()).view(cut.x1.sizes());
}
at::Tensor compute_slot(const CutBuffers& cut, int64_t slot) {
  const at::ScalarType dtype = cut.x1.scalar_type();
  const int64_t n = cut.x1.numel();
  at::Tensor flat = cut.sum.view({-1});
  if (dtype != at::kFloat) flat = flat.view(dtype);
  STRIDER_CHECK(flat.numel() >= (slot + 1) * n, "internal: the cut's sum buffer holds {} elements of {}, not {}",
                flat.numel(), c10::toString(dtype), (slot + 1) * n);
  return flat.slice(0, slot * n, (slot + 1) * n).view(cut.x1.sizes());
}

MoeCut moe_cut(const BlockDims& d, const CutBuffers& cut, const MoeStep* moe) {
  return {cut.top, cut.scores, cut.dscores, d.moe.shared_intermediate > 0 ? compute_slot(cut, 1) : at::Tensor(), moe};
}

}  // namespace

void BlockRunner::forward_piece(const Piece& pc, const at::Tensor& params, const at::Tensor& input,
                                const at::Tensor& out, const CutBuffers& cut, const BatchPositions* positions,
                                const MoeStep* moe) const {
  const int64_t l = spec_.block(pc.block).layer;
  const BlockDims d = spec_.layer_dims(l);
  const TensorMap w = piece_views(spec_, pc, layouts_[size_t(pc.block)], params);
  const int64_t tile = options_.token_tile;
  const bool sparse = d.moe.sparse();
  if (!pc.mlp_slice()) {
    const AttentionHalf half = attention_half_forward(d, w, layout_of(l, positions), input, tile);
    cut.x1.copy_(half.x1);
    cut.h2.copy_(half.h2);
    if (!sparse) {
      dense_sum(cut).zero_();
      return;
    }
    compute_slot(cut, 0).zero_();
    const MoeCut mc = moe_cut(d, cut, moe);
    moe_cut_route(d, w, cut.h2, mc, tile);
    moe_cut_shared(d, w, cut.h2, mc, tile);
    return;
  }
  if (sparse) {
    const at::Tensor sum = compute_slot(cut, 0);
    const MoeCut mc = moe_cut(d, cut, nullptr);
    moe_group_forward(d, w, pc.mlp_begin, pc.mlp_end, cut.h2, mc, sum, tile);
    if (pc.mlp_end == d.moe.experts) out.copy_(moe_groups_output(d, cut.x1, sum, mc.shared));
    return;
  }
  const at::Tensor sum = dense_sum(cut);
  mlp_slice_forward(d, w, cut.h2, sum, tile);
  if (pc.mlp_end == d.intermediate) out.copy_(mlp_slices_output(d, cut.x1, sum));
}

void BlockRunner::recompute_mlp_input(const Piece& pc, const at::Tensor& params, const at::Tensor& input,
                                      const CutBuffers& cut, const BatchPositions* positions) const {
  STRIDER_CHECK(!pc.mlp_slice(), "recompute_mlp_input: {} is an MLP slice, not an attention half", pc.part);
  const int64_t l = spec_.block(pc.block).layer;
  const BlockDims d = spec_.layer_dims(l);
  const TensorMap w = piece_views(spec_, pc, layouts_[size_t(pc.block)], params);
  cut.h2.copy_(attention_half_forward(d, w, layout_of(l, positions), input, options_.token_tile).h2);
  // The routing again, for the groups' backward (its statistics were added in forward).
  if (d.moe.sparse()) moe_cut_route(d, w, cut.h2, moe_cut(d, cut, nullptr), options_.token_tile);
}

void BlockRunner::backward_piece(const Piece& pc, const at::Tensor& params, const at::Tensor& input,
                                 const at::Tensor& grad_out, const at::Tensor& grads, const CutBuffers& cut,
                                 const BatchPositions* positions, const MoeStep* moe) const {
  const int64_t l = spec_.block(pc.block).layer;
  const BlockDims d = spec_.layer_dims(l);
  const ParamLayout& layout = layouts_[size_t(pc.block)];
  const TensorMap w = piece_views(spec_, pc, layout, params);
  TensorMap g = piece_views(spec_, pc, layout, grads);
  const int64_t tile = options_.token_tile;
  if (d.moe.sparse()) {
    const at::Tensor sum = compute_slot(cut, 0);
    if (!pc.mlp_slice()) {
      grad_out.copy_(
          moe_half_backward(d, w, g, layout_of(l, positions), input, grad_out, sum, moe_cut(d, cut, moe), tile));
      return;
    }
    if (pc.mlp_end == d.moe.experts) {  // the first group backward
      sum.zero_();
      cut.dscores.zero_();
    }
    moe_group_backward(d, w, g, pc.mlp_begin, pc.mlp_end, cut.h2, grad_out, moe_cut(d, cut, nullptr), sum, tile);
    return;
  }
  const at::Tensor sum = dense_sum(cut);
  if (pc.mlp_slice()) {
    if (pc.mlp_end == d.intermediate) sum.zero_();  // the first slice backward
    mlp_slice_backward(d, w, g, cut.h2, grad_out, sum, tile);
    return;
  }
  grad_out.copy_(attention_half_backward(d, w, g, layout_of(l, positions), input, grad_out, sum, tile));
}

HeadWeights BlockRunner::head_weights(const at::Tensor& params, const at::Tensor& tied_params) const {
  const int64_t h = spec_.num_blocks() - 1;
  TensorMap w = block_views(spec_, h, layouts_[h], params);
  if (spec_.tie_embeddings) {
    STRIDER_CHECK(tied_params.defined(), "tied embeddings: the head needs the embedding's parameters");
    return {w.at("norm.weight"), block_views(spec_, 0, layouts_[0], tied_params).at("weight")};
  }
  return {w.at("norm.weight"), w.at("lm_head.weight")};
}

HeadResult BlockRunner::head_backward(const at::Tensor& params, const at::Tensor& grads,
                                      const at::Tensor& tied_params, const at::Tensor& tied_grads,
                                      const at::Tensor& input, const at::Tensor& labels,
                                      double loss_scale, Scalars scalars) const {
  const int64_t h = spec_.num_blocks() - 1;
  HeadWeights w = head_weights(params, tied_params);
  // A frozen tensor gets no accumulator (undefined: its gradient is not computed).
  auto trained = [](const TensorMap& m, const char* role) {
    auto it = m.find(role);
    return it == m.end() ? at::Tensor() : it->second;
  };
  TensorMap g = block_views(spec_, h, layouts_[h], grads, true);
  HeadGrads hg{trained(g, "norm.weight"),
               spec_.tie_embeddings ? trained(block_views(spec_, 0, layouts_[0], tied_grads, true), "weight")
                                    : trained(g, "lm_head.weight")};
  return head_loss_backward(spec_.dims, w, input, labels, options_.vocab_chunk, loss_scale, hg, scalars,
                            options_.token_tile);
}

HeadResult BlockRunner::head_eval(const at::Tensor& params, const at::Tensor& tied_params,
                                  const at::Tensor& input, const at::Tensor& labels, Scalars scalars) const {
  return head_loss(spec_.dims, head_weights(params, tied_params), input, labels, options_.vocab_chunk, scalars,
                   options_.token_tile);
}

}  // namespace strider
