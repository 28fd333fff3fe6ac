#include "engine/run/engine_core.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "engine/config/engine_config.h"
#include "engine/run/collectives.h"
#include "engine/run/engine.h"
#include "engine/run/sim_updater.h"
#include "engine/run/updater.h"
#include "gpu/blocks/unit_tensors.h"
#include "host/error.h"

namespace strider {
namespace {

// A SimDevice has no memory to compute on; the tensors the engine makes over
// its (fake) buffers are never touched, so they may as well say CPU.
at::Device engine_aten_device(const Device& d) { return d.kind() == DeviceKind::kSim ? at::kCPU : aten_device(d); }

EngineConfig with_devices(EngineConfig c, size_t n) {
  c.devices = int(n);
  return c;
}

}  // namespace

size_t Engine::registered_host_bytes() const {
  const EngineCore& core = *core_;
  return core.arena_->copied_bytes() + (core.shared_arena_ ? core.shared_arena_->copied_bytes() : 0);
}

EngineCore::EngineCore(ModelSpec spec, EngineConfig config, std::vector<std::unique_ptr<Device>> devices)
    : spec_(spec.with_lora(config.lora, "engine config lora")),
      config_(std::make_unique<const EngineConfig>(with_devices(std::move(config), devices.size()))),
      compute_(config_->compute),
      adam_hyper_(config_->adam),
      objective_(config_->objective.resolve()),
      place_((check_config(spec_, *config_), place(spec_, *config_))) {
  STRIDER_CHECK(!devices.empty(), "Engine: no device given");
  for (auto& d : devices) {
    STRIDER_CHECK(d != nullptr, "Engine: no device given");
    STRIDER_CHECK(seats_.empty() || d->kind() == device().kind(),
                  "Engine: a pool's devices are of one kind; {} and {} are not", device().name(), d->name());
    Seat st;
    st.aten = engine_aten_device(*d);
    st.device = std::move(d);
    seats_.push_back(std::move(st));
  }
  // fp16 GEMMs accumulating in fp16: CUDA's and the simulator's; the CPU device refuses, naming itself.
  if (config_->compute.fp16_accumulate)
    for (Seat& st : seats_) st.device->set_fp16_accumulate(true);
  dist_ = solo_collectives();
  dist_update_ = solo_collectives();
  if (config_->loss_scaled()) scaler_.scale = config_->loss_scaling.init;
  const int64_t M = config_->accumulation, P = num_pieces(), head = place_.head;
  slice_bytes_.resize(size_t(config_->state_shards) + 1);

  compile_programs(1);

  // Pinned host memory: the store, batch staging, tied-gradient staging,
  // host checkpoints and NVMe staging, all in one arena mapped now. Devices
  // that price their work and run none (SimDevices) touch none of it: the
  // arena only reserves its addresses (the shared compute copy's too), and
  // no file is opened. This and the host executor below are the only
  // choices the engine makes by its devices' kind.
  StoreOptions so = place_.store;
  so.zero = !priced();
  const size_t tokens = size_t(config_->batch() * config_->seq);
  const size_t emb_elems = place_.layouts[0].total_elems();
  const EngineFootprint& fp = place_.footprint;
  arena_ = std::make_unique<PinnedArena>(
      fp.host_bytes + (priced() ? fp.shared_host_bytes : 0),
      ArenaOptions{.lock = config_->lock, .name = "strider host arena", .reserve_only = priced()});
  if (!config_->shared_compute_file.empty() && !priced()) {
    shared_arena_ = std::make_unique<PinnedArena>(
        fp.shared_host_bytes, ArenaOptions{.lock = config_->lock, .name = "strider shared compute copy",
                                           .shared_file = config_->shared_compute_file});
  }
  store_ = std::make_unique<ParamStore>(place_.store_blocks, so, *arena_, shared_arena_.get());
  ids_host_ = arena_->carve_as<int64_t>(tokens, "batch ids", kHostAlign);
  labels_host_ = arena_->carve_as<int64_t>(tokens, "batch labels", kHostAlign);
  if (config_->packed_documents) positions_host_ = arena_->carve_as<int64_t>(tokens, "batch positions", kHostAlign);
  if (spec_.router_aux_coef > 0) valid_host_ = arena_->carve_as<float>(tokens, "batch attention mask", kHostAlign);
  if (spec_.tie_embeddings) tied_grad_host_ = arena_->carve_as<float>(emb_elems, "tied embedding gradient", kHostAlign);
  head_stats_host_ = arena_->carve_as<double>(size_t(2 * M), "head loss figures", kHostAlign);
  if (!objective_.sft()) {
    objective_host_ = arena_->carve_as<float>(objective_in_elems(config_->batch(), config_->seq), "objective inputs",
                                              kHostAlign);
    objective_stats_host_ = arena_->carve_as<double>(kObjectiveStats, "objective figures", kHostAlign);
  }
  // Per micro-batch: its host checkpoints (of blocks 1..head) and kept
  // activations (per kept layer), carved block-major; a pool's hand-offs.
  host_ckpt_.resize(size_t(M));
  saved_host_.resize(size_t(M));
  if (place_.input_ring)
    for (int64_t b = 0; b < head; ++b)
      for (int64_t m = 0; m < M; ++m)
        host_ckpt_[size_t(m)].push_back(arena_->carve(place_.act_bytes, kHostAlign, "host checkpoint"));
  for (int64_t k = 0; k < fp.saved_layers; ++k)
    for (int64_t m = 0; m < M; ++m)
      saved_host_[size_t(m)].push_back(arena_->carve(place_.saved_bytes, kHostAlign, "kept activations"));
  if (fp.hand_off_bytes > 0) {  // placement.cpp's count_host counts these
    const size_t tokens_mb = size_t(config_->micro_batch * config_->seq);
    const size_t lse = tokens_mb * 4 * (objective_.sft() ? 1 : 2);  // an objective's coefficients go with it
    const size_t bytes[kHandKinds] = {place_.hand_block_bytes, 3 * tokens_mb * 4, lse,
                                      tokens_mb * size_t(spec_.dims.hidden) * 4};
    for (int k = 0; k < (place_.head_spread() ? kHandKinds : 1); ++k)
      for (int64_t m = 0; m < M; ++m) hand_host_[k].push_back(arena_->carve(bytes[k], kHostAlign, "hand-off"));
  }
  if (place_.ring_slot_bytes > 0)
    for (int64_t r = 0; r < config_->grad_ring; ++r)
      grad_ring_.push_back(arena_->carve(place_.ring_slot_bytes, kHostAlign, "gradient ring slot"));
  if (place_.compute_load_slot_bytes > 0)  // the device copies out of them
    for (int k = 0; k < kComputeLoadSlots; ++k)
      compute_slots_.push_back({arena_->carve(place_.compute_load_slot_bytes, kHostAlign, "compute copy load staging")});
  // The device pins what it copies (everything above), not the optimizer state;
  // each process registers the shared compute copy for itself. A pool of
  // GPUs registers once (cudaHostRegisterPortable); each CPU device keeps its
  // own record of what is registered.
  for (const Seat& st : seats_) {
    if (&st != &seats_.front() && st.device->kind() != DeviceKind::kCpu) continue;
    if (auto reg = st.device->host_registrar()) {
      arena_->attach(reg, ArenaPart::kCopied);
      if (shared_arena_) shared_arena_->attach(reg, ArenaPart::kCopied);
    }
  }
  ring_uses_.assign(grad_ring_.size(), 0);

  if (!place_.extents.empty() && !priced()) open_nvme_tier();

  // Each device: K units sized for the largest visit, its buffers, its runner.
  for (int d = 0; d < int(seats_.size()); ++d) {
    Seat& st = seats_[size_t(d)];
    st.pool = std::make_unique<CacheUnitPool>(
        *st.device, size_t(config_->window), fp.unit_elems,
        CacheUnitPoolOptions{.what = "cache units", .param_elem_bytes = place_.compute_bytes,
                             .grad_capacity_elems = place_.shards().unit_grad_elems,
                             .staging_bytes = place_.base_staging_bytes});
    allocate_activations(d);
    st.runner = std::make_unique<BlockRunner>(spec_, config_->compute, config_->seq, st.aten);
    st.data_ready = st.device->make_event();
    for (auto& e : st.mark) e = st.device->make_event();
    for (auto& kind : st.handed)
      for (int64_t m = 0; m < M; ++m) kind.push_back(st.device->make_event());
  }
  adam_ = std::make_unique<CpuAdam>(CpuAdam::Options{.threads = config_->optimizer_threads});

  // Events are made by the device that records them.
  for (int64_t p = 0; p < P; ++p) grads_ready_.push_back(seats_[size_t(place_.piece_device(p))].device->make_event());
  grad_spill_.resize(size_t(P));
  for (ComputeSlot& slot : compute_slots_)
    for (Seat& st : seats_) {
      slot.copied.push_back(st.device->make_event());
      slot.read_done.push_back(st.device->make_event());
    }
  for (int64_t s = 0; s < place_.shards().shards; ++s)
    tied_grad_ready_.push_back(seats_[size_t(place_.head_device(s))].device->make_event());
  head_stats_ready_ = seats_[size_t(place_.last_head_device())].device->make_event();
  saved_out_.resize(size_t(fp.saved_layers));
  for (int64_t b = 1; b < head; ++b)
    if (place_.saved_index[size_t(b)] >= 0)
      saved_out_[size_t(place_.saved_index[size_t(b)])] = seats_[size_t(place_.block_device(b))].device->make_event();

  // The host executor: the SimUpdater prices the host operations beside a
  // SimDevice (which has no span clock to align); the Updater runs them.
  if (priced()) {
    host_ = std::make_unique<SimUpdater>(static_cast<SimDevice&>(device()), place_, config_->optimizer_state,
                                         place_.ring_slot_bytes > 0 ? config_->grad_ring : 0, timeline_);
    return;
  }
  // Align each device's span clock with ours: one empty op, timed from both sides.
  for (Seat& st : seats_) {
    st.device->launch(StreamId::kCompute, {"clock sync"}, [](const LaunchContext&) {});
    st.device->synchronize();
    std::vector<OpSpan> sync_spans;
    st.device->drain_spans(sync_spans);
    if (!sync_spans.empty()) st.origin_us = Timeline::now_us() - sync_spans.back().end_us;
  }

  auto updater = std::make_unique<Updater>(*this);
  updater_ = updater.get();
  host_ = std::move(updater);
}

EngineCore::~EngineCore() {
  if (updater_) updater_->stop();
  for (Seat& st : seats_) try {
      st.device->synchronize();
    } catch (...) {
      // Destructors never throw; a failed op was reported by the step that saw it.
    }
  for (auto& s : nvme_staging_)
    for (auto& t : s.writes) try { nvme_->wait(t); } catch (...) {}
  for (auto& t : grad_spill_)  // their callbacks touch the timeline and the lock
    if (t.valid()) try { nvme_->wait(t); } catch (...) {}
  for (ComputeSlot& slot : compute_slots_)
    for (auto& t : slot.reads) try { nvme_->wait(t); } catch (...) {}
  if (updater_) updater_->wait_compute_written();
}

void EngineCore::compile_programs(int world) {
  program_ = compile_step(place_, program_inputs(*config_, world));
  eval_program_ = compile_eval(place_, program_inputs(*config_, world));
  takes_positions_ = takes_positions(program_);
}

void EngineCore::settle_compute() {
  if (!compute_pending_) return;
  dist_->barrier();  // every rank wrote its slices
  compute_pending_ = false;
}

StepReport Engine::step(const int64_t* ids, const int64_t* labels, const int64_t* positions,
                        const int64_t* attention, const ObjectiveInputs* objective) {
  EngineCore& core = *core_;
  core.check_usable("step");
  STRIDER_CHECK(core.dist_->ranks().world == core.config_->state_shards || !core.sharded() || simulated(),
                "the engine keeps slice {} of a state sharded over {} ranks but has {} (set_collectives first)",
                core.config_->state_shard, core.config_->state_shards, core.dist_->ranks().world);
  const double t0 = Timeline::now_us();
  StepReport rep;
  rep.step = core.steps_ + 1;
  rep.lr = core.config_->adam.lr * core.config_->schedule.factor(core.steps_);
  rep.tokens = core.config_->batch() * core.config_->seq;
  for (EngineCore::Seat& st : core.seats_) st.device->reset_work_peak();  // no compute op is in flight between steps
  core.settle_compute();
  core.ensure_reference();  // before this step's updates change the weights
  check_objective_inputs(core.objective_, objective, labels, core.config_->batch(), core.config_->seq,
                         core.config_->objective.objective);
  core.upload_batch(ids, labels, positions, attention);
  if (core.batch_valid_ == 0) {
    // Nothing to learn from: no pass, no update, no step count (the same on
    // every rank: the count is the global batch's).
    rep.skipped = rep.no_targets = true;
    rep.skip_reason = "the batch has no target token (every label is -100)";
    rep.loss = rep.grad_norm = std::numeric_limits<double>::quiet_NaN();
    rep.step_s = (Timeline::now_us() - t0) * 1e-6;
    return rep;
  }

  // The host executor takes the step's job now: it consumes gradients as
  // they land, which frees gradient ring slots the pass may be waiting for.
  auto job = std::make_shared<UpdateJob>();
  job->step = rep.step;
  job->lr = rep.lr;
  job->fault_block = std::exchange(core.fault_block_, -1);
  core.pass_scale_ = job->loss_scale = core.config_->loss_scaled() ? core.scaler_.scale : 1.0;
  if (!core.objective_.sft()) {
    ObjectiveInputs all_rows{.rows = core.config_->batch()};  // simpo and orpo may leave them out
    core.upload_objective(objective != nullptr ? *objective : all_rows);
  }
  rep.loss_scale = core.config_->loss_scaled() ? core.scaler_.scale : 0.0;
  core.host_->begin(core.program_, job);
  core.open_job_ = job;  // until it ends: a failure leaves it to settle_after_failure
  core.run_pass(core.program_, core.take_device_fault());  // its waits for updates still mean the previous pass's
  ++core.passes_;
  const PassEnd end = core.host_->end(*job);
  core.open_job_.reset();
  rep.grad_norm = end.grad_norm;
  rep.skipped = job->skipped;
  rep.skip_reason = job->skip_reason;
  rep.nonfinite_block = job->nonfinite_block;
  rep.nonfinite_tensor = job->nonfinite_tensor;
  if (!rep.skipped) ++core.steps_;
  double begin = t0, t1 = 0;
  if (end.priced) {
    // Prices, not values: no loss was computed, and the step's time is the
    // pass's on the executor's virtual clock.
    rep.loss = std::numeric_limits<double>::quiet_NaN();
    begin = end.begin_us;
    t1 = end.end_us;
  } else {
    const auto [loss, valid] = core.pass_loss(!core.objective_.sft());
    rep.valid_tokens = valid;
    rep.loss = loss;
    if (!core.objective_.sft()) rep.metrics = core.objective_metrics();
    if (core.config_->loss_scaled()) {
      // An overflow of finite loss above the floor is the scale's business, not a divergence.
      rep.overflow = rep.skipped && std::isfinite(rep.loss) && core.scaler_.scale > core.config_->loss_scaling.floor;
      core.scaler_ = next_loss_scale(core.config_->loss_scaling, core.scaler_, rep.skipped);
    }
    t1 = Timeline::now_us();
  }
  // Every copy of the step has finished: the gradients landed (the norm is
  // known), the loss figures too; nothing of the next step is issued yet.
  const EngineCore::Moved moved = core.collect_device_spans();
  rep.h2d_bytes = moved.h2d_bytes;
  rep.d2h_bytes = moved.d2h_bytes;
  for (const EngineCore::Seat& st : core.seats_) {
    rep.work_peak_bytes = std::max(rep.work_peak_bytes, st.device->work_peak_bytes());
    rep.peak_device_bytes = std::max(rep.peak_device_bytes, st.device->peak_allocated_bytes());
  }
  rep.step_s = (t1 - begin) * 1e-6;
  rep.tokens_per_s = double(rep.tokens) / rep.step_s;
  rep.stats = core.timeline_.stats(begin, t1);
  return rep;
}

std::pair<double, int64_t> EngineCore::pass_loss(bool objective) {
  head_stats_ready_->synchronize();
  const size_t M = size_t(config_->accumulation);
  double sums[2] = {0, 0};  // the loss summed over valid tokens, and their count
  for (size_t m = 0; m < M; ++m) {
    sums[0] += head_stats_host_[m];
    sums[1] += head_stats_host_[M + m];
  }
  double all[3] = {sums[0], sums[1], local_aux()};
  dist_->all_reduce_sum(all);  // the global batch's (rank order: the same bits on every rank)
  const double batches = router_rows_.with_inputs;
  const double aux_mean = batches > 0 ? all[2] / batches : 0.0;
  // An objective's figure is the step's loss already (each rank's share, summed).
  const double main = objective ? all[0] : all[0] / all[1];
  return {main + spec_.router_aux_coef * aux_mean, int64_t(all[1])};
}

double EngineCore::local_aux() const {
  // The load-balancing loss, a mean over every rank's micro-batches (docs/moe.md, "How the engine runs them").
  double aux = 0;
  if (spec_.router_aux_coef > 0) {
    // The last layer's device holds the whole sum (a pool hands it on, device_ops.cpp).
    const at::Tensor stats = seats_[size_t(place_.block_device(place_.head - 1))].moe_stats.cpu();
    for (size_t m = 0; m < size_t(config_->accumulation); ++m)
      aux += moe_aux_loss(stats[int64_t(m)], router_rows_.rows[m]).item<double>();
  }
  return aux;
}

double EngineCore::router_aux_term() {
  double aux = local_aux();
  dist_->all_reduce_sum(std::span<double>(&aux, 1));
  const double batches = router_rows_.with_inputs;
  return batches > 0 ? spec_.router_aux_coef * aux / batches : 0.0;
}

MoeStep EngineCore::moe_step(const Seat& s, int64_t b, int64_t m, bool backward) const {
  MoeStep st;
  if (!s.moe_stats.defined() || b == 0 || b >= place_.head || !spec_.sparse(b - 1)) return st;
  st.stats = s.moe_stats[m];
  if (router_rows_.padded[size_t(m)]) st.valid = s.mb[size_t(m)].valid;
  if (!backward) return st;
  // Every rank's micro-batches with an input token count alike: their gradients sum over the ranks.
  const double batches = router_rows_.with_inputs;
  st.aux_scale = batches > 0 ? pass_scale_ * spec_.router_aux_coef / batches : 0.0;
  st.rows = router_rows_.rows[size_t(m)];
  return st;
}

void Engine::set_collectives(std::unique_ptr<Collectives> ranks) {
  EngineCore& core = *core_;
  STRIDER_CHECK(ranks != nullptr, "set_collectives: no collectives");
  STRIDER_CHECK(!simulated() || ranks->ranks().solo(),
                "a simulated engine runs one rank: it predicts one device's schedule, not {} ranks'",
                ranks->ranks().world);
  finish_updates();
  STRIDER_CHECK(core.passes_ == 0, "set_collectives: the engine has stepped already; give it its ranks before the "
                "first step");
  STRIDER_CHECK(!core.sharded() || (ranks->ranks().world == core.config_->state_shards &&
                                    ranks->ranks().rank == core.config_->state_shard),
                "set_collectives: the engine keeps state slice {} of {} but is given rank {} of {}",
                core.config_->state_shard, core.config_->state_shards, ranks->ranks().rank, ranks->ranks().world);
  auto update = ranks->split("updater");
  size_t largest = 0;
  for (int64_t p = 0; p < core.num_pieces(); ++p) largest = std::max(largest, core.piece(p).elems());
  // The updater is idle (no pass yet); its next job, handed over under its
  // lock, sees these.
  core.dist_ = std::move(ranks);
  core.dist_update_ = std::move(update);
  core.compile_programs(core.dist_->ranks().world);  // the ranks' pass inserts their collectives
  core.dist_scratch_.assign(core.dist_->ranks().solo() || core.place_.grad_bytes == 4 ? 0 : largest, 0.0f);
}

const RankInfo& Engine::ranks() const { return core_->dist_->ranks(); }

void Engine::init_params(uint64_t seed) {
  EngineCore& core = *core_;
  for (int64_t b = 0; b < core.place_.blocks; ++b) {
    std::vector<float> w(core.place_.layouts[b].total_elems(), 0.0f);
    for (const TensorSlot& t : core.place_.layouts[b].slots())
      initial_values(t, seed, std::span(w).subspan(t.offset_elems, t.numel), core.spec_.dims.norm);
    write_state(b, ExtentKind::kMaster, w);
    std::fill(w.begin(), w.end(), 0.0f);
    write_state(b, ExtentKind::kAdamM, w);
    write_state(b, ExtentKind::kAdamV, w);
  }
}

void Engine::set_param(const std::string& name, std::span<const float> values) {
  EngineCore& core = *core_;
  for (int64_t b = 0; b < core.place_.blocks; ++b) {
    const TensorSlot* t = core.place_.layouts[b].find(name);
    if (!t) continue;
    STRIDER_CHECK(values.size() == t->numel, "parameter '{}' has {} elements; {} given", name, t->numel, values.size());
    std::vector<float> w(core.place_.layouts[b].total_elems());
    read_state(b, ExtentKind::kMaster, w);
    std::copy(values.begin(), values.end(), w.begin() + t->offset_elems);
    write_state(b, ExtentKind::kMaster, w);
    return;
  }
  throw Error(fmt::format("{} has no parameter '{}'", core.spec_.arch_name, name));
}

std::span<std::byte> Engine::compute_copy(int64_t b) {
  EngineCore& core = *core_;
  STRIDER_CHECK(!simulated(), "compute_copy: a simulated engine holds no parameters");
  STRIDER_CHECK(b >= 0 && b < core.place_.blocks, "compute_copy: block {} out of range (the model has {} blocks)", b,
                core.place_.blocks);
  STRIDER_CHECK(core.store_->block(size_t(b)).compute_on_host,
                "compute_copy: block {}'s compute copy lives on NVMe (nvme_compute_blocks); it has none in RAM to "
                "point at", b);
  return core.store_->block(size_t(b)).compute_bytes();
}

size_t Engine::compute_begin(int64_t b) const {
  const EngineCore& core = *core_;
  STRIDER_CHECK(!simulated(), "compute_begin: a simulated engine holds no parameters");
  STRIDER_CHECK(b >= 0 && b < core.place_.blocks, "compute_begin: block {} out of range (the model has {} blocks)", b,
                core.place_.blocks);
  return core.store_->block(size_t(b)).compute_begin;
}

std::vector<float> Engine::param(const std::string& name) {
  EngineCore& core = *core_;
  for (int64_t b = 0; b < core.place_.blocks; ++b) {
    const TensorSlot* t = core.place_.layouts[b].find(name);
    if (!t) continue;
    std::vector<float> w(core.place_.layouts[b].total_elems());
    read_state(b, ExtentKind::kMaster, w);
    return {w.begin() + t->offset_elems, w.begin() + t->offset_elems + t->numel};
  }
  throw Error(fmt::format("{} has no parameter '{}'", core.spec_.arch_name, name));
}

}  // namespace strider
