// Shards: the engine's units of work inside the model's blocks.
//
// A ModelSpec block (embedding, decoder layer, final norm + LM head) is how
// parameters are stored: one flat buffer per kind, one checkpoint layout. It
// is not how they move: the embedding and the LM head are as large as the
// vocabulary, and a cache unit sized for them would be several layers' worth
// (Llama-3.1-8B: 525M parameters against 218M in a layer). So the engine cuts
// them into vocabulary shards of whole rows, no larger than the largest decoder
// layer, and works per *piece*:
//   - a layer is one piece (its whole block);
//   - the embedding is one piece per shard of rows;
//   - the head is one piece for the final norm, and (untied) one per shard of
//     LM-head rows. Tied, the LM head's rows are the embedding's pieces.
//   - a layer with LoRA adapters (engine/model/lora.h) is two: its frozen base and
//     its adapters ("layer.3[base]", "layer.3[lora]");
//   - a layer with experts may be its attention and router, and groups of
//     experts ("layer.3[attention+router]", "layer.3[experts[0:16)]").
//   - a layer cut into sub-layer pieces (EngineConfig::mlp_pieces) is its
//     attention half and slices of its MLP along the intermediate dimension
//     ("layer.3[attention]", "layer.3[mlp[0:4096)]"); unlike the cuts
//     above, each is a visit of its own (gpu/blocks/layer_cut.h computes it).
// Each piece has its own gradient D2H, AdamW job, NVMe extents and update
// wait; each visit of the sliding window loads a few pieces' compute copies
// into one cache unit. Storage (ParamStore, checkpoints, the Python aliasing)
// still sees whole blocks: a piece is a list of element ranges of its block.
//
// A piece of several ranges (EngineConfig::layer_pieces cuts a layer by
// tensor names: its norms are two ranges, input_layernorm and
// post_attention_layernorm; a group of experts (EngineConfig::expert_pieces)
// is a range of each fused expert tensor; an MLP slice along the intermediate
// dimension is one range of gate's rows, one of up's and one per row of
// down_proj [hidden, intermediate]) has two coordinates:
//   - the piece's own: its ranges back to back, in block order. Its gradients
//     on the host, its NVMe extents, its AdamW runs' offsets and the ranks'
//     slices of it are in these; the piece's part of a rank's slice of the
//     block is one stretch of them, since the ranges ascend.
//   - the block's: the host compute copy and the optimizer state stay in the
//     block's layout, so the Python model's tensors still alias them.
// In a cache unit a visit's ranges lie grouped by block in the visit's order
// and, within a block, in block order (Sharding::unit_layout): a layer whose
// pieces all ride in its visit sees the block's layout, whatever pieces cut it;
// the head's visit is its norm, then a shard's rows.
//
// Shard boundaries fall on LM-head chunk boundaries, so the head's streaming
// log-sum-exp runs over exactly the chunks, in exactly the order, an unsharded
// head would: the loss and every gradient are bit-identical to the resident
// reference's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/model/model_spec.h"

namespace strider {

// Elements [begin, end) of a block's flat layout.
struct ElemRange {
  size_t begin = 0, end = 0;
  size_t elems() const { return end - begin; }
};

// A stretch of a piece that is contiguous in its block: `n` elements, at `at`
// in the piece's coordinates and at `block` in the block's, in the piece's
// range `range`.
struct PieceRun {
  size_t at = 0, block = 0, n = 0;
  size_t range = 0;
};

struct Piece {
  int64_t block = 0;               // the storage block
  std::vector<ElemRange> ranges;   // elements of the block's flat layout: ascending, disjoint, not empty
  int64_t row_begin = 0, row_end = 0;  // vocabulary rows (embedding and LM-head shards: one range); 0, 0 otherwise
  std::string part;                // a layer cut into pieces: this one's group of names (EngineConfig::layer_pieces)
  // A piece of a layer cut into sub-layer pieces (EngineConfig::mlp_pieces):
  // its attention half (mlp_end == 0), or the MLP's intermediate rows
  // [mlp_begin, mlp_end), or in a layer with experts its experts [mlp_begin,
  // mlp_end) (its attention half then holds the router too). Such a piece is
  // a visit of its own.
  bool sub_layer = false;
  int64_t mlp_begin = 0, mlp_end = 0;
  // Every tensor it holds is frozen (a LoRA base, engine/model/lora.h): its
  // program has no gradient, landing, update or state operations.
  bool frozen = false;
  // A frozen base held in a quantized format (EngineConfig::base_format):
  // its visit's load sends its block's base bytes, and the visit's first
  // operation dequantizes them into the unit (Placement sets it).
  bool quantized = false;
  size_t elems() const;
  bool rows() const { return row_end > row_begin; }
  bool mlp_slice() const { return mlp_end > mlp_begin; }
  // Piece coordinates [lo, hi) as runs contiguous in the block, in order.
  std::vector<PieceRun> runs(size_t lo, size_t hi) const;
  std::vector<PieceRun> runs() const { return runs(0, elems()); }
  // How many of the piece's elements lie before block element x.
  size_t before(size_t x) const;
};

// Where a range of a visit's piece lies in its cache unit (Sharding::unit_layout).
struct UnitRun {
  int64_t piece = 0;
  size_t unit_at = 0;              // elements into the unit
  PieceRun run;                    // one of the piece's ranges, whole
};

// One visit's parameters in a cache unit: pieces' compute copies back to back.
struct Sharding {
  int64_t rows = 0;             // vocabulary rows per shard (the last may hold fewer)
  int64_t chunk = 0;            // LM-head chunk: rows per logits matmul (divides `rows` unless one shard)
  int64_t shards = 0;           // vocabulary shards: ceil(vocab / rows)
  std::vector<Piece> pieces;    // forward order: embedding shards, layers, head norm, LM-head shards (untied)
  std::vector<int64_t> first;   // per block: its first piece (first[blocks] = pieces.size())
  int64_t norm_piece = 0;       // the head's final norm
  // Per vocabulary shard: the piece holding its LM-head rows (the embedding's
  // own pieces when tied) and its embedding piece.
  std::vector<int64_t> lm_piece, emb_piece;
  size_t layer_elems = 0;       // the largest decoder layer's visit (a layer, or a sub-layer piece)
  size_t unit_elems = 0;        // the largest visit: a layer, an embedding shard, or norm + LM-head shard
  // The most gradient accumulators a visit needs: its elements from its
  // first trained range on (grad_base); unit_elems unless pieces are frozen.
  size_t unit_grad_elems = 0;

  // The pieces of block b.
  int64_t first_of(int64_t b) const { return first[size_t(b)]; }
  int64_t end_of(int64_t b) const { return first[size_t(b) + 1]; }
  // Elements a head visit of shard s loads: the norm, then the shard's rows.
  size_t head_visit_elems(int64_t s) const;
  // The pieces one visit loads: the head's (shard >= 0) norm and that
  // shard's LM-head rows; an embedding shard alone; a sub-layer piece
  // alone; a layer's all.
  std::vector<int64_t> visit_pieces(int64_t piece, int64_t shard) const;
  // Their ranges in the unit: grouped by block in the order given, in block
  // order within a block, back to back.
  std::vector<UnitRun> unit_layout(const std::vector<int64_t>& visit) const;
  // Where a visit's gradient accumulators start in the unit: its first
  // trained range's unit_at (0 unless frozen ranges come first: a LoRA
  // layer's base, the head's frozen norm), or its end when every range is
  // frozen. A unit's gradient area holds the visit's elements from there on,
  // element unit_at of the unit at unit_at - grad_base of the area.
  size_t grad_base(const std::vector<UnitRun>& layout) const;
  // "embedding[0:4096)", "layer.3", "layer.3[self_attn+mlp]", "head norm", "lm_head[4096:8192)".
  std::string name(const ModelSpec& spec, int64_t piece) const;
};

// `shard_rows` > 0 asks for that many rows per shard (a multiple of the
// chunk, or less than it: then the chunk shrinks to it); 0 chooses the most
// whole chunks whose head visit (norm + rows) fits in the largest layer's
// unit, at least one chunk. `vocab_chunk` 0 means the whole vocabulary.
// `align_elems` > 1: every piece starts at a multiple of it within its block
// (the q8 optimizer state's groups must not straddle two pieces, which are
// updated apart): chosen rows are rounded down to fit, given ones are refused.
// `layer_pieces` (EngineConfig::layer_pieces) cuts each decoder layer.
// `min_shards` > 1 (a pool's devices) makes chosen shards no larger than
// needed for that many, in whole chunks, so the head's shards spread over
// the pool (Placement::head_device); given rows are kept.
// `expert_pieces` > 0 (EngineConfig::expert_pieces) takes a sparse layer's
// experts out of the pieces `layer_pieces` made: groups of that many experts,
// each a piece of one range per fused expert tensor (expert_piece_ranges).
// `mlp_pieces` > 0 (EngineConfig::mlp_pieces) cuts every decoder layer into
// its attention half and that many MLP slices (mlp_slice_ranges).
Sharding make_sharding(const ModelSpec& spec, int64_t vocab_chunk, int64_t shard_rows = 0, int64_t align_elems = 1,
                       const std::string& layer_pieces = "", int64_t min_shards = 1, int64_t expert_pieces = 0,
                       int64_t mlp_pieces = 0);

// A decoder layer's pieces by tensor name: `groups` is comma-separated
// groups, each of '+'-joined fragments of the name after the layer's prefix
// ("model.layers.N."); a group is one piece, the tensors whose name contains
// one of its fragments (each tensor's range reaching to the next tensor's
// start), in the order the groups are given. Empty: the whole layer is one
// piece. Throws, naming the tensor or the group, where a tensor matches no
// group or two, or a group matches no tensor.
std::vector<std::vector<ElemRange>> layer_piece_ranges(const ParamLayout& layer, const std::string& groups);

// A sparse layer's experts in groups of `per_piece` (the last may hold
// fewer): group g is experts [g * per_piece, ...) of each fused expert tensor
// (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]), one
// range in each, since an expert's rows are contiguous. Labelled
// "experts[0:4)". The compute does not see the cut: the layer's visit loads
// every piece, in the block's layout.
struct ExpertGroup {
  std::string label;
  std::vector<ElemRange> ranges;
};
std::vector<ExpertGroup> expert_piece_ranges(const ParamLayout& layer, int64_t experts, int64_t per_piece);

// A dense decoder layer cut into its attention half and `slices` MLP
// slices along the intermediate dimension (gpu/blocks/layer_cut.h): slice j holds
// rows [i_j, i_{j+1}) of gate_proj and up_proj (and their biases), those
// columns of each of down_proj's rows, and down_proj's bias in the first;
// the attention half every other element. The cuts are as even as
// `align_elems` allows (each range starts on a whole group of the optimizer
// state: the intermediate size and every cut a multiple of it). Throws,
// naming the layer and what stops it, where the layer cannot be cut: a fused
// gate_up_proj, experts, a norm after the MLP, LoRA adapters, or more
// slices than aligned rows. Returns the pieces' ranges, the attention half
// first, with their labels and bounds.
struct MlpSlice {
  std::string label;
  std::vector<ElemRange> ranges;
  int64_t begin = 0, end = 0;  // intermediate rows, or experts (0, 0: the attention half)
};
std::vector<MlpSlice> mlp_slice_ranges(const ModelSpec& spec, int64_t block, int64_t slices, int64_t align_elems);
// A decoder layer with experts cut the same way (gpu/blocks/moe_cut.h): its
// attention-and-router half (every element but the experts' tensors': the
// router, a shared expert), then `groups` groups of consecutive experts, as
// even as whole experts allow, each a range of every fused expert tensor.
// Throws naming the layer where it cannot be cut: a norm after the MLP, LoRA
// adapters, or more groups than experts.
std::vector<MlpSlice> expert_group_ranges(const ModelSpec& spec, int64_t block, int64_t groups);

// Data parallel with sharded state: which elements of a block of `elems`
// each of `world` ranks keeps the master and Adam state of. world + 1 bounds,
// rank r's slice [bounds[r], bounds[r + 1]): equal slices of whole
// `align_elems` groups (the q8 groups), the last ranks' shorter or empty.
// A piece's slices are its range cut by these bounds.
std::vector<size_t> rank_slices(size_t elems, int world, size_t align_elems = 1);

}  // namespace strider
