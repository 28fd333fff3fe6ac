#include "engine/placement/placement.h"

#include <algorithm>
#include <optional>

#include "engine/config/engine_config_json.h"  // check_settings
#include "gpu/blocks/blocks.h"            // layer_saved_elems
#include "gpu/device/cache_unit_pool.h"   // CacheUnitPool::unit_bytes_for
#include "host/error.h"

namespace strider {
namespace {

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

// Whose gradients land in the shared ring rather than a buffer of their own:
// an NVMe-tier block's always (it keeps nothing but its compute copy in RAM),
// and without clipping (or loss scaling) every block's, since each block's
// update consumes its gradients as they land. With clipping a RAM-tier block
// keeps its own buffer: every gradient must outlive the global norm.
bool grads_in_ring(bool on_nvme, const EngineConfig& c) { return on_nvme || !c.gated_updates(); }

// The trained pieces in the order their gradients land (frozen pieces send none).
std::vector<int64_t> landing_order(const ModelSpec& spec, const Sharding& sh, int64_t head) {
  std::vector<int64_t> order;
  for (int64_t k = 0; k < sh.shards; ++k) {
    if (k + 1 == sh.shards) order.push_back(sh.norm_piece);
    if (!spec.tie_embeddings) order.push_back(sh.lm_piece[size_t(k)]);
  }
  for (int64_t p = sh.first_of(head) - 1; p >= 0; --p) order.push_back(p);
  std::erase_if(order, [&](int64_t p) { return sh.pieces[size_t(p)].frozen; });
  return order;
}

// The device buffers beyond the pool (Engine::allocate_activations allocates
// exactly these): the batch, the loss figures, checkpoints (or the 2-set ring
// when they live on the host), output gradients, the streamed head's
// per-token state and hidden gradient, kept-activation slots, kept logits.
void count_device(const ModelSpec& spec, const EngineConfig& c, Placement& pl) {
  EngineFootprint& f = pl.footprint;
  const size_t cbytes = pl.compute_bytes, M = size_t(c.accumulation);
  const size_t tokens = size_t(c.batch() * c.seq), mb_tokens = size_t(c.micro_batch * c.seq);
  const size_t hidden = size_t(spec.dims.hidden);
  const size_t act = round_up(mb_tokens * hidden * cbytes, 256);
  // Each device of a pool: the batch and output gradients; the sets of the
  // block inputs it holds (placement.h, holds_input; the 2-set ring with host
  // checkpoints); kept-activation slots if it runs a kept layer; the routing
  // statistics of a load-balancing loss; the head's
  // loss figures, per-token state, hidden gradient and kept logits (its
  // shards' rows, Placement::head_rows) if it runs one of the head's shards.
  f.activation_bytes = f.logits_bytes = 0;
  for (int d = 0; d < pl.devices; ++d) {
    size_t sets = 0;
    for (int64_t b = 1; b <= pl.head; ++b) sets += pl.holds_input(d, b);
    if (pl.input_ring) sets = 2;
    uint64_t bytes = 2 * round_up(tokens * 8, 256) + sets * M * act + M * act;
    if (pl.runs_kept_layer(d)) bytes += 2 * round_up(pl.saved_bytes, 256);
    // Layers cut into sub-layer pieces: per micro-batch the residual stream,
    // the MLP's input and the fp32 sum they share (engine_core.h, cut_*).
    if (pl.cut_layers(d) > 0)  // twice the sum's with a shared expert (its output after the groups' sum)
      bytes += M * (2 * act + round_up(mb_tokens * hidden * 4 * (spec.dims.moe.shared_intermediate > 0 ? 2 : 1), 256));
    // With experts, their routing (int64 and fp32) and its gradient (fp32), top_k per token.
    if (pl.cut_layers(d) > 0 && spec.sparse_layer_count() > 0)
      bytes += M * (round_up(mb_tokens * size_t(spec.dims.moe.top_k) * 8, 256) +
                    2 * round_up(mb_tokens * size_t(spec.dims.moe.top_k) * 4, 256));
    // The load-balancing loss's routing statistics and attention mask (engine_core.h, Seat::moe_stats).
    if (spec.router_aux_coef > 0)
      bytes += round_up(M * 2 * size_t(spec.dims.moe.experts) * 4, 256) + round_up(tokens * 4, 256);
    const uint64_t logits = c.keep_logits ? M * round_up(mb_tokens * size_t(pl.head_rows(d)) * cbytes, 256) : 0;
    f.logits_bytes = std::max(f.logits_bytes, logits);
    // (An objective past SFT: each token's coefficient beside its log-sum-exp.)
    const size_t lse = mb_tokens * 4 * (c.objective.sft() ? 1 : 2);
    if (pl.runs_head(d))
      bytes += round_up(2 * M * 8, 256) +
               M * (round_up(3 * mb_tokens * 4, 256) + round_up(lse, 256) +
                    round_up(mb_tokens * hidden * 4, 256)) +
               logits;
    // An objective past SFT: on the device that runs it, the step's per-row
    // inputs and its figures (engine_core.h, Seat::objective_in).
    if (!c.objective.sft() && d == pl.last_head_device())
      bytes += round_up(objective_in_elems(c.batch(), c.seq) * 4, 256) + round_up(kObjectiveStats * 8, 256);
    f.activation_bytes = std::max(f.activation_bytes, bytes);
  }
  f.device_bytes = f.pool_bytes + f.activation_bytes;
}

// The NVMe update staging: 2 slots of master, m, v (and read-back gradients
// with clipping), and of a compute copy where some live on NVMe.
uint64_t nvme_staging_bytes(const EngineConfig& c, const Placement& pl) {
  return 2 * ((c.gated_updates() ? 4 : 3) * pl.nvme_slot_bytes + pl.nvme_compute_slot_bytes);
}

// The pinned arena: from the front what the device copies (the store's
// compute copy and gradient staging, batch staging, the tied gradient, the
// loss figures, host checkpoints, kept activations, the gradient ring, the
// load staging of compute copies read from NVMe), from the back what only
// the host touches (the store's optimizer state, the NVMe update staging).
void count_host(const ModelSpec& spec, const EngineConfig& c, Placement& pl) {
  EngineFootprint& f = pl.footprint;
  const size_t M = size_t(c.accumulation), tokens = size_t(c.batch() * c.seq);
  const size_t emb_elems = pl.layouts[0].total_elems();
  f.shared_host_bytes = c.shared_compute_file.empty() ? 0 : ParamStore::compute_bytes_needed(pl.store_blocks, pl.store);
  f.optimizer_host_bytes = ParamStore::state_bytes_needed(pl.store_blocks, pl.store);
  f.state_host_bytes = ParamStore::bytes_needed(pl.store_blocks, pl.store) - f.shared_host_bytes +
                       (spec.tie_embeddings ? round_up(emb_elems * 4, kHostAlign) : 0) + nvme_staging_bytes(c, pl) +
                       kComputeLoadSlots * pl.compute_load_slot_bytes + uint64_t(c.grad_ring) * pl.ring_slot_bytes;
  // The arena: that, the batch, the loss figures (and alignment slack), host checkpoints.
  f.host_bytes = f.state_host_bytes + 2 * round_up(tokens * 8, kHostAlign) + round_up(2 * M * 8, kHostAlign) +
                 8 * kHostAlign;
  if (spec.router_aux_coef > 0) f.host_bytes += round_up(tokens * 4, kHostAlign);  // the attention mask
  if (!c.objective.sft())  // an objective's per-row inputs and figures
    f.host_bytes += round_up(objective_in_elems(c.batch(), c.seq) * 4, kHostAlign) +
                    round_up(kObjectiveStats * 8, kHostAlign);
  f.checkpoint_host_bytes = c.checkpoints_on_host ? uint64_t(pl.head) * M * round_up(pl.act_bytes, kHostAlign) : 0;
  f.host_bytes += f.checkpoint_host_bytes;
  // A pool's hand-off buffers, per micro-batch: a block's input or output
  // gradient; with the head spread, its per-token state (3 fp32 per token),
  // its log-sum-exp and its hidden gradient (fp32) too (EngineCore::Hand).
  if (pl.devices > 1) f.hand_off_bytes = M * round_up(pl.hand_block_bytes, kHostAlign);
  if (pl.head_spread()) {
    const size_t mb_tokens = size_t(c.micro_batch * c.seq);
    const size_t lse = mb_tokens * 4 * (c.objective.sft() ? 1 : 2);  // with an objective's coefficients
    f.hand_off_bytes += M * (round_up(3 * mb_tokens * 4, kHostAlign) + round_up(lse, kHostAlign) +
                             round_up(mb_tokens * size_t(spec.dims.hidden) * 4, kHostAlign));
  }
  f.host_bytes += f.hand_off_bytes;
  if (f.saved_layers > 0) {
    f.saved_bytes_per_layer = M * round_up(pl.saved_bytes, kHostAlign);
    f.saved_host_bytes = uint64_t(f.saved_layers) * f.saved_bytes_per_layer;
    f.host_bytes += f.saved_host_bytes;
  }
  f.registered_host_bytes = f.host_bytes - f.optimizer_host_bytes - nvme_staging_bytes(c, pl) + f.shared_host_bytes;
}

}  // namespace

void check_config(const ModelSpec& spec, const EngineConfig& c) {
  STRIDER_CHECK(c.seq > 0 && c.micro_batch > 0 && c.accumulation > 0,
                "seq {}, micro_batch {} and accumulation {} must all be > 0", c.seq, c.micro_batch, c.accumulation);
  STRIDER_CHECK(c.window >= 2, "the window must hold at least 2 cache units (K = {})", c.window);
  STRIDER_CHECK(c.seq <= spec.max_position, "seq {} exceeds the model's max_position_embeddings {}", c.seq,
                spec.max_position);
  STRIDER_CHECK(c.compute.dtype == at::kFloat || c.compute.dtype == at::kBFloat16 || c.compute.dtype == at::kHalf,
                "compute dtype must be bf16, fp16 or fp32");
  STRIDER_CHECK(c.clip_norm >= 0, "clip_norm {} must be >= 0 (0 turns clipping off)", c.clip_norm);
  check_settings(c);  // the rules between settings that need no model (engine/config/engine_config_json.h)
  STRIDER_CHECK(c.base_format == BaseFormat::kCompute || spec.lora.enabled(),
                "base_format {}: only a frozen LoRA base is quantized; the model has no adapters",
                base_format_name(c.base_format));
  STRIDER_CHECK(c.expert_pieces == 0 || spec.sparse_layer_count() > 0,
                "expert_pieces {}: {} has no mixture-of-experts layers to cut; leave expert_pieces 0", c.expert_pieces,
                spec.arch_name);
  // Sub-layer pieces: the layer's own checks are mlp_slice_ranges' (place() runs it).
  // grad_ring and the state shard: place() checks them (it indexes by them).
  STRIDER_CHECK(c.shared_compute_file.empty() || c.state_shards > 1,
                "shared_compute_file {}: a shared compute copy is for the ranks of a sharded state (state_shards > 1)",
                c.shared_compute_file);
}

namespace {

// What place() makes of a model's cut that no window, batch or tier choice
// changes, and the memo that keeps it (PlacementMemo).
struct Cut {
  std::vector<ParamLayout> layouts;         // per block
  std::shared_ptr<const Sharding> sharding;
  std::vector<size_t> piece_elems;          // per piece (Piece::elems walks every range)
};
struct CutKey {
  ModelSpec spec;
  int64_t vocab_chunk, shard_rows, align;
  std::string layer_pieces;
  int64_t devices, expert_pieces, mlp_pieces;
  bool quantize;
  bool operator==(const CutKey&) const = default;
};
// Each piece's owned elements, the ranks' slice bounds and its runs, for one
// rank of one cut.
struct Owned {
  std::vector<PiecePlace> pieces;
};
struct OwnedKey {
  std::shared_ptr<const Sharding> sharding;  // held, so that the pointer names one cut
  int64_t state_shards, state_shard, slice_align;
  bool all_decay, q8;
  bool operator==(const OwnedKey&) const = default;
};

}  // namespace

// The last cut only: a plan's calls come in runs of one cut, and a large
// model's layers cut into MLP slices are gigabytes of ranges (keeping two
// took a Llama-3.1-405B plan from 10.8 to 16.7 GB at its peak).
struct PlacementMemo::State {
  std::optional<std::pair<CutKey, std::shared_ptr<const Cut>>> cut;
  std::optional<std::pair<OwnedKey, std::shared_ptr<const Owned>>> owned;
};

namespace {

thread_local PlacementMemo::State* active_memo = nullptr;

template <class Key, class Value, class Make>
std::shared_ptr<const Value> remembered(std::optional<std::pair<Key, std::shared_ptr<const Value>>>* memo, Key key,
                                        Make make) {
  if (memo && *memo && (*memo)->first == key) return (*memo)->second;
  std::shared_ptr<const Value> v = make();
  if (memo) memo->emplace(std::move(key), v);
  return v;
}

std::shared_ptr<const Cut> cut_for(const ModelSpec& spec, const EngineConfig& c) {
  const bool quantize = c.base_format != BaseFormat::kCompute && spec.lora.enabled();
  CutKey key{spec,         c.compute.vocab_chunk, c.vocab_shard_rows, c.shard_align(), c.layer_pieces,
             c.devices,    c.expert_pieces,       c.mlp_pieces,       quantize};
  return remembered(active_memo ? &active_memo->cut : nullptr, std::move(key), [&] {
    auto cut = std::make_shared<Cut>();
    for (int64_t b = 0; b < spec.num_blocks(); ++b) cut->layouts.push_back(spec.layout(b));
    Sharding sh = make_sharding(spec, c.compute.vocab_chunk, c.vocab_shard_rows, c.shard_align(), c.layer_pieces,
                                c.devices, c.expert_pieces, c.mlp_pieces);
    // A quantized base: each decoder layer's frozen piece before its trained
    // stretch (host/base_format.h).
    if (quantize)
      for (Piece& pc : sh.pieces)
        pc.quantized = pc.frozen && spec.block(pc.block).kind == BlockKind::kLayer && pc.ranges.size() == 1 &&
                       pc.ranges[0].begin == 0 &&
                       pc.ranges[0].end == cut->layouts[size_t(pc.block)].trainable_span().first;
    for (const Piece& pc : sh.pieces) cut->piece_elems.push_back(pc.elems());
    cut->sharding = std::make_shared<const Sharding>(std::move(sh));
    return std::shared_ptr<const Cut>(std::move(cut));
  });
}

std::shared_ptr<const Owned> owned_for(const ModelSpec& spec, const EngineConfig& c, const Cut& cut,
                                       const std::vector<std::vector<size_t>>& block_slices) {
  const bool all_decay = c.decay_norms_and_biases || c.adam.weight_decay == 0;
  const bool q8 = c.optimizer_state == StateFormat::kQ8;
  OwnedKey key{cut.sharding, c.state_shards, c.state_shard, c.slice_align(), all_decay, q8};
  return remembered(active_memo ? &active_memo->owned : nullptr, std::move(key), [&] {
    const Sharding& sh = *cut.sharding;
    const size_t rank = size_t(c.state_shard);
    auto out = std::make_shared<Owned>();
    for (int64_t p = 0; p < int64_t(sh.pieces.size()); ++p) {
      const Piece& pc = sh.pieces[size_t(p)];
      const std::vector<size_t>& bs = block_slices[size_t(pc.block)];
      PiecePlace& at = out->pieces.emplace_back();
      at.owned = {pc.before(bs[rank]), pc.before(bs[rank + 1])};
      for (size_t x : bs) at.slices.push_back(pc.before(x));
      auto runs = std::make_shared<PiecePlace::Runs>();
      runs->owned = pc.runs(at.owned.begin, at.owned.end);
      for (const PieceRun& r : runs->owned) {
        const size_t from = r.at - at.owned.begin;
        if (all_decay) {
          runs->update.push_back({from, r.block, r.n, true});
          continue;
        }
        for (const DecayRun& d : cut.layouts[size_t(pc.block)].decay_runs(r.block, r.block + r.n))
          runs->update.push_back({from + (d.begin - r.block), d.begin, d.end - d.begin, d.decay});
      }
      for (const UpdateRun& r : runs->update)  // tensors start on whole groups, and so do q8 pieces
        STRIDER_CHECK(!q8 || (r.at % kQ8GroupElems == 0 && r.block % kQ8GroupElems == 0),
                      "{}: its update run at {} (block element {}) does not start a q8 group", sh.name(spec, p), r.at,
                      r.block);
      at.run_lists = std::move(runs);
    }
    return std::shared_ptr<const Owned>(std::move(out));
  });
}

}  // namespace

PlacementMemo::PlacementMemo() {
  if (active_memo) return;
  own_ = std::make_unique<State>();
  active_memo = own_.get();
}

PlacementMemo::~PlacementMemo() {
  if (own_) active_memo = nullptr;
}

Placement place(const ModelSpec& spec, const EngineConfig& c) {
  // What placement itself needs of the config; the rest is check_config's
  // (the Engine's): a plan sizes trial configs that no engine will run.
  STRIDER_CHECK(c.grad_ring >= 1, "grad_ring {} must be >= 1 (gradient staging slots of the NVMe-tier blocks)",
                c.grad_ring);
  STRIDER_CHECK(c.state_shards >= 1 && c.state_shard >= 0 && c.state_shard < c.state_shards,
                "state shard {} of {}: a rank's slice of the sharded state is 0..shards-1 of shards >= 1",
                c.state_shard, c.state_shards);
  STRIDER_CHECK(c.devices >= 1 && c.devices <= 64, "devices {}: a pool has 1 to 64 devices", c.devices);
  Placement pl;
  pl.micro_batch = c.micro_batch;
  pl.seq = c.seq;
  pl.micro_batches = c.accumulation;
  pl.blocks = spec.num_blocks();
  pl.head = pl.blocks - 1;
  pl.devices = c.devices;
  pl.input_ring = c.checkpoints_on_host;
  pl.compute_bytes = c.compute.dtype == at::kFloat ? 4 : 2;
  pl.grad_bytes = c.grad_dtype() == at::kFloat ? 4 : 2;
  const std::shared_ptr<const Cut> cut = cut_for(spec, c);
  pl.layouts = cut->layouts;
  pl.sharding = cut->sharding;
  const Sharding& sh = pl.shards();
  const int64_t P = int64_t(sh.pieces.size());
  const bool clip = c.gated_updates();

  pl.saved_index.assign(size_t(pl.blocks), -1);
  int64_t kept = 0;
  for (int64_t b : c.saved_blocks) {
    STRIDER_CHECK(b >= 1 && b < pl.head, "saved_blocks: block {} is not a decoder layer (blocks 1..{} are)", b,
                  pl.head - 1);
    STRIDER_CHECK(pl.saved_index[size_t(b)] < 0, "saved_blocks: block {} listed twice", b);
    pl.saved_index[size_t(b)] = kept++;
  }
  pl.nvme_block.assign(size_t(pl.blocks), false);
  for (int64_t b : c.nvme_blocks) {
    STRIDER_CHECK(b >= 0 && b < pl.blocks, "nvme block {} out of range (the model has {} blocks)", b, pl.blocks);
    STRIDER_CHECK(!pl.nvme_block[size_t(b)], "nvme block {} listed twice", b);
    pl.nvme_block[size_t(b)] = true;
  }
  pl.nvme_compute.assign(size_t(pl.blocks), false);
  for (int64_t b : c.nvme_compute_blocks) {
    STRIDER_CHECK(b >= 1 && b < pl.head, "nvme_compute_blocks: block {} is not a decoder layer (blocks 1..{} are)", b,
                  pl.head - 1);
    STRIDER_CHECK(!pl.nvme_compute[size_t(b)], "nvme_compute_blocks: block {} listed twice", b);
    STRIDER_CHECK(pl.nvme_block[size_t(b)],
                  "nvme_compute_blocks: block {}'s optimizer state is in RAM; a compute copy goes to NVMe only "
                  "with its block's state (list it in nvme_blocks too)", b);
    pl.nvme_compute[size_t(b)] = true;
  }
  STRIDER_CHECK(c.nvme_compute_blocks.empty() || c.state_shards == 1,
                "nvme_compute_blocks with state_shards {}: a compute copy on NVMe is not yet kept with sharded state; "
                "leave nvme_compute_blocks empty", c.state_shards);
  STRIDER_CHECK(c.nvme_compute_blocks.empty() || !spec.lora.enabled(),
                "nvme_compute_blocks with lora: a frozen base's compute copy is not yet read from NVMe; leave "
                "nvme_compute_blocks empty");

  // The ranks' slices of every block's trained stretch (all of it unless
  // some tensors are frozen; none of a frozen block), and this rank's store
  // blocks, whose gradient staging holds their trained pieces back to back.
  const size_t rank = size_t(c.state_shard);
  for (int64_t b = 0; b < pl.blocks; ++b) {
    const auto [tb, te] = pl.layouts[size_t(b)].trainable_span();
    pl.block_slices.push_back(rank_slices(te - tb, c.state_shards, size_t(c.slice_align())));
    for (size_t& x : pl.block_slices.back()) x += tb;
    const bool nvme = pl.nvme_block[size_t(b)];
    size_t trained = 0;
    for (int64_t p = sh.first_of(b); p < sh.end_of(b); ++p)
      if (!sh.pieces[size_t(p)].frozen) trained += cut->piece_elems[size_t(p)];
    pl.store_blocks.push_back({pl.layouts[size_t(b)], !nvme, !grads_in_ring(nvme, c) && trained > 0,
                               pl.block_slices.back()[rank], pl.block_slices.back()[rank + 1], trained});
    pl.store_blocks.back().compute_on_host = !pl.nvme_compute[size_t(b)];
    for (int64_t p = sh.first_of(b); p < sh.end_of(b); ++p)
      if (sh.pieces[size_t(p)].quantized) {
        pl.store_blocks.back().base = base_layout(pl.layouts[size_t(b)], sh.pieces[size_t(p)].ranges[0].end,
                                                  c.base_format, pl.compute_bytes == 4 ? DType::kF32 : DType::kBF16);
        pl.base_staging_bytes = std::max(pl.base_staging_bytes, pl.store_blocks.back().base.bytes);
      }
  }
  pl.store = {.grad_dtype = pl.grad_bytes == 4 ? DType::kF32 : DType::kBF16,
              .compute_dtype = host_dtype(c.compute.dtype),
              .format = c.optimizer_state,
              .keep_reference = c.keep_reference};

  // Per piece: its slice, its update runs, its NVMe extents (of its slice, in the format's bytes).
  std::vector<size_t> staged(size_t(pl.blocks), 0);  // per block: its pieces' gradients so far, back to back
  std::vector<size_t> load_staged(size_t(pl.blocks), 0);  // per block: its pieces' compute copies so far (NVMe)
  const std::shared_ptr<const Owned> owned = owned_for(spec, c, *cut, pl.block_slices);
  for (int64_t p = 0; p < P; ++p) {
    const Piece& pc = sh.pieces[size_t(p)];
    const size_t elems = cut->piece_elems[size_t(p)];
    PiecePlace at = owned->pieces[size_t(p)];
    at.staging_at = staged[size_t(pc.block)];
    if (!pc.frozen) staged[size_t(pc.block)] += elems;
    const size_t n = at.owned.elems();
    if (pl.nvme_block[size_t(pc.block)] && n > 0) {
      at.on_nvme = true;
      for (ExtentKind k : {ExtentKind::kMaster, ExtentKind::kAdamM, ExtentKind::kAdamV}) {
        const size_t bytes = state_kind_bytes(c.optimizer_state, state_kind(k), n);
        pl.extents.push_back({p, k, bytes});
        pl.nvme_slot_bytes = std::max(pl.nvme_slot_bytes, round_up(bytes, kHostAlign));
        pl.footprint.nvme_bytes += round_up(bytes, kHostAlign);
      }
      if (clip) {  // spilled gradients
        pl.extents.push_back({p, ExtentKind::kGrad, n * pl.grad_bytes});
        pl.nvme_slot_bytes = std::max(pl.nvme_slot_bytes, round_up(n * pl.grad_bytes, kHostAlign));
        pl.footprint.nvme_bytes += round_up(n * pl.grad_bytes, kHostAlign);
      }
    }
    if (pl.nvme_compute[size_t(pc.block)]) {
      // Its compute copy, in the piece's coordinates (the q8 master's high
      // half: the format's own bytes), at its place in its layer's load
      // staging (a sub-layer piece, a visit of its own: at its start).
      const size_t bytes = elems * pl.compute_bytes;
      at.compute_on_nvme = true;
      at.compute_staging_at = pc.sub_layer ? 0 : load_staged[size_t(pc.block)];
      if (!pc.sub_layer) load_staged[size_t(pc.block)] += round_up(bytes, kHostAlign);
      pl.compute_load_slot_bytes = std::max(pl.compute_load_slot_bytes, at.compute_staging_at + round_up(bytes, kHostAlign));
      pl.extents.push_back({p, ExtentKind::kCompute, bytes});
      pl.nvme_compute_slot_bytes = std::max(pl.nvme_compute_slot_bytes, round_up(bytes, kHostAlign));
      pl.footprint.nvme_bytes += round_up(bytes, kHostAlign);
    }
    pl.pieces.push_back(std::move(at));
  }

  // Gradient ring slots go round in the order gradients land.
  pl.landing = landing_order(spec, sh, pl.head);
  const int64_t trained = std::count_if(sh.pieces.begin(), sh.pieces.end(), [](const Piece& x) { return !x.frozen; });
  STRIDER_CHECK(trained > 0, "{}: every tensor is frozen; there is nothing to train", spec.arch_name);
  STRIDER_CHECK(int64_t(pl.landing.size()) == trained, "internal: {} pieces land gradients, {} are trained",
                pl.landing.size(), trained);
  int next = 0;
  for (int64_t p : pl.landing) {
    const Piece& pc = sh.pieces[size_t(p)];
    if (!grads_in_ring(pl.nvme_block[size_t(pc.block)], c)) continue;
    PiecePlace& at = pl.pieces[size_t(p)];
    at.ring_slot = int(next++ % c.grad_ring);
    at.spills_grads = clip;
    pl.ring_slot_bytes = std::max(pl.ring_slot_bytes, round_up(cut->piece_elems[size_t(p)] * pl.grad_bytes, kHostAlign));
  }

  pl.act_bytes = size_t(c.micro_batch * c.seq * spec.dims.hidden) * pl.compute_bytes;
  pl.hand_block_bytes = pl.act_bytes;
  if (spec.router_aux_coef > 0) {
    pl.hand_stats_at = round_up(pl.act_bytes, 64);
    pl.hand_stats_bytes = 2 * size_t(spec.dims.moe.experts) * 4;
    pl.hand_block_bytes = pl.hand_stats_at + pl.hand_stats_bytes;
  }
  pl.saved_bytes =
      size_t(layer_saved_elems(spec.saved_dims(), c.micro_batch * c.seq, int64_t(pl.compute_bytes))) * pl.compute_bytes;

  EngineFootprint& f = pl.footprint;
  f.unit_elems = sh.unit_elems;
  f.unit_grad_elems = sh.unit_grad_elems;
  f.vocab_shards = sh.shards;
  f.shard_rows = sh.rows;
  f.head_chunk = sh.chunk;
  f.unit_bytes = CacheUnitPool::unit_bytes_for(f.unit_elems, pl.compute_bytes, sh.unit_grad_elems, pl.base_staging_bytes);
  f.pool_bytes = f.unit_bytes * uint64_t(c.window);
  f.saved_layers = kept;
  count_device(spec, c, pl);
  count_host(spec, c, pl);
  return pl;
}

uint64_t shared_compute_bytes(const ModelSpec& spec, at::ScalarType dtype) {
  EngineConfig c;
  c.compute.dtype = dtype;
  c.state_shards = 2;  // any sharded world: the compute copy is whole whatever it is
  c.shared_compute_file = "(shared memory)";
  return footprint(spec, c).shared_host_bytes;
}

}  // namespace strider
