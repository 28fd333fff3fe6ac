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
// Each piece has its own gradient D2H, AdamW job, NVMe extents and update
// wait; each visit of the sliding window loads a few pieces' compute copies
// into one cache unit. Storage (ParamStore, checkpoints, the Python aliasing)
// still sees whole blocks: a piece is an element range of its block.
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

#include "engine/model_spec.h"

namespace strider {

struct Piece {
  int64_t block = 0;            // the storage block
  size_t begin = 0, end = 0;    // elements of the block's flat layout
  int64_t row_begin = 0, row_end = 0;  // vocabulary rows (embedding and LM-head shards); 0, 0 otherwise
  size_t elems() const { return end - begin; }
  bool rows() const { return row_end > row_begin; }
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
  size_t layer_elems = 0;       // the largest decoder layer
  size_t unit_elems = 0;        // the largest visit: a layer, an embedding shard, or norm + LM-head shard

  // The pieces of block b.
  int64_t first_of(int64_t b) const { return first[size_t(b)]; }
  int64_t end_of(int64_t b) const { return first[size_t(b) + 1]; }
  // Elements a head visit of shard s loads: the norm, then the shard's rows.
  size_t head_visit_elems(int64_t s) const;
  // "embedding[0:4096)", "layer.3", "head norm", "lm_head[4096:8192)".
  std::string name(const ModelSpec& spec, int64_t piece) const;
};

// `shard_rows` > 0 asks for that many rows per shard (a multiple of the
// chunk, or less than it: then the chunk shrinks to it); 0 chooses the most
// whole chunks whose head visit (norm + rows) fits in the largest layer's
// unit, at least one chunk. `vocab_chunk` 0 means the whole vocabulary.
// `align_elems` > 1: every piece starts at a multiple of it within its block
// (the q8 optimizer state's groups must not straddle two pieces, which are
// updated apart): chosen rows are rounded down to fit, given ones are refused.
Sharding make_sharding(const ModelSpec& spec, int64_t vocab_chunk, int64_t shard_rows = 0, int64_t align_elems = 1);

// Data parallel with sharded state: which elements of a block of `elems`
// each of `world` ranks keeps the master and Adam state of. world + 1 bounds,
// rank r's slice [bounds[r], bounds[r + 1]): equal slices of whole
// `align_elems` groups (the q8 groups), the last ranks' shorter or empty.
// A piece's slices are its range cut by these bounds.
std::vector<size_t> rank_slices(size_t elems, int world, size_t align_elems = 1);

}  // namespace strider
