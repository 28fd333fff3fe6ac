#include "engine/engine.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>

#include "engine/collectives.h"
#include "gpu/unit_tensors.h"
#include "host/bf16.h"
#include "host/error.h"

namespace strider {
namespace {

constexpr size_t kAlign = 4096;  // O_DIRECT needs 4 KiB for NVMe staging; fine for all
size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

// A SimDevice has no memory to compute on; the tensors the engine makes over
// its (fake) buffers are never touched, so they may as well say CPU.
at::Device engine_aten_device(const Device& d) { return d.kind() == DeviceKind::kSim ? at::kCPU : aten_device(d); }

// Whose gradients land in the shared ring rather than a buffer of their own:
// an NVMe-tier block's always (it keeps nothing but its compute copy in RAM),
// and without clipping every block's, since each block's update consumes its
// gradients as they land. With clipping a RAM-tier block keeps its own buffer:
// every gradient must outlive the global norm.
bool grads_in_ring(bool on_nvme, const EngineConfig& c) { return on_nvme || c.clip_norm <= 0; }

// Piece p's elements whose state rank `c.state_shard` keeps (block coordinates).
std::pair<size_t, size_t> owned_of(const Piece& p, const std::vector<size_t>& block_slices, const EngineConfig& c) {
  const size_t r = size_t(c.state_shard);
  return {std::clamp(block_slices[r], p.begin, p.end), std::clamp(block_slices[r + 1], p.begin, p.end)};
}
}  // namespace

Engine::Engine(ModelSpec spec, EngineConfig config, std::unique_ptr<Device> device)
    : spec_(std::move(spec)), config_(std::move(config)), device_(std::move(device)),
      sim_(device_->kind() == DeviceKind::kSim ? static_cast<SimDevice*>(device_.get()) : nullptr),
      aten_device_(engine_aten_device(*device_)) {
  check_config();
  dist_ = solo_collectives();
  dist_update_ = solo_collectives();
  num_blocks_ = spec_.num_blocks();
  head_ = num_blocks_ - 1;
  for (int64_t b = 0; b < num_blocks_; ++b) layouts_.push_back(spec_.layout(b));
  saved_index_.assign(size_t(num_blocks_), -1);
  int64_t kept = 0;
  for (int64_t b : config_.saved_blocks) {
    STRIDER_CHECK(b >= 1 && b < head_, "saved_blocks: block {} is not a decoder layer (blocks 1..{} are)", b,
                  head_ - 1);
    STRIDER_CHECK(saved_index_[size_t(b)] < 0, "saved_blocks: block {} listed twice", b);
    saved_index_[size_t(b)] = kept++;
  }
  compute_bytes_ = config_.compute.dtype == at::kFloat ? 4 : 2;
  grad_bytes_ = config_.grad_dtype() == at::kFloat ? 4 : 2;
  const int64_t M = config_.accumulation;

  shards_ = make_sharding(spec_, config_.compute.vocab_chunk, config_.vocab_shard_rows, config_.shard_align());
  const int64_t P = num_pieces();
  for (int64_t b = 0; b < num_blocks_; ++b)
    block_slices_.push_back(rank_slices(layouts_[b].total_elems(), config_.state_shards, size_t(config_.slice_align())));
  for (int64_t p = 0; p < P; ++p) {
    std::vector<size_t> cut;
    for (size_t x : block_slices_[size_t(piece(p).block)]) cut.push_back(std::clamp(x, piece(p).begin, piece(p).end) - piece(p).begin);
    piece_slices_.push_back(std::move(cut));
  }
  slice_bytes_.resize(size_t(config_.state_shards) + 1);

  // Which blocks keep their fp32 state on NVMe: every piece of them, each in
  // extents of its own.
  std::vector<bool> nvme_block(size_t(num_blocks_), false);
  for (int64_t b : config_.nvme_blocks) {
    STRIDER_CHECK(b >= 0 && b < num_blocks_, "nvme block {} out of range (the model has {} blocks)", b, num_blocks_);
    STRIDER_CHECK(!nvme_block[size_t(b)], "nvme block {} listed twice", b);
    nvme_block[size_t(b)] = true;
  }
  nvme_block_ = nvme_block;
  nvme_piece_.assign(size_t(P), false);
  std::vector<ExtentSpec> extents;
  size_t max_nvme_state = 0;
  for (int64_t p = 0; p < P; ++p) {
    // Extents of the piece's slice whose state this rank keeps (all of it unsharded).
    const size_t n = owned(p).elems();
    if (!nvme_block[size_t(piece(p).block)] || n == 0) continue;
    nvme_piece_[size_t(p)] = true;
    for (ExtentKind k : {ExtentKind::kMaster, ExtentKind::kAdamM, ExtentKind::kAdamV}) {
      const size_t bytes = state_kind_bytes(config_.optimizer_state, state_kind(k), n);
      extents.push_back({p, k, bytes});
      max_nvme_state = std::max(max_nvme_state, round_up(bytes, kAlign));
    }
    if (config_.clip_norm > 0) {
      extents.push_back({p, ExtentKind::kGrad, n * grad_bytes_});
      max_nvme_state = std::max(max_nvme_state, round_up(n * grad_bytes_, kAlign));
    }
  }
  // Visits of one step: forward (embedding shards, layers), the head's shards
  // (pass 1 over all, then pass 2 over all; both in one visit when there is
  // one), backward (layers, then embedding shards, each in reverse order).
  const Sharding& sh = shards_;
  for (int64_t p = 0; p < sh.first_of(head_); ++p) visits_.push_back({Visit::kForward, p});
  std::vector<Visit> head_lse, head_grad;
  for (int64_t k = 0; k < sh.shards; ++k) {
    head_lse.push_back({Visit::kHead, 0, k, true, false});
    head_grad.push_back({Visit::kHead, 0, k, sh.shards == 1, true});
  }
  eval_visits_ = visits_;
  eval_visits_.insert(eval_visits_.end(), head_lse.begin(), head_lse.end());
  if (sh.shards > 1) visits_.insert(visits_.end(), head_lse.begin(), head_lse.end());
  visits_.insert(visits_.end(), head_grad.begin(), head_grad.end());
  for (int64_t p = sh.first_of(head_) - 1; p >= 0; --p) visits_.push_back({Visit::kBackward, p});
  // Where gradients land, in order: the LM-head shards (untied; the head's
  // norm just before the last one, which computes it), then each backward
  // visit's piece.
  for (const Visit& v : visits_) {
    if (v.kind == Visit::kBackward) landing_.push_back(v.piece);
    if (v.kind != Visit::kHead || !v.grad) continue;
    if (v.shard + 1 == sh.shards) landing_.push_back(sh.norm_piece);
    if (!spec_.tie_embeddings) landing_.push_back(sh.lm_piece[size_t(v.shard)]);
  }
  STRIDER_CHECK(int64_t(landing_.size()) == P, "internal: {} pieces land gradients, {} exist", landing_.size(), P);
  // Gradient ring slots go round in the order gradients land.
  ring_slot_.assign(size_t(P), -1);
  size_t ring_slot_bytes = 0;
  int rank = 0;
  for (int64_t p : landing_)
    if (grads_in_ring(nvme_block[size_t(piece(p).block)], config_)) {
      ring_slot_[size_t(p)] = int(rank++ % config_.grad_ring);
      ring_slot_bytes = std::max(ring_slot_bytes, round_up(piece(p).elems() * grad_bytes_, kAlign));
    }

  // Pinned host memory: the store, batch staging, tied-gradient staging,
  // host checkpoints and NVMe staging, all in one arena mapped now.
  std::vector<BlockSpec> specs;
  for (int64_t b = 0; b < num_blocks_; ++b) {
    const bool ring = grads_in_ring(nvme_block[size_t(b)], config_);
    const int r = config_.state_shard;
    specs.push_back({layouts_[b], !nvme_block[size_t(b)], !ring, block_slices_[size_t(b)][size_t(r)],
                     block_slices_[size_t(b)][size_t(r) + 1]});
  }
  StoreOptions so{.grad_dtype = grad_bytes_ == 4 ? DType::kF32 : DType::kBF16,
                  .compute_dtype = compute_bytes_ == 4 ? DType::kF32 : DType::kBF16,
                  .format = config_.optimizer_state,
                  .zero = !simulated()};
  const size_t tokens = size_t(config_.batch() * config_.seq);
  const size_t act_bytes = size_t(config_.micro_batch * config_.seq * spec_.dims.hidden) * compute_bytes_;
  const size_t emb_elems = layouts_[0].total_elems();
  const EngineFootprint fp = footprint(spec_, config_);
  // (A simulated engine reserves the shared compute copy's addresses in its own arena.)
  arena_ = std::make_unique<PinnedArena>(
      fp.host_bytes + (simulated() ? fp.shared_host_bytes : 0), ArenaOptions{.lock = config_.lock, .name = "strider host arena", .reserve_only = simulated()});
  if (auto reg = device_->host_registrar()) arena_->attach(reg);
  if (!config_.shared_compute_file.empty() && !simulated()) {
    shared_arena_ = std::make_unique<PinnedArena>(
        fp.shared_host_bytes, ArenaOptions{.lock = config_.lock, .name = "strider shared compute copy",
                                           .shared_file = config_.shared_compute_file});
    if (auto reg = device_->host_registrar()) shared_arena_->attach(reg);  // each process registers it
  }
  store_ = std::make_unique<ParamStore>(specs, so, *arena_, shared_arena_.get());
  ids_host_ = arena_->carve_as<int64_t>(tokens, "batch ids", kAlign);
  labels_host_ = arena_->carve_as<int64_t>(tokens, "batch labels", kAlign);
  if (spec_.tie_embeddings) tied_grad_host_ = arena_->carve_as<float>(emb_elems, "tied embedding gradient", kAlign);
  head_stats_host_ = arena_->carve_as<double>(size_t(2 * M), "head loss figures", kAlign);
  if (config_.checkpoints_on_host)
    for (int64_t i = 0; i < head_ * M; ++i) host_ckpt_.push_back(arena_->carve(act_bytes, kAlign, "host checkpoint"));
  saved_bytes_ = size_t(layer_saved_elems(spec_.dims, config_.micro_batch * config_.seq)) * compute_bytes_;
  for (int64_t i = 0; i < kept * M; ++i) saved_host_.push_back(arena_->carve(saved_bytes_, kAlign, "kept activations"));
  if (ring_slot_bytes > 0)
    for (int64_t r = 0; r < config_.grad_ring; ++r)
      grad_ring_.push_back(arena_->carve(ring_slot_bytes, kAlign, "gradient ring slot"));
  ring_uses_.assign(grad_ring_.size(), 0);
  ring_released_.assign(grad_ring_.size(), 0);

  if (!extents.empty() && !simulated()) {
    STRIDER_CHECK(!config_.nvme_dir.empty(), "{} blocks keep their state on NVMe but no NVMe directory is set",
                  extents.size() / 3);
    NvmeStoreOptions nopt;
    nopt.backend = config_.nvme_backend;
    nvme_ = std::make_unique<NvmeStore>(std::vector<std::string>{config_.nvme_dir + "/strider-state.bin"},
                                        extents, nopt);
    arena_->attach(nvme_->registrar());
    for (int s = 0; s < 2; ++s)
      nvme_staging_.push_back({arena_->carve(max_nvme_state, kAlign, "nvme staging master"),
                               arena_->carve(max_nvme_state, kAlign, "nvme staging adam m"),
                               arena_->carve(max_nvme_state, kAlign, "nvme staging adam v"),
                               config_.clip_norm > 0 ? arena_->carve(max_nvme_state, kAlign, "nvme staging grads")
                                                     : std::span<std::byte>()});
    // Fresh state: zero master, m and v on the drive, so every extent is valid.
    std::memset(nvme_staging_[0].master.data(), 0, max_nvme_state);
    for (int64_t p = 0; p < P; ++p) {
      if (!on_nvme(p)) continue;
      for (ExtentKind k : {ExtentKind::kMaster, ExtentKind::kAdamM, ExtentKind::kAdamV}) {
        const Extent& e = nvme_->extent(p, k);
        nvme_->wait(nvme_->write(e, nvme_staging_[0].master.first(e.io_bytes)));
      }
    }
  }

  // The device: K units sized for the largest visit.
  pool_ = std::make_unique<CacheUnitPool>(
      *device_, size_t(config_.window), fp.unit_elems,
      CacheUnitPoolOptions{.what = "cache units", .param_elem_bytes = compute_bytes_});
  allocate_activations();
  runner_ = std::make_unique<BlockRunner>(spec_, config_.compute, config_.seq, aten_device_);
  adam_ = std::make_unique<CpuAdam>(CpuAdam::Options{.threads = config_.optimizer_threads});

  for (int64_t p = 0; p < P; ++p) grads_ready_.push_back(device_->make_event());
  grads_recorded_.assign(size_t(P), 0);
  grad_spill_.resize(size_t(P));
  data_ready_ = device_->make_event();
  tied_grad_ready_ = device_->make_event();
  head_stats_ready_ = device_->make_event();
  updated_.assign(size_t(P), 0);

  if (simulated()) {
    // No updater thread: step() prices the updates on the host lanes.
    for (int64_t p = 0; p < P; ++p) sim_update_done_.push_back(device_->make_event());
    for (size_t r = 0; r < grad_ring_.size(); ++r) sim_ring_free_.push_back(device_->make_event());
    return;
  }
  // Align the device's span clock with ours: one empty op, timed from both sides.
  device_->launch(StreamId::kCompute, {"clock sync"}, [](const LaunchContext&) {});
  device_->synchronize();
  std::vector<OpSpan> sync_spans;
  device_->drain_spans(sync_spans);
  if (!sync_spans.empty()) device_origin_us_ = Timeline::now_us() - sync_spans.back().end_us;

  updater_ = std::thread([this] { updater_main(); });
}

EngineFootprint Engine::footprint(const ModelSpec& spec, const EngineConfig& c) {
  EngineFootprint f;
  const int64_t blocks = spec.num_blocks(), head = blocks - 1, M = c.accumulation;
  const size_t cbytes = c.compute.dtype == at::kFloat ? 4 : 2, gbytes = c.grad_dtype() == at::kFloat ? 4 : 2;
  const Sharding sh = make_sharding(spec, c.compute.vocab_chunk, c.vocab_shard_rows, c.shard_align());
  std::vector<BlockSpec> specs;
  std::vector<bool> nvme(size_t(blocks), false);
  for (int64_t b : c.nvme_blocks)
    if (b >= 0 && b < blocks) nvme[size_t(b)] = true;
  const bool clip = c.clip_norm > 0;
  size_t max_nvme_state = 0, ring_slot_bytes = 0;
  std::vector<std::vector<size_t>> slices;
  for (int64_t b = 0; b < blocks; ++b) {
    const ParamLayout l = spec.layout(b);
    slices.push_back(rank_slices(l.total_elems(), c.state_shards, size_t(c.slice_align())));
    specs.push_back({l, !nvme[size_t(b)], !grads_in_ring(nvme[size_t(b)], c), slices.back()[size_t(c.state_shard)],
                     slices.back()[size_t(c.state_shard) + 1]});
  }
  for (const Piece& p : sh.pieces) {
    const size_t grad = round_up(p.elems() * gbytes, kAlign);
    if (grads_in_ring(nvme[size_t(p.block)], c)) ring_slot_bytes = std::max(ring_slot_bytes, grad);
    const auto [lo, hi] = owned_of(p, slices[size_t(p.block)], c);
    if (nvme[size_t(p.block)] && hi > lo) {
      for (StateKind k : {StateKind::kMaster, StateKind::kAdamM, StateKind::kAdamV}) {
        const size_t bytes = round_up(state_kind_bytes(c.optimizer_state, k, hi - lo), kAlign);
        max_nvme_state = std::max(max_nvme_state, bytes);
        f.nvme_bytes += bytes;  // master, m, v
      }
      if (clip) {  // spilled gradients
        const size_t spilled = round_up((hi - lo) * gbytes, kAlign);
        max_nvme_state = std::max(max_nvme_state, spilled);
        f.nvme_bytes += spilled;
      }
    }
  }
  const size_t emb_elems = specs[0].layout.total_elems();
  f.unit_elems = sh.unit_elems;
  f.vocab_shards = sh.shards;
  f.shard_rows = sh.rows;
  f.unit_bytes = CacheUnitPool::unit_bytes_for(f.unit_elems, cbytes);
  f.pool_bytes = f.unit_bytes * uint64_t(c.window);
  // Must match allocate_activations(): the batch, checkpoints or ring, output
  // gradients, the streamed head's per-token state and hidden gradient.
  const size_t tokens = size_t(c.batch() * c.seq), mb_tokens = size_t(c.micro_batch * c.seq);
  const size_t hidden = size_t(spec.dims.hidden);
  const size_t act = round_up(mb_tokens * hidden * cbytes, 256);
  const int64_t sets = c.checkpoints_on_host ? 2 : head;
  f.activation_bytes = 2 * round_up(tokens * 8, 256) + round_up(size_t(2 * M) * 8, 256) + uint64_t(sets * M) * act +
                       uint64_t(M) * act +
                       uint64_t(M) * (4 * round_up(mb_tokens * 4, 256) + round_up(mb_tokens * hidden * 4, 256));
  f.device_bytes = f.pool_bytes + f.activation_bytes;
  // Must match the constructor's carving.
  StoreOptions so{.grad_dtype = gbytes == 4 ? DType::kF32 : DType::kBF16,
                  .compute_dtype = cbytes == 4 ? DType::kF32 : DType::kBF16,
                  .format = c.optimizer_state};
  // The training state: the store, the tied embedding's gradient, the NVMe
  // staging (2 slots of master, m, v, and read-back gradients with clipping)
  // and the gradient ring.
  f.shared_host_bytes = c.shared_compute_file.empty() ? 0 : ParamStore::compute_bytes_needed(specs, so);
  f.optimizer_host_bytes = ParamStore::state_bytes_needed(specs, so);
  f.state_host_bytes = ParamStore::bytes_needed(specs, so) - f.shared_host_bytes +
                       (spec.tie_embeddings ? round_up(emb_elems * 4, kAlign) : 0) +
                       2 * (clip ? 4 : 3) * max_nvme_state + uint64_t(c.grad_ring) * ring_slot_bytes;
  // The arena: that, the batch, the loss figures (and alignment slack), host checkpoints.
  f.host_bytes = f.state_host_bytes + 2 * round_up(tokens * 8, kAlign) + round_up(size_t(2 * M) * 8, kAlign) + 8 * kAlign;
  if (c.checkpoints_on_host)
    f.host_bytes += uint64_t(head * M) * round_up(size_t(c.micro_batch * c.seq * spec.dims.hidden) * cbytes, kAlign);
  // Kept activations: a host copy per layer and micro-batch, two device slots.
  f.saved_layers = int64_t(c.saved_blocks.size());
  if (f.saved_layers > 0) {
    const size_t kept = size_t(layer_saved_elems(spec.dims, int64_t(mb_tokens))) * cbytes;
    f.saved_bytes_per_layer = uint64_t(M) * round_up(kept, kAlign);
    f.saved_host_bytes = uint64_t(f.saved_layers) * f.saved_bytes_per_layer;
    f.host_bytes += f.saved_host_bytes;
    f.activation_bytes += 2 * round_up(kept, 256);
    f.device_bytes = f.pool_bytes + f.activation_bytes;
  }
  if (c.keep_logits) {
    f.logits_bytes = uint64_t(M) * round_up(mb_tokens * size_t(spec.dims.vocab) * cbytes, 256);
    f.activation_bytes += f.logits_bytes;
    f.device_bytes = f.pool_bytes + f.activation_bytes;
  }
  return f;
}

Engine::~Engine() {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (updater_.joinable()) updater_.join();
  try {
    device_->synchronize();
  } catch (...) {
    // Destructors never throw; a failed op was reported by the step that saw it.
  }
  for (auto& s : nvme_staging_)
    for (auto& t : s.writes) try { nvme_->wait(t); } catch (...) {}
  for (auto& t : grad_spill_)  // their callbacks touch the timeline and the lock
    if (t.valid()) try { nvme_->wait(t); } catch (...) {}
}

void Engine::check_config() const {
  const EngineConfig& c = config_;
  STRIDER_CHECK(c.seq > 0 && c.micro_batch > 0 && c.accumulation > 0,
                "seq {}, micro_batch {} and accumulation {} must all be > 0", c.seq, c.micro_batch, c.accumulation);
  STRIDER_CHECK(c.window >= 2, "the window must hold at least 2 cache units (K = {})", c.window);
  STRIDER_CHECK(c.seq <= spec_.max_position, "seq {} exceeds the model's max_position_embeddings {}", c.seq,
                spec_.max_position);
  STRIDER_CHECK(c.compute.dtype == at::kFloat || c.compute.dtype == at::kBFloat16,
                "compute dtype must be bf16 or fp32");
  STRIDER_CHECK(c.clip_norm >= 0, "clip_norm {} must be >= 0 (0 turns clipping off)", c.clip_norm);
  STRIDER_CHECK(!state_uses_compute_copy(c.optimizer_state) || c.compute.dtype == at::kBFloat16,
                "the {} optimizer state keeps the master's high half in the bf16 compute copy: it needs the bf16 "
                "compute dtype, not fp32", state_format_name(c.optimizer_state));
  STRIDER_CHECK(c.grad_ring >= 1, "grad_ring {} must be >= 1 (gradient staging slots of the NVMe-tier blocks)",
                c.grad_ring);
  STRIDER_CHECK(c.state_shards >= 1 && c.state_shard >= 0 && c.state_shard < c.state_shards,
                "state shard {} of {}: a rank's slice of the sharded state is 0..shards-1 of shards >= 1",
                c.state_shard, c.state_shards);
  STRIDER_CHECK(c.shared_compute_file.empty() || c.state_shards > 1,
                "shared_compute_file {}: a shared compute copy is for the ranks of a sharded state (state_shards > 1)",
                c.shared_compute_file);
}

void Engine::allocate_activations() {
  const int64_t M = config_.accumulation, mb = config_.micro_batch, S = config_.seq, H = spec_.dims.hidden;
  const auto cdt = config_.compute.dtype;
  auto make = [&](std::vector<int64_t> shape, at::ScalarType dt, const char* what) {
    size_t n = 1;
    for (int64_t d : shape) n *= size_t(d);
    device_buffers_.push_back(device_->allocate(round_up(n * c10::elementSize(dt), 256), what));
    return at::from_blob(device_buffers_.back().data(), shape, at::TensorOptions().dtype(dt).device(aten_device_));
  };
  ids_dev_ = make({config_.batch(), S}, at::kLong, "batch ids");
  head_stats_dev_ = make({2, M}, at::kDouble, "head loss figures");
  labels_dev_ = make({config_.batch(), S}, at::kLong, "batch labels");
  // Checkpoints on the device: every block's input for every micro-batch.
  // On the host: a ring of two sets on the device, the checkpoints copied out.
  const int64_t sets = config_.checkpoints_on_host ? 2 : head_;
  for (int64_t i = 0; i < sets * M; ++i) act_.push_back(make({mb, S, H}, cdt, "activations"));
  for (int64_t m = 0; m < M; ++m) grad_out_.push_back(make({mb, S, H}, cdt, "output gradients"));
  for (int64_t m = 0; m < M; ++m) {
    head_state_.push_back({make({mb * S}, at::kFloat, "head running max"), make({mb * S}, at::kFloat, "head running sum"),
                           make({mb * S}, at::kFloat, "head target logits")});
    head_lse_.push_back(make({mb * S}, at::kFloat, "head log-sum-exp"));
    grad_h_.push_back(make({mb * S, H}, at::kFloat, "head hidden gradient"));
  }
  for (int s = 0; s < 2; ++s) ring_free_.push_back(device_->make_event());
  if (config_.keep_logits)
    for (int64_t m = 0; m < M; ++m) logits_.push_back(make({mb * S, spec_.dims.vocab}, cdt, "kept logits"));
  if (!config_.saved_blocks.empty()) {
    const int64_t elems = layer_saved_elems(spec_.dims, mb * S);
    for (int s = 0; s < 2; ++s) {
      saved_dev_.push_back(make({elems}, cdt, "kept activations"));
      saved_free_.push_back(device_->make_event());
    }
    for (size_t i = 0; i < config_.saved_blocks.size(); ++i) saved_out_.push_back(device_->make_event());
  }
}

void Engine::settle_compute() {
  if (!compute_pending_) return;
  dist_->barrier();  // every rank wrote its slices
  compute_pending_ = false;
}

StepReport Engine::step(const int64_t* ids, const int64_t* labels) {
  STRIDER_CHECK(dist_->ranks().world == config_.state_shards || !sharded() || simulated(),
                "the engine keeps slice {} of a state sharded over {} ranks but has {} (set_collectives first)",
                config_.state_shard, config_.state_shards, dist_->ranks().world);
  const double t0 = Timeline::now_us();
  StepReport rep;
  rep.step = steps_ + 1;
  rep.lr = config_.adam.lr * config_.schedule.factor(steps_);
  rep.tokens = config_.batch() * config_.seq;
  device_->reset_work_peak();  // no compute op is in flight between steps
  settle_compute();
  upload_batch(ids, labels);
  STRIDER_CHECK(batch_valid_ > 0 || simulated(), "the batch has no label other than -100: nothing to train on");

  // The updater takes the step's job now: it consumes gradients as they land,
  // which frees gradient ring slots the pass may be waiting for.
  auto job = std::make_shared<UpdateJob>();
  job->step = rep.step;
  job->lr = rep.lr;
  if (simulated()) {
    const double begin = sim_step_end_us_;
    sim_step_ = {.job = *job, .spilled_us = std::vector<double>(size_t(num_pieces()), 0.0)};
    run_pass(visits_, /*train=*/true);
    const double end = sim_finish();
    ++steps_;
    const Moved moved = collect_device_spans();
    rep.h2d_bytes = moved.h2d_bytes;
    rep.d2h_bytes = moved.d2h_bytes;
    rep.loss = rep.grad_norm = std::numeric_limits<double>::quiet_NaN();
    rep.step_s = (end - begin) * 1e-6;
    rep.tokens_per_s = double(rep.tokens) / rep.step_s;
    rep.stats = timeline_.stats(begin, end);
    rep.peak_device_bytes = device_->peak_allocated_bytes();
    return rep;
  }
  {
    std::lock_guard lk(mu_);
    job->pass = passes_ + 1;
    jobs_.push_back(job);
  }
  cv_.notify_all();
  run_pass(visits_, /*train=*/true);  // its waits for updates still mean the previous pass's
  {
    std::lock_guard lk(mu_);
    ++passes_;
  }

  // The loss is known once the head ran; the step ends when every gradient
  // has landed and the norm is known (the updates may continue). The updater
  // decided whether the step is skipped before it published the norm.
  device_->synchronize(StreamId::kCompute);
  {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return norm_pass_ >= job->pass || updater_error_; });
    if (updater_error_) std::rethrow_exception(updater_error_);
    rep.grad_norm = last_norm_;
    rep.skipped = job->skipped;
    rep.skip_reason = job->skip_reason;
    rep.nonfinite_block = job->nonfinite_block;
    rep.nonfinite_tensor = job->nonfinite_tensor;
  }
  if (!rep.skipped) ++steps_;
  const auto [loss, valid] = pass_loss();
  rep.valid_tokens = valid;
  rep.loss = loss / double(valid);
  const double t1 = Timeline::now_us();
  // Every copy of the step has finished: the gradients landed (the norm is
  // known), the loss figures too; nothing of the next step is issued yet.
  const Moved moved = collect_device_spans();
  rep.h2d_bytes = moved.h2d_bytes;
  rep.d2h_bytes = moved.d2h_bytes;
  rep.work_peak_bytes = device_->work_peak_bytes();
  rep.step_s = (t1 - t0) * 1e-6;
  rep.tokens_per_s = double(rep.tokens) / rep.step_s;
  rep.stats = timeline_.stats(t0, t1);
  rep.peak_device_bytes = device_->peak_allocated_bytes();
  return rep;
}

double Engine::evaluate(const int64_t* ids, const int64_t* labels) {
  STRIDER_CHECK(!simulated(), "evaluate: a simulated engine computes no loss");
  settle_compute();
  upload_batch(ids, labels);
  run_pass(eval_visits_, /*train=*/false);
  device_->synchronize(StreamId::kCompute);
  const auto [loss, valid] = pass_loss();
  collect_device_spans();
  STRIDER_CHECK(valid > 0, "evaluate: the batch has no label other than -100");
  return loss / double(valid);
}

std::pair<double, int64_t> Engine::pass_loss() {
  head_stats_ready_->synchronize();
  const size_t M = size_t(config_.accumulation);
  double sums[2] = {0, 0};  // the loss summed over valid tokens, and their count
  for (size_t m = 0; m < M; ++m) {
    sums[0] += head_stats_host_[m];
    sums[1] += head_stats_host_[M + m];
  }
  dist_->all_reduce_sum(sums);  // the global batch's (rank order: the same bits on every rank)
  return {sums[0], int64_t(sums[1])};
}

void Engine::set_collectives(std::unique_ptr<Collectives> ranks) {
  STRIDER_CHECK(ranks != nullptr, "set_collectives: no collectives");
  STRIDER_CHECK(!simulated() || ranks->ranks().solo(),
                "a simulated engine runs one rank: it predicts one device's schedule, not {} ranks'",
                ranks->ranks().world);
  finish_updates();
  STRIDER_CHECK(passes_ == 0, "set_collectives: the engine has stepped already; give it its ranks before the "
                "first step");
  STRIDER_CHECK(!sharded() || (ranks->ranks().world == config_.state_shards &&
                               ranks->ranks().rank == config_.state_shard),
                "set_collectives: the engine keeps state slice {} of {} but is given rank {} of {}",
                config_.state_shard, config_.state_shards, ranks->ranks().rank, ranks->ranks().world);
  auto update = ranks->split("updater");
  size_t largest = 0;
  for (int64_t p = 0; p < num_pieces(); ++p) largest = std::max(largest, piece(p).elems());
  std::lock_guard lk(mu_);  // the updater is idle (no pass yet), but it reads these under the lock's order
  dist_ = std::move(ranks);
  dist_update_ = std::move(update);
  dist_scratch_.assign(dist_->ranks().solo() || grad_bytes_ == 4 ? 0 : largest, 0.0f);
}

const RankInfo& Engine::ranks() const { return dist_->ranks(); }

void Engine::set_steps_done(int64_t steps) {
  STRIDER_CHECK(steps >= 0, "set_steps_done({}): a step count is >= 0", steps);
  finish_updates();
  steps_ = steps;  // the passes' sequence numbers go on as they were
}

void Engine::init_params(uint64_t seed) {
  for (int64_t b = 0; b < num_blocks_; ++b) {
    std::vector<float> w(layouts_[b].total_elems(), 0.0f);
    for (const TensorSlot& t : layouts_[b].slots()) {
      const bool norm = t.name.ends_with("norm.weight"), bias = t.name.ends_with(".bias");
      if (bias) continue;
      // One generator per tensor, seeded by its name: the values do not depend
      // on the block layout or on the order blocks are initialised in.
      std::mt19937_64 rng(seed ^ std::hash<std::string>{}(t.name));
      std::normal_distribution<float> nd(0.0f, 0.02f);
      for (size_t i = 0; i < t.numel; ++i) w[t.offset_elems + i] = norm ? 1.0f : nd(rng);
    }
    write_state(b, ExtentKind::kMaster, w);
    std::fill(w.begin(), w.end(), 0.0f);
    write_state(b, ExtentKind::kAdamM, w);
    write_state(b, ExtentKind::kAdamV, w);
  }
}

void Engine::set_param(const std::string& name, std::span<const float> values) {
  for (int64_t b = 0; b < num_blocks_; ++b) {
    const TensorSlot* t = layouts_[b].find(name);
    if (!t) continue;
    STRIDER_CHECK(values.size() == t->numel, "parameter '{}' has {} elements; {} given", name, t->numel, values.size());
    std::vector<float> w(layouts_[b].total_elems());
    read_state(b, ExtentKind::kMaster, w);
    std::copy(values.begin(), values.end(), w.begin() + t->offset_elems);
    write_state(b, ExtentKind::kMaster, w);
    return;
  }
  throw Error(fmt::format("{} has no parameter '{}'", spec_.arch_name, name));
}

std::span<std::byte> Engine::compute_copy(int64_t b) {
  STRIDER_CHECK(!simulated(), "compute_copy: a simulated engine holds no parameters");
  STRIDER_CHECK(b >= 0 && b < num_blocks_, "compute_copy: block {} out of range (the model has {} blocks)", b,
                num_blocks_);
  return store_->block(size_t(b)).compute_bytes();
}

void Engine::model_weights(int64_t b, DType file_dtype, std::span<float> out) {
  STRIDER_CHECK(!simulated(), "model_weights: a simulated engine holds no state");
  STRIDER_CHECK(b >= 0 && b < num_blocks_ && out.size() == layouts_[b].total_elems(),
                "model_weights: block {} and a buffer of {} elements do not match", b, out.size());
  if (file_dtype != DType::kBF16 || compute_bytes_ != 2) {
    read_state(b, ExtentKind::kMaster, out);
    return;
  }
  finish_updates();
  settle_compute();
  const std::span<uint16_t> c = store_->block(size_t(b)).compute;
  bf16_to_float(c, out);
}

std::vector<float> Engine::param(const std::string& name) {
  for (int64_t b = 0; b < num_blocks_; ++b) {
    const TensorSlot* t = layouts_[b].find(name);
    if (!t) continue;
    std::vector<float> w(layouts_[b].total_elems());
    read_state(b, ExtentKind::kMaster, w);
    return {w.begin() + t->offset_elems, w.begin() + t->offset_elems + t->numel};
  }
  throw Error(fmt::format("{} has no parameter '{}'", spec_.arch_name, name));
}

}  // namespace strider
