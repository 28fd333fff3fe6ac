#include "engine/placement/pieces.h"

#include <algorithm>
#include <numeric>
#include <fmt/format.h>

#include "host/error.h"

namespace strider {

size_t Piece::elems() const {
  size_t n = 0;
  for (const ElemRange& r : ranges) n += r.elems();
  return n;
}

std::vector<PieceRun> Piece::runs(size_t lo, size_t hi) const {
  std::vector<PieceRun> out;
  size_t at = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const ElemRange& r = ranges[i];
    const size_t a = std::max(lo, at), b = std::min(hi, at + r.elems());
    if (a < b) out.push_back({a, r.begin + (a - at), b - a, i});
    at += r.elems();
  }
  return out;
}

size_t Piece::before(size_t x) const {
  size_t n = 0;
  for (const ElemRange& r : ranges) n += std::clamp(x, r.begin, r.end) - r.begin;
  return n;
}

size_t Sharding::head_visit_elems(int64_t s) const {
  return pieces[size_t(norm_piece)].elems() + pieces[size_t(lm_piece[size_t(s)])].elems();
}

std::vector<int64_t> Sharding::visit_pieces(int64_t piece, int64_t shard) const {
  if (shard >= 0) return {norm_piece, lm_piece[size_t(shard)]};
  const Piece& pc = pieces[size_t(piece)];
  if (pc.rows() || pc.sub_layer) return {piece};
  std::vector<int64_t> all;
  for (int64_t p = first_of(pc.block); p < end_of(pc.block); ++p) all.push_back(p);
  return all;
}

std::vector<UnitRun> Sharding::unit_layout(const std::vector<int64_t>& visit) const {
  std::vector<UnitRun> out;
  size_t at = 0;
  for (size_t i = 0; i < visit.size(); ++i) {
    const int64_t block = pieces[size_t(visit[i])].block;
    bool seen = false;  // the block's group was laid out already
    for (size_t j = 0; j < i; ++j) seen = seen || pieces[size_t(visit[j])].block == block;
    if (seen) continue;
    std::vector<UnitRun> group;
    for (size_t j = i; j < visit.size(); ++j)
      if (pieces[size_t(visit[j])].block == block)
        for (const PieceRun& r : pieces[size_t(visit[j])].runs()) group.push_back({visit[j], 0, r});
    const auto by_block = [](const UnitRun& a, const UnitRun& b) { return a.run.block < b.run.block; };
    if (!std::is_sorted(group.begin(), group.end(), by_block)) std::sort(group.begin(), group.end(), by_block);
    for (UnitRun& u : group) {
      u.unit_at = at;
      at += u.run.n;
      out.push_back(u);
    }
  }
  return out;
}

size_t Sharding::grad_base(const std::vector<UnitRun>& layout) const {
  size_t end = 0;
  for (const UnitRun& u : layout) {
    if (!pieces[size_t(u.piece)].frozen) return u.unit_at;
    end = std::max(end, u.unit_at + u.run.n);
  }
  return end;
}

std::vector<std::vector<ElemRange>> layer_piece_ranges(const ParamLayout& layer, const std::string& groups) {
  const std::vector<TensorSlot>& slots = layer.slots();
  if (groups.empty()) return {{{0, layer.total_elems()}}};
  std::vector<std::vector<std::string>> frags;
  std::vector<std::string> texts;
  for (size_t a = 0; a <= groups.size();) {
    const size_t b = std::min(groups.find(',', a), groups.size());
    texts.push_back(groups.substr(a, b - a));
    std::vector<std::string>& f = frags.emplace_back();
    const std::string& g = texts.back();
    for (size_t x = 0; x <= g.size();) {
      const size_t y = std::min(g.find('+', x), g.size());
      std::string frag = g.substr(x, y - x);  // spaces around it are not part of any name
      frag.erase(0, frag.find_first_not_of(' '));
      frag.erase(frag.find_last_not_of(' ') + 1);
      STRIDER_CHECK(!frag.empty(), "layer_pieces '{}': group '{}' has an empty name fragment (groups are separated "
                    "by ',', fragments of one group by '+')", groups, g);
      f.push_back(std::move(frag));
      x = y + 1;
    }
    a = b + 1;
  }
  std::vector<std::vector<ElemRange>> out(frags.size());
  for (size_t t = 0; t < slots.size(); ++t) {
    // The name after "model.layers.N.".
    const std::string& name = slots[t].name;
    size_t cut = 0;
    if (name.rfind("model.layers.", 0) == 0) cut = name.find('.', 13) + 1;
    const std::string own = name.substr(cut);
    int64_t group = -1;
    for (size_t g = 0; g < frags.size(); ++g)
      for (const std::string& f : frags[g])
        if (own.find(f) != std::string::npos && group != int64_t(g)) {
          STRIDER_CHECK(group < 0, "layer_pieces '{}': tensor {} matches two groups, '{}' and '{}'", groups, name,
                        texts[size_t(group)], texts[g]);
          group = int64_t(g);
        }
    STRIDER_CHECK(group >= 0, "layer_pieces '{}': tensor {} matches no group; every tensor of a layer belongs to "
                  "exactly one piece", groups, name);
    // From its start (the first: the block's) to the next tensor's (the last: the block's end), so that the
    // pieces tile the block, its alignment padding included.
    const ElemRange r{t == 0 ? 0 : slots[t].offset_elems,
                      t + 1 < slots.size() ? slots[t + 1].offset_elems : layer.total_elems()};
    std::vector<ElemRange>& rs = out[size_t(group)];
    if (!rs.empty() && rs.back().end == r.begin) rs.back().end = r.end;
    else rs.push_back(r);
  }
  for (size_t g = 0; g < out.size(); ++g)
    STRIDER_CHECK(!out[g].empty(), "layer_pieces '{}': group '{}' matches no tensor of {}", groups, texts[g],
                  layer.block_name());
  return out;
}

namespace {

// Where the experts' fused tensors lie in a sparse layer: each from its start
// to the next tensor's (its alignment padding with it).
std::vector<ElemRange> expert_tensor_ranges(const ParamLayout& layer) {
  const std::vector<TensorSlot>& slots = layer.slots();
  std::vector<ElemRange> out;
  for (size_t t = 0; t < slots.size(); ++t)
    if (slots[t].name.find(".mlp.experts.") != std::string::npos)
      out.push_back({slots[t].offset_elems, t + 1 < slots.size() ? slots[t + 1].offset_elems : layer.total_elems()});
  return out;
}

// `ranges` less `cut` (both ascending and disjoint).
std::vector<ElemRange> subtract(const std::vector<ElemRange>& ranges, const std::vector<ElemRange>& cut) {
  std::vector<ElemRange> out;
  for (ElemRange r : ranges) {
    for (const ElemRange& c : cut) {
      if (c.end <= r.begin || c.begin >= r.end) continue;
      if (c.begin > r.begin) out.push_back({r.begin, c.begin});
      r.begin = std::min(r.end, c.end);
    }
    if (r.end > r.begin) out.push_back(r);
  }
  return out;
}

}  // namespace

namespace {

// Experts [e0, e1)'s ranges of every fused expert tensor (`whole`: those
// tensors' ranges, expert_tensor_ranges).
std::vector<ElemRange> expert_ranges(const ParamLayout& layer, int64_t experts, int64_t e0, int64_t e1,
                                     const std::vector<ElemRange>& whole) {
  std::vector<ElemRange> out;
  size_t k = 0;
  for (const TensorSlot& t : layer.slots()) {
    if (t.name.find(".mlp.experts.") == std::string::npos) continue;
    STRIDER_CHECK(!t.shape.empty() && t.shape[0] == experts, "expert_pieces: {} has shape[0] {}, not the {} experts",
                  t.name, t.shape.empty() ? 0 : t.shape[0], experts);
    const size_t per = t.numel / size_t(experts);
    // The last group reaches to the tensor's range end (its padding).
    out.push_back({t.offset_elems + size_t(e0) * per, e1 == experts ? whole[k].end : t.offset_elems + size_t(e1) * per});
    ++k;
  }
  return out;
}

}  // namespace

std::vector<ExpertGroup> expert_piece_ranges(const ParamLayout& layer, int64_t experts, int64_t per_piece) {
  STRIDER_CHECK(per_piece >= 1 && experts >= 1, "expert_pieces {} must be >= 1 ({} experts)", per_piece, experts);
  const std::vector<ElemRange> whole = expert_tensor_ranges(layer);
  STRIDER_CHECK(!whole.empty(), "expert_pieces: {} has no expert tensors (mlp.experts.*)", layer.block_name());
  std::vector<ExpertGroup> out;
  for (int64_t e0 = 0; e0 < experts; e0 += per_piece) {
    const int64_t e1 = std::min(experts, e0 + per_piece);
    out.push_back({fmt::format("experts[{}:{})", e0, e1), expert_ranges(layer, experts, e0, e1, whole)});
  }
  return out;
}

std::vector<MlpSlice> expert_group_ranges(const ModelSpec& spec, int64_t b, int64_t groups) {
  const ParamLayout layer = spec.layout(b);
  const int64_t l = spec.block(b).layer;
  const MoeDims m = spec.layer_dims(l).moe;
  const std::string prefix = fmt::format("model.layers.{}.", l), name = spec.block_name(b);
  STRIDER_CHECK(m.sparse(), "internal: expert_group_ranges of {}, which has no experts", name);
  STRIDER_CHECK(!layer.any_frozen(), "mlp_pieces: {} has LoRA adapters over a frozen base; sub-layer pieces are "
                "for full training", name);
  STRIDER_CHECK(!layer.find(prefix + "post_feedforward_layernorm.weight"), "mlp_pieces: {} has a norm after its MLP "
                "(post_feedforward_layernorm), which needs the groups' whole sum; it cannot be cut", name);
  STRIDER_CHECK(groups >= 1 && groups <= m.experts, "mlp_pieces {}: {} has {} experts: 1 to {} groups", groups, name,
                m.experts, m.experts);
  const std::vector<ElemRange> whole = expert_tensor_ranges(layer);
  STRIDER_CHECK(!whole.empty(), "mlp_pieces: {} has no expert tensors (mlp.experts.*)", name);
  std::vector<MlpSlice> out(size_t(groups) + 1);
  out[0].label = "attention+router";
  out[0].ranges = subtract({{0, layer.total_elems()}}, whole);
  for (int64_t j = 0; j < groups; ++j) {
    MlpSlice& g = out[size_t(j) + 1];
    g.begin = j * m.experts / groups;
    g.end = (j + 1) * m.experts / groups;
    g.label = fmt::format("experts[{}:{})", g.begin, g.end);
    g.ranges = expert_ranges(layer, m.experts, g.begin, g.end, whole);
  }
  return out;
}

std::string Sharding::name(const ModelSpec& spec, int64_t i) const {
  const Piece& p = pieces[size_t(i)];
  const BlockKind kind = spec.block(p.block).kind;
  if (kind == BlockKind::kLayer) return p.part.empty() ? spec.block_name(p.block) : spec.block_name(p.block) + "[" + p.part + "]";
  if (i == norm_piece) return "head norm";
  return fmt::format("{}[{}:{})", kind == BlockKind::kEmbedding ? "embedding" : "lm_head", p.row_begin, p.row_end);
}

Sharding make_sharding(const ModelSpec& spec, int64_t vocab_chunk, int64_t shard_rows, int64_t align_elems,
                       const std::string& layer_pieces, int64_t min_shards, int64_t expert_pieces,
                       int64_t mlp_pieces) {
  STRIDER_CHECK(mlp_pieces >= 0, "mlp_pieces {} must be >= 0 (0: whole layers)", mlp_pieces);
  STRIDER_CHECK(mlp_pieces == 0 || layer_pieces.empty(), "mlp_pieces {} with layer_pieces '{}': a layer is cut one "
                "way; leave layer_pieces empty", mlp_pieces, layer_pieces);
  STRIDER_CHECK(expert_pieces >= 0, "expert_pieces {} must be >= 0 (0: a layer's experts stay in its pieces)",
                expert_pieces);
  STRIDER_CHECK(mlp_pieces == 0 || expert_pieces == 0 || spec.sparse_layer_count() == 0,
                "mlp_pieces {} with expert_pieces {}: a layer's experts are cut one way (mlp_pieces: groups that are "
                "visits of their own); leave expert_pieces 0", mlp_pieces, expert_pieces);
  STRIDER_CHECK(vocab_chunk >= 0 && shard_rows >= 0, "vocab chunk {} and shard rows {} must be >= 0", vocab_chunk,
                shard_rows);
  Sharding s;
  const int64_t blocks = spec.num_blocks(), head = blocks - 1, V = spec.dims.vocab, H = spec.dims.hidden;
  const ParamLayout emb = spec.layout(0), hd = spec.layout(head);
  for (int64_t b = 1; b < head; ++b) s.layer_elems = std::max(s.layer_elems, spec.layout(b).total_elems());
  // Layers cut into sub-layer pieces: a visit is one piece, the largest of
  // which sizes the head's shards below.
  std::vector<std::vector<MlpSlice>> sub(static_cast<size_t>(head));
  if (mlp_pieces > 0) {
    s.layer_elems = 0;
    for (int64_t b = 1; b < head; ++b) {
      sub[size_t(b)] = spec.sparse(spec.block(b).layer) ? expert_group_ranges(spec, b, mlp_pieces)
                                                        : mlp_slice_ranges(spec, b, mlp_pieces, align_elems);
      for (const MlpSlice& sl : sub[size_t(b)]) {
        size_t n = 0;
        for (const ElemRange& r : sl.ranges) n += r.elems();
        s.layer_elems = std::max(s.layer_elems, n);
      }
    }
  }
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
    // A pool: at least `min_shards` shards where whole chunks allow (the
    // chunk stays, so the loss and gradients keep their bits).
    const int64_t spread = (V + min_shards - 1) / min_shards;
    if (min_shards > 1 && rows >= chunk) rows = std::min(rows, std::max(chunk, (spread + chunk - 1) / chunk * chunk));
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
      add({b, {{base + size_t(r0 * H), k + 1 == s.shards ? total : base + size_t(r1 * H)}}, r0, r1});
    }
  };
  const TensorSlot* ew = emb.find("model.embed_tokens.weight");
  STRIDER_CHECK(ew && ew->offset_elems == 0, "embedding layout: model.embed_tokens.weight must come first");
  s.first.push_back(0);
  row_pieces(0, 0, emb.total_elems(), s.emb_piece);
  for (int64_t b = 1; b < head; ++b) {
    s.first.push_back(int64_t(s.pieces.size()));
    const ParamLayout layer = spec.layout(b);
    if (!sub[size_t(b)].empty()) {
      for (MlpSlice& sl : sub[size_t(b)]) {
        for (const ElemRange& r : sl.ranges)
          STRIDER_CHECK(r.begin % size_t(align_elems) == 0, "mlp_pieces: a piece of {} starts at element {}, not a "
                        "multiple of {} (the optimizer state's groups)", spec.block_name(b), r.begin, align_elems);
        Piece pc{b, std::move(sl.ranges), 0, 0, std::move(sl.label)};
        pc.sub_layer = true;
        pc.mlp_begin = sl.begin;
        pc.mlp_end = sl.end;
        add(std::move(pc));
      }
      continue;
    }
    if (layer.any_frozen() && layer.trainable_span().second > 0) {
      // A frozen base with adapters: two pieces, the base (its program has
      // no gradient, update or state operations) and the trained stretch.
      STRIDER_CHECK(layer_pieces.empty(), "layer_pieces '{}': cutting a layer with LoRA adapters into pieces by "
                    "name is not supported (it is cut into its frozen base and its adapters)", layer_pieces);
      const auto [tb, te] = layer.trainable_span();
      std::vector<ElemRange> base;
      if (tb > 0) base.push_back({0, tb});
      if (te < layer.total_elems()) base.push_back({te, layer.total_elems()});
      add({b, std::move(base), 0, 0, "base"});
      add({b, {{tb, te}}, 0, 0, "lora"});
      continue;
    }
    std::vector<std::vector<ElemRange>> cut = layer_piece_ranges(layer, layer_pieces);
    std::vector<std::string> labels;
    for (size_t g = 0, at = 0; g < cut.size(); ++g) {  // each piece's label: its group's text
      const size_t end = std::min(layer_pieces.find(',', at), layer_pieces.size());
      labels.push_back(cut.size() > 1 ? layer_pieces.substr(at, end - at) : std::string());
      at = end + 1;
    }
    if (expert_pieces > 0 && spec.sparse(spec.block(b).layer)) {
      // The experts leave whichever pieces held them, in groups of their own.
      std::vector<ExpertGroup> groups = expert_piece_ranges(layer, spec.dims.moe.experts, expert_pieces);
      const std::vector<ElemRange> experts = groups.empty() ? std::vector<ElemRange>{} : expert_tensor_ranges(layer);
      std::vector<std::vector<ElemRange>> rest;
      std::vector<std::string> rest_labels;
      for (size_t g = 0; g < cut.size(); ++g) {
        std::vector<ElemRange> left = subtract(cut[g], experts);
        if (left.empty()) continue;
        rest.push_back(std::move(left));
        rest_labels.push_back(labels[g].empty() ? "attention+router" : labels[g]);
      }
      for (ExpertGroup& e : groups) {
        rest.push_back(std::move(e.ranges));
        rest_labels.push_back(std::move(e.label));
      }
      cut = std::move(rest);
      labels = std::move(rest_labels);
    }
    for (size_t g = 0; g < cut.size(); ++g) {
      for (const ElemRange& r : cut[g])  // tensors start on whole groups (ParamLayout::kAlignElems)
        STRIDER_CHECK(r.begin % size_t(align_elems) == 0, "{}: a piece of {} starts at element {}, not a "
                      "multiple of {} (the optimizer state's groups)", expert_pieces > 0 ? "expert_pieces" : "layer_pieces",
                      spec.block_name(b), r.begin, align_elems);
      add({b, std::move(cut[g]), 0, 0, std::move(labels[g])});
    }
  }
  s.first.push_back(int64_t(s.pieces.size()));
  s.norm_piece = int64_t(s.pieces.size());
  add({head, {{0, norm_elems}}});
  if (lm) row_pieces(head, lm->offset_elems, hd.total_elems(), s.lm_piece);
  else s.lm_piece = s.emb_piece;
  s.first.push_back(int64_t(s.pieces.size()));

  // Frozen pieces: every tensor they hold is (a piece holds frozen and trained tensors only apart).
  for (int64_t i = 0; i < int64_t(s.pieces.size()); ++i) {
    Piece& pc = s.pieces[size_t(i)];
    const ParamLayout l = spec.layout(pc.block);
    int frozen = 0, trained = 0;
    for (const ElemRange& r : pc.ranges)
      for (const TensorSlot& t : l.slots())
        if (t.offset_elems < r.end && t.offset_elems + t.numel > r.begin) (t.trainable ? trained : frozen) += 1;
    STRIDER_CHECK(frozen == 0 || trained == 0, "{} holds {} frozen and {} trainable tensors; a piece is one or the "
                  "other", s.name(spec, i), frozen, trained);
    pc.frozen = frozen > 0;
  }
  s.unit_elems = s.layer_elems;
  for (int64_t k = 0; k < s.shards; ++k)
    s.unit_elems = std::max({s.unit_elems, s.pieces[size_t(s.emb_piece[size_t(k)])].elems(), s.head_visit_elems(k)});
  // The gradient area: every visit's elements from its first trained range on.
  auto grad_elems = [&](const std::vector<int64_t>& visit) {
    const std::vector<UnitRun> layout = s.unit_layout(visit);
    size_t n = 0;
    for (const UnitRun& u : layout) n = std::max(n, u.unit_at + u.run.n);
    return n - std::min(n, s.grad_base(layout));
  };
  for (int64_t b = 1; b < head; ++b)
    for (int64_t p = s.first_of(b); p < s.end_of(b); ++p)  // each a visit where the layer is cut into sub-layer pieces
      s.unit_grad_elems = std::max(s.unit_grad_elems, grad_elems(s.visit_pieces(p, -1)));
  for (int64_t k = 0; k < s.shards; ++k)
    s.unit_grad_elems = std::max({s.unit_grad_elems, grad_elems({s.emb_piece[size_t(k)]}), grad_elems(s.visit_pieces(-1, k))});
  return s;
}

std::vector<MlpSlice> mlp_slice_ranges(const ModelSpec& spec, int64_t b, int64_t slices, int64_t align_elems) {
  const ParamLayout layer = spec.layout(b);
  const int64_t l = spec.block(b).layer;
  const std::string prefix = fmt::format("model.layers.{}.", l), name = spec.block_name(b);
  STRIDER_CHECK(!spec.sparse(l), "internal: mlp_slice_ranges of {}, which has experts (expert_group_ranges cuts "
                "them)", name);
  STRIDER_CHECK(!layer.any_frozen(), "mlp_pieces: {} has LoRA adapters over a frozen base; sub-layer pieces are "
                "for full training", name);
  STRIDER_CHECK(!layer.find(prefix + "post_feedforward_layernorm.weight"), "mlp_pieces: {} has a norm after its MLP "
                "(post_feedforward_layernorm), which needs the slices' whole sum; it cannot be cut", name);
  const TensorSlot* gate = layer.find(prefix + "mlp.gate_proj.weight");
  const TensorSlot* up = layer.find(prefix + "mlp.up_proj.weight");
  const TensorSlot* down = layer.find(prefix + "mlp.down_proj.weight");
  STRIDER_CHECK(gate && up && down, "mlp_pieces: {} has no separate mlp.gate_proj, mlp.up_proj and mlp.down_proj "
                "(a fused gate_up_proj is not cut)", name);
  const int64_t I = spec.layer_dims(l).intermediate, H = spec.dims.hidden;
  // Down's rows start at multiples of I, gate's and up's at multiples of H:
  // with the state in groups, I and every cut are multiples of the group.
  const int64_t a = align_elems > 1 ? align_elems : 1;
  STRIDER_CHECK(I % a == 0, "mlp_pieces: {}'s intermediate size {} is not a multiple of {} (the optimizer state's "
                "groups), so its MLP slices would split them; use fp32 state", name, I, a);
  STRIDER_CHECK(slices >= 1 && slices <= I / a, "mlp_pieces {}: {}'s MLP has {} rows in groups of {}: 1 to {} slices",
                slices, name, I, a, I / a);
  // The MLP's tensors in block order (each slice's ranges ascend with them).
  std::vector<const TensorSlot*> mlp;
  for (const TensorSlot& t : layer.slots())
    if (t.name.rfind(prefix + "mlp.", 0) == 0) mlp.push_back(&t);
  std::vector<MlpSlice> out(size_t(slices) + 1);
  for (int64_t j = 0; j < slices; ++j) {
    MlpSlice& sl = out[size_t(j) + 1];
    sl.begin = j * (I / a) / slices * a;
    sl.end = (j + 1) * (I / a) / slices * a;
    sl.label = fmt::format("mlp[{}:{})", sl.begin, sl.end);
    const size_t i0 = size_t(sl.begin), i1 = size_t(sl.end);
    sl.ranges.reserve(size_t(H) + 5);
    for (const TensorSlot* t : mlp) {
      const std::string role = t->name.substr(prefix.size());
      if (t == gate || t == up) {
        sl.ranges.push_back({t->offset_elems + i0 * size_t(H), t->offset_elems + i1 * size_t(H)});
      } else if (t == down) {
        for (int64_t h = 0; h < H; ++h)
          sl.ranges.push_back({t->offset_elems + size_t(h * I) + i0, t->offset_elems + size_t(h * I) + i1});
      } else if (role == "mlp.gate_proj.bias" || role == "mlp.up_proj.bias") {
        sl.ranges.push_back({t->offset_elems + i0, t->offset_elems + i1});
      } else if (role == "mlp.down_proj.bias" && j == 0) {
        sl.ranges.push_back({t->offset_elems, t->offset_elems + t->numel});
      } else if (role != "mlp.down_proj.bias") {
        throw Error(fmt::format("mlp_pieces: {} has {}, which an MLP slice does not cut", name, t->name));
      }
    }
    STRIDER_CHECK(std::adjacent_find(sl.ranges.begin(), sl.ranges.end(),
                                     [](const ElemRange& x, const ElemRange& y) { return x.end > y.begin; }) ==
                      sl.ranges.end(),
                  "internal: {}'s MLP tensors are not in block order", name);
  }
  // The attention half: every element but the MLP's tensors'.
  std::vector<ElemRange> taken;
  for (const TensorSlot* t : mlp) taken.push_back({t->offset_elems, t->offset_elems + t->numel});
  out[0].label = "attention";
  out[0].ranges = subtract({{0, layer.total_elems()}}, taken);
  return out;
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
