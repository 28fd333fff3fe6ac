// BlockRunner: runs one block of a ModelSpec on flat parameter memory. It is
// the glue between engine/ (names, layouts, micro-batches) and gpu/'s ATen
// blocks (roles, tensors): it views a block's flat buffers as named tensors and
// calls the block's forward, backward or loss.
#pragma once

#include <ATen/ATen.h>

#include <span>

#include "engine/config/compute_options.h"
#include "engine/model/model_spec.h"
#include "engine/placement/pieces.h"
#include "gpu/blocks/blocks.h"
#include "gpu/blocks/chunked_loss.h"
#include "gpu/blocks/moe.h"
#include "host/dtype.h"

namespace strider {

// Named views of a block's flat 1-D buffer (`flat` holds layout.total_elems()
// elements of any dtype); names lose the block prefix (see gpu/blocks/blocks.h).
// `trainable_only`: the trainable tensors' only (gradient accumulators: the
// blocks compute no gradient of a tensor that has none), with `flat`
// starting at block element `from` (a unit's gradient area starts at its
// first trained element, Sharding::grad_base). A fused projection (Phi-3's
// self_attn.qkv_proj, mlp.gate_up_proj) appears as its projections' row
// slices under their own names (q/k/v_proj, gate/up_proj), so the blocks
// compute and accumulate into it as into separate tensors.
TensorMap block_views(const ModelSpec& spec, int64_t block, const ParamLayout& layout,
                      const at::Tensor& flat, bool trainable_only = false, size_t from = 0);

// Named views of a sub-layer piece's parameters or gradients (Piece::
// sub_layer), `flat` holding its elements back to back (the piece's
// coordinates): the attention half's tensors whole; an MLP slice's rows of
// gate_proj and up_proj [width, hidden], its columns of down_proj [hidden,
// width] (its rows' ranges lie back to back), their biases' elements, and
// down_proj's bias in the first slice (gpu/blocks/layer_cut.h). Throws where the
// piece does not hold what its kind says.
TensorMap piece_views(const ModelSpec& spec, const Piece& pc, const ParamLayout& layout, const at::Tensor& flat);

// What a layer cut into sub-layer pieces keeps between its pieces' visits,
// one micro-batch's, on the layer's device: the residual stream after
// attention (from the attention half's forward to the last slice's), the
// MLP's input (to the first slice's backward: the slices' checkpoint), both
// [micro_batch, seq, hidden] in the compute dtype, and an fp32 sum of that
// shape: the slices' partial outputs in forward, their input gradients in
// backward. A layer with experts (cut into groups of experts) sums in the
// compute dtype, in the fp32 buffer's first bytes, and keeps its routing
// (top, scores) and d(loss)/d(score) (dscores) as gpu/blocks/layer_cut.h's MoeCut.
struct CutBuffers {
  at::Tensor x1, h2, sum;
  at::Tensor top, scores, dscores;
};

// A micro-batch's token positions where its rows pack documents (engine:
// EngineConfig::packed_documents): [mb, seq] int64 on the block's device,
// each document's counting from 0, as packed position_ids do; `longest` is
// the largest + 1 (what picks longrope's factors, as transformers'
// max(position_ids) + 1 does). A null BatchPositions: positions 0..seq-1 in
// every row, one document each.
struct BatchPositions {
  at::Tensor ids;
  int64_t longest = 0;
};
// Of host positions for rows of `seq` tokens: 0 where every row is 0..seq-1
// (no BatchPositions needed: plain causal attention), else the largest + 1.
// Throws naming the first position outside [0, seq) and its token (counted
// from `first`: where positions[0] is in the batch).
int64_t packed_longest(std::span<const int64_t> positions, int64_t seq, size_t first = 0);

class BlockRunner {
 public:
  BlockRunner(const ModelSpec& spec, ComputeOptions options, int64_t seq, at::Device device);

  // Forward of block `b` without autograd. `input` is token ids [mb, seq] for
  // the embedding and the previous block's output otherwise. Not for the head.
  // `save` (a layer only: a flat buffer of layer_saved_elems elements in the
  // compute dtype) receives what its backward needs (gpu/blocks/blocks.h, LayerSaved).
  // `positions`: the rows' documents (a layer only; null: one per row).
  // `moe`: a layer with experts adds its routing statistics there (gpu/blocks/moe.h).
  // `adapters` false: without its LoRA adapters, the frozen base alone (a
  // reference pass: Engine::logprobs).
  at::Tensor forward(int64_t b, const at::Tensor& params, const at::Tensor& input,
                     const at::Tensor& save = {}, const BatchPositions* positions = nullptr,
                     const MoeStep* moe = nullptr, bool adapters = true) const;

  // Backward of a layer or the embedding: adds the trainable parameters'
  // gradients into `grads` (fp32 flat, same layout) and returns d(loss)/d(input) (undefined
  // for the embedding). A layer recomputes its forward's projections, or
  // takes them from `saved` (what forward wrote into `save`): the same bits.
  // `grads` may start at block element `grads_from` (before it: frozen).
  // `moe`: the load-balancing loss's gradient for a layer with experts.
  at::Tensor backward(int64_t b, const at::Tensor& params, const at::Tensor& input,
                      const at::Tensor& grad_out, const at::Tensor& grads, const at::Tensor& saved = {},
                      size_t grads_from = 0, const BatchPositions* positions = nullptr,
                      const MoeStep* moe = nullptr) const;

  // A sub-layer piece of layer block `b` (Piece::sub_layer), one
  // micro-batch: the attention half's forward from `input` into `cut` (x1,
  // h2; the sum zeroed), a slice's partial output added to cut.sum, and the
  // last slice's the layer's output into `out`. Backward: the last slice
  // (the first in backward) zeroes cut.sum and each adds its input gradient
  // there, from the layer's output gradient `grad_out`; the attention half
  // replaces grad_out by d(loss)/d(input). Parameter gradients add into
  // `grads` (fp32, the piece's coordinates).
  // `moe`: a layer with experts' load-balancing loss (the attention half's
  // routing adds its statistics; its backward, the loss's gradient).
  void forward_piece(const Piece& pc, const at::Tensor& params, const at::Tensor& input, const at::Tensor& out,
                     const CutBuffers& cut, const BatchPositions* positions = nullptr,
                     const MoeStep* moe = nullptr) const;
  // The attention half's forward again (the same bits), before the slices'
  // backward: the MLP's input into cut.h2 only (and a layer with experts'
  // routing, without statistics).
  void recompute_mlp_input(const Piece& pc, const at::Tensor& params, const at::Tensor& input, const CutBuffers& cut,
                           const BatchPositions* positions = nullptr) const;
  void backward_piece(const Piece& pc, const at::Tensor& params, const at::Tensor& input, const at::Tensor& grad_out,
                      const at::Tensor& grads, const CutBuffers& cut, const BatchPositions* positions = nullptr,
                      const MoeStep* moe = nullptr) const;

  // The head: loss and gradients. With tied embeddings `tied_params` /
  // `tied_grads` are the embedding block's flat buffers (the LM head reads
  // and accumulates into the embedding weight); otherwise pass undefined.
  HeadResult head_backward(const at::Tensor& params, const at::Tensor& grads,
                           const at::Tensor& tied_params, const at::Tensor& tied_grads,
                           const at::Tensor& input, const at::Tensor& labels, double loss_scale,
                           Scalars scalars = Scalars::kToHost) const;
  HeadResult head_eval(const at::Tensor& params, const at::Tensor& tied_params,
                       const at::Tensor& input, const at::Tensor& labels,
                       Scalars scalars = Scalars::kToHost) const;

  const ModelSpec& spec() const { return spec_; }
  const ComputeOptions& options() const { return options_; }

 private:
  HeadWeights head_weights(const at::Tensor& params, const at::Tensor& tied_params) const;
  // Layer l's token layout: its RoPE rows, and its documents where `positions` has them.
  TokenLayout layout_of(int64_t layer, const BatchPositions* positions) const;

  const ModelSpec& spec_;
  ComputeOptions options_;
  std::vector<ParamLayout> layouts_;
  RopeTables rope_;
  RopeTables local_rope_;  // the sliding layers' (ModelSpec::local_rope), where the model has them
  // longrope's short-factor tables, where seq picks the long ones: for packed
  // rows whose positions stay within original_max_position.
  RopeTables short_rope_;
};

}  // namespace strider
