#include "engine/shards.h"

#include <algorithm>
#include <numeric>
#include <fmt/format.h>

#include "host/error.h"

namespace strider {

size_t Sharding::head_visit_elems(int64_t s) const {
  return pieces[size_t(norm_piece)].elems() + pieces[size_t(lm_piece[size_t(s)])].elems();
}

std::string Sharding::name(const ModelSpec& spec, int64_t i) const {
  const Piece& p = pieces[size_t(i)];
  const BlockKind kind = spec.block(p.block).kind;
  if (kind == BlockKind::kLayer) return spec.block_name(p.block);
  if (i == norm_piece) return "head norm";
  return fmt::format("{}[{}:{})", kind == BlockKind::kEmbedding ? "embedding" : "lm_head", p.row_begin, p.row_end);
}

Sharding make_sharding(const ModelSpec& spec, int64_t vocab_chunk, int64_t shard_rows, int64_t align_elems) {
  STRIDER_CHECK(vocab_chunk >= 0 && shard_rows >= 0, "vocab chunk {} and shard rows {} must be >= 0", vocab_chunk,
                shard_rows);
  Sharding s;
  const int64_t blocks = spec.num_blocks(), head = blocks - 1, V = spec.dims.vocab, H = spec.dims.hidden;
  const ParamLayout emb = spec.layout(0), hd = spec.layout(head);
  for (int64_t b = 1; b < head; ++b) s.layer_elems = std::max(s.layer_elems, spec.layout(b).total_elems());
  const TensorSlot* norm = hd.find("model.norm.weight");
  STRIDER_CHECK(norm && norm->offset_elems == 0, "head layout: model.norm.weight must come first");
  const TensorSlot* lm = spec.tie_embeddings ? nullptr : hd.find("lm_head.weight");
  // The norm piece ends where the LM head's rows begin (its padding with it).
  const size_t norm_elems = lm ? lm->offset_elems : hd.total_elems();

  int64_t chunk = vocab_chunk > 0 ? std::min(vocab_chunk, V) : V;
  int64_t rows = shard_rows;
  if (rows == 0) {
    // The most rows whose head visit (norm + rows) fits where a layer does.
    const int64_t fit = std::max<int64_t>(1, int64_t((s.layer_elems - std::min(s.layer_elems, norm_elems)) / size_t(H)));
    rows = fit >= chunk ? fit / chunk * chunk : fit;
  }
  rows = std::min(rows, V);
  if (align_elems > 1 && rows < V) {
    // Shard k starts at k * rows * H elements into its tensor (whose offset is
    // a multiple of 128): rows must be a multiple of a.
    const int64_t a = align_elems / std::gcd(align_elems, H);
    if (shard_rows > 0) {
      STRIDER_CHECK(rows % a == 0, "vocabulary shards of {} rows start at elements that are not multiples of {} "
                    "({} rows x hidden {}), which the optimizer state's groups need: give a multiple of {} rows",
                    rows, align_elems, rows, H, a);
    } else {
      const int64_t l = std::lcm(chunk, a);
      rows = rows >= l ? rows / l * l : std::max(a, rows / a * a);
      if (rows >= chunk && rows % chunk != 0) chunk = std::gcd(rows, chunk);  // chunks still tile each shard
    }
  }
  if (rows < chunk) chunk = rows;
  STRIDER_CHECK(rows % chunk == 0 || rows == V, "vocabulary shards of {} rows do not fall on LM-head chunks of {} "
                "rows: give a multiple of the chunk", rows, chunk);
  s.rows = rows;
  s.chunk = chunk;
  s.shards = (V + rows - 1) / rows;

  auto add = [&](Piece p) { s.pieces.push_back(p); };
  auto row_pieces = [&](int64_t b, size_t base, size_t total, std::vector<int64_t>& index) {
    for (int64_t k = 0; k < s.shards; ++k) {
      const int64_t r0 = k * rows, r1 = std::min(V, r0 + rows);
      index.push_back(int64_t(s.pieces.size()));
      add({b, base + size_t(r0 * H), k + 1 == s.shards ? total : base + size_t(r1 * H), r0, r1});
    }
  };
  const TensorSlot* ew = emb.find("model.embed_tokens.weight");
  STRIDER_CHECK(ew && ew->offset_elems == 0, "embedding layout: model.embed_tokens.weight must come first");
  s.first.push_back(0);
  row_pieces(0, 0, emb.total_elems(), s.emb_piece);
  for (int64_t b = 1; b < head; ++b) {
    s.first.push_back(int64_t(s.pieces.size()));
    add({b, 0, spec.layout(b).total_elems()});
  }
  s.first.push_back(int64_t(s.pieces.size()));
  s.norm_piece = int64_t(s.pieces.size());
  add({head, 0, norm_elems});
  if (lm) row_pieces(head, lm->offset_elems, hd.total_elems(), s.lm_piece);
  else s.lm_piece = s.emb_piece;
  s.first.push_back(int64_t(s.pieces.size()));

  s.unit_elems = s.layer_elems;
  for (int64_t k = 0; k < s.shards; ++k)
    s.unit_elems = std::max({s.unit_elems, s.pieces[size_t(s.emb_piece[size_t(k)])].elems(), s.head_visit_elems(k)});
  return s;
}

std::vector<size_t> rank_slices(size_t elems, int world, size_t align_elems) {
  STRIDER_CHECK(world >= 1 && align_elems >= 1, "rank_slices: {} ranks, groups of {}", world, align_elems);
  const size_t groups = (elems + align_elems - 1) / align_elems;
  const size_t per = (groups + size_t(world) - 1) / size_t(world) * align_elems;
  std::vector<size_t> bounds(size_t(world) + 1);
  for (size_t r = 0; r <= size_t(world); ++r) bounds[r] = std::min(elems, r * per);
  return bounds;
}

}  // namespace strider
