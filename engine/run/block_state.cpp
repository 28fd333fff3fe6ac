// The engine's block state as callers see it between steps: a block's
// master, Adam m or v whole, from RAM or NVMe, and back (data parallel with
// sharded state: this rank's slice, the others' gathered from their ranks);
// and the NVMe tier's opening.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/config/engine_config.h"
#include "engine/run/collectives.h"
#include "engine/run/engine.h"
#include "engine/run/engine_core.h"
#include "host/adam_q8.h"
#include "host/base_format.h"
#include "host/bf16.h"
#include "host/error.h"
#include "host/grad_norm.h"
#include "host/half.h"

namespace strider {
namespace {

// Where a q8 moment's group scales follow its codes in an NVMe extent.
float* scales_after(std::byte* codes, size_t n) { return reinterpret_cast<float*>(codes + n); }

// The block's elements outside its trained stretch: its frozen tensors (a
// LoRA base, engine/model/lora.h), whose master is their compute copy (the engine
// keeps nothing else of them) and whose moments are zero.
std::vector<std::pair<size_t, size_t>> frozen_ranges(const ParamLayout& l) {
  const auto [tb, te] = l.trainable_span();
  std::vector<std::pair<size_t, size_t>> out;
  if (tb > 0) out.emplace_back(0, tb);
  if (te < l.total_elems()) out.emplace_back(te, l.total_elems());
  return out;
}

}  // namespace

// The NVMe tier (the placement's extents): the store, its two update
// staging slots, and fresh state on the drive (zero master, m and v, and
// compute copies), so that every extent is valid.
void EngineCore::open_nvme_tier() {
  STRIDER_CHECK(!config_->nvme_dir.empty(), "{} pieces keep their state on NVMe but no NVMe directory is set",
                std::count_if(place_.pieces.begin(), place_.pieces.end(), [](const PiecePlace& x) { return x.on_nvme; }));
  NvmeStoreOptions nopt;
  nopt.backend = config_->nvme_backend;
  nvme_ = std::make_unique<NvmeStore>(std::vector<std::string>{config_->nvme_dir + "/strider-state.bin"},
                                      place_.extents, nopt);
  arena_->attach(nvme_->registrar());
  for (int s = 0; s < 2; ++s)
    nvme_staging_.push_back({arena_->carve(place_.nvme_slot_bytes, kHostAlign, "nvme staging master", ArenaUse::kHostOnly),
                             arena_->carve(place_.nvme_slot_bytes, kHostAlign, "nvme staging adam m", ArenaUse::kHostOnly),
                             arena_->carve(place_.nvme_slot_bytes, kHostAlign, "nvme staging adam v", ArenaUse::kHostOnly),
                             config_->gated_updates() ? arena_->carve(place_.nvme_slot_bytes, kHostAlign, "nvme staging grads", ArenaUse::kHostOnly)
                                                   : std::span<std::byte>()});
  if (place_.nvme_compute_slot_bytes > 0)
    for (NvmeStaging& slot : nvme_staging_)
      slot.compute = arena_->carve(place_.nvme_compute_slot_bytes, kHostAlign, "nvme staging compute copy",
                                   ArenaUse::kHostOnly);
  // Fresh state: zero master, m and v (and compute copies) on the drive, so every extent is valid.
  const size_t zeros = std::max(place_.nvme_slot_bytes, place_.nvme_compute_slot_bytes);
  std::span<std::byte> zero = place_.nvme_slot_bytes >= zeros ? nvme_staging_[0].master : nvme_staging_[0].compute;
  std::memset(zero.data(), 0, zeros);
  for (int64_t p = 0; p < num_pieces(); ++p) {
    if (!on_nvme(p)) continue;
    for (ExtentKind k : {ExtentKind::kMaster, ExtentKind::kAdamM, ExtentKind::kAdamV, ExtentKind::kCompute}) {
      if (k == ExtentKind::kCompute && !compute_on_nvme(p)) continue;
      const Extent& e = nvme_->extent(p, k);
      nvme_->wait(nvme_->write(e, zero.first(e.io_bytes)));
    }
  }
}

EngineCore::NvmeStaging& EngineCore::idle_staging() {
  // Outside steps (finish_updates() first), slot 0 is free once its last
  // write-back has left.
  for (NvmeStaging& slot : nvme_staging_) {
    for (auto& t : slot.writes) nvme_->wait(t);
    for (auto& t : slot.reads) nvme_->wait(t);
    slot.writes.clear();
    slot.reads.clear();
    slot.reading = slot.holding = slot.written = -1;
  }
  return nvme_staging_[0];
}

void Engine::read_state(int64_t b, ExtentKind kind, std::span<float> out) {
  EngineCore& core = *core_;
  STRIDER_CHECK(!simulated(), "read_state: a simulated engine holds no state");
  finish_updates();
  STRIDER_CHECK(b >= 0 && b < core.place_.blocks && out.size() == core.place_.layouts[b].total_elems(),
                "read_state: block {} and a buffer of {} elements do not match", b, out.size());
  const BlockState& s = core.store_->block(size_t(b));
  if (!core.place_.nvme_block[size_t(b)]) {
    core.store_->read_kind(size_t(b), state_kind(kind), out.subspan(s.state_begin, s.state_elems()));
  } else {
    EngineCore::NvmeStaging& slot = core.idle_staging();
    const bool q8_master = core.config_->optimizer_state == StateFormat::kQ8 && kind == ExtentKind::kMaster;
    for (int64_t p = core.place_.shards().first_of(b); p < core.place_.shards().end_of(b); ++p) {
      if (!core.on_nvme(p)) continue;  // sharded: none of the piece is this rank's
      const Extent& e = core.nvme_->extent(p, kind);
      core.nvme_->wait(core.nvme_->read(e, slot.master.first(e.io_bytes)));
      if (q8_master && core.compute_on_nvme(p)) {  // the master's high half
        const Extent& c = core.nvme_->extent(p, ExtentKind::kCompute);
        core.nvme_->wait(core.nvme_->read(c, slot.compute.first(c.io_bytes)));
      }
      // The extent holds the piece's owned elements back to back; each run goes to its place in the block.
      const size_t n = core.owned(p).elems();
      std::byte* bytes = slot.master.data();
      const auto* codes = reinterpret_cast<const uint8_t*>(bytes);
      const auto* hi = reinterpret_cast<const uint16_t*>(slot.compute.data());
      for (const UpdateRun& r : core.place_.at(p).runs()) {
        float* to = out.data() + r.block;
        if (core.config_->optimizer_state == StateFormat::kFp32)
          std::memcpy(to, bytes + r.at * sizeof(float), r.n * sizeof(float));
        else if (kind == ExtentKind::kMaster)
          q8_decode_master(core.compute_on_nvme(p) ? hi + r.at : s.compute_at(r.block), codes + r.at, to, r.n);
        else
          q8_decode_moment(state_kind(kind), codes + r.at, scales_after(bytes, n) + r.at / kQ8GroupElems, to, r.n);
      }
    }
  }
  if (core.sharded()) core.gather_state(b, out);
  for (auto [lo, hi] : frozen_ranges(core.place_.layouts[size_t(b)])) {
    if (kind != ExtentKind::kMaster) {
      std::fill(out.begin() + lo, out.begin() + hi, 0.0f);
      continue;
    }
    if (lo < s.compute_begin) {  // a quantized base: what the device computes with
      dequantize_base(*s.base_layout, s.base, out.first(s.compute_begin));
      lo = s.compute_begin;
    }
    const std::span<const std::byte> c = s.compute_range(lo, hi - lo);
    if (!s.compute.empty())
      widen_16(s.compute_dtype, {reinterpret_cast<const uint16_t*>(c.data()), hi - lo}, out.subspan(lo, hi - lo));
    else
      std::memcpy(out.data() + lo, c.data(), c.size());
  }
}

void EngineCore::gather_state(int64_t b, std::span<float> out) {
  STRIDER_CHECK(dist_->ranks().world == config_->state_shards,
                "block {}'s state is sharded over {} ranks; reading all of it needs them (set_collectives)", b,
                config_->state_shards);
  // The ranks' slices cut the block's trained stretch (all of it unless
  // some tensors are frozen, none of a frozen block): that is what they gather.
  const std::vector<size_t>& bounds = place_.block_slices[size_t(b)];
  const size_t lo = bounds.front(), hi = bounds.back();
  if (hi == lo) return;
  std::vector<size_t> bytes(bounds);
  for (size_t& x : bytes) x = (x - lo) * sizeof(float);
  dist_->all_gather(std::as_writable_bytes(out.subspan(lo, hi - lo)), bytes);
}

void Engine::write_state(int64_t b, ExtentKind kind, std::span<const float> in) {
  EngineCore& core = *core_;
  STRIDER_CHECK(!simulated(), "write_state: a simulated engine holds no state");
  finish_updates();
  STRIDER_CHECK(b >= 0 && b < core.place_.blocks && in.size() == core.place_.layouts[b].total_elems(),
                "write_state: block {} and a buffer of {} elements do not match", b, in.size());
  BlockState& s = core.store_->block(size_t(b));
  const bool q8 = core.config_->optimizer_state == StateFormat::kQ8;
  // Frozen tensors: the master is the compute copy (a shared one: rank 0 writes it).
  if (kind == ExtentKind::kMaster && (!core.shared_arena_ || core.config_->state_shard == 0))
    for (auto [lo, hi] : frozen_ranges(core.place_.layouts[size_t(b)])) {
      if (lo < s.compute_begin) {  // a quantized base: quantized once, here (host/base_format.h)
        // Only the tensors given other values than read_state gives: a
        // block written whole to set one tensor keeps the others' bytes.
        requantize_changed(*s.base_layout, in.first(s.compute_begin), s.base);
        lo = s.compute_begin;
      }
      const std::span<std::byte> c = s.compute_range(lo, hi - lo);
      if (!s.compute.empty())
        round_to_16(s.compute_dtype, in.subspan(lo, hi - lo), {reinterpret_cast<uint16_t*>(c.data()), hi - lo});
      else
        std::memcpy(c.data(), in.data() + lo, c.size());
    }
  if (kind == ExtentKind::kMaster && core.shared_arena_) {
    // A compute copy shared with the other ranks: this rank writes its slice
    // (below, or here for an NVMe-tier fp32 state), the others theirs.
    core.compute_pending_ = true;
    const ElemRange own{s.state_begin, s.state_end};
    const std::span<std::byte> c = s.compute_range(own.begin, own.elems());
    if (core.place_.nvme_block[size_t(b)] && !q8 && !s.compute.empty())
      round_to_16(s.compute_dtype, in.subspan(own.begin, own.elems()), {reinterpret_cast<uint16_t*>(c.data()), own.elems()});
    else if (core.place_.nvme_block[size_t(b)] && !q8)
      std::memcpy(c.data(), in.data() + own.begin, c.size());
  } else if (kind == ExtentKind::kMaster && s.compute_on_host &&
             (core.place_.nvme_block[size_t(b)] || core.sharded())) {
    // The compute copy follows the master, all of it: the slices other ranks
    // keep get the bits their ranks write (every rank is given the same `in`).
    // (A quantized base's elements were written above.)
    const std::span<const float> tail = in.subspan(s.compute_begin);
    if (q8) {
      std::vector<uint8_t> ext(tail.size());  // the q8 master's low bytes, kept only for this rank's slice below
      q8_encode_master(tail.data(), s.compute.data(), ext.data(), tail.size());
    } else if (!s.compute.empty()) {
      round_to_16(s.compute_dtype, tail, s.compute);
    } else {
      std::copy(tail.begin(), tail.end(), s.compute_f32.begin());
    }
  }
  if (!core.place_.nvme_block[size_t(b)]) {
    core.store_->write_kind(size_t(b), state_kind(kind), in.subspan(s.state_begin, s.state_elems()));
    return;
  }
  EngineCore::NvmeStaging& slot = core.idle_staging();
  for (int64_t p = core.place_.shards().first_of(b); p < core.place_.shards().end_of(b); ++p) {
    if (!core.on_nvme(p)) continue;  // sharded: none of the piece is this rank's
    const Extent& e = core.nvme_->extent(p, kind);
    const size_t n = core.owned(p).elems();
    std::byte* bytes = slot.master.data();
    auto* codes = reinterpret_cast<uint8_t*>(bytes);
    std::memset(bytes, 0, e.io_bytes);
    // A compute copy on NVMe follows the master there, in the piece's coordinates.
    const bool compute = kind == ExtentKind::kMaster && core.compute_on_nvme(p);
    std::byte* cbytes = slot.compute.data();
    if (compute) std::memset(cbytes, 0, core.nvme_->extent(p, ExtentKind::kCompute).io_bytes);
    for (const UpdateRun& r : core.place_.at(p).runs()) {  // as read_state, the other way
      const float* from = in.data() + r.block;
      if (!q8)
        std::memcpy(bytes + r.at * sizeof(float), from, r.n * sizeof(float));
      else if (kind == ExtentKind::kMaster)
        q8_encode_master(from, compute ? reinterpret_cast<uint16_t*>(cbytes) + r.at : s.compute_at(r.block),
                         codes + r.at, r.n);
      else
        q8_encode_moment(state_kind(kind), from, codes + r.at, scales_after(bytes, n) + r.at / kQ8GroupElems, r.n);
      if (compute && !q8 && core.place_.compute_bytes == 2)
        round_to_16(s.compute_dtype, {from, r.n}, {reinterpret_cast<uint16_t*>(cbytes) + r.at, r.n});
      else if (compute && !q8)
        std::memcpy(cbytes + r.at * sizeof(float), from, r.n * sizeof(float));
    }
    core.nvme_->wait(core.nvme_->write(e, slot.master.first(e.io_bytes)));
    if (compute) {
      const Extent& c = core.nvme_->extent(p, ExtentKind::kCompute);
      core.nvme_->wait(core.nvme_->write(c, slot.compute.first(c.io_bytes)));
    }
  }
}

// Between steps: the step count and fp16's loss scale, as a resume sets them.
void Engine::set_steps_done(int64_t steps) {
  EngineCore& core = *core_;
  STRIDER_CHECK(steps >= 0, "set_steps_done({}): a step count is >= 0", steps);
  finish_updates();
  core.steps_ = steps;  // the passes' sequence numbers go on as they were
}

void Engine::set_loss_scale(LossScaleState s) {
  EngineCore& core = *core_;
  STRIDER_CHECK(core.config_->loss_scaled(), "set_loss_scale: the {} compute dtype does not scale its loss (fp16 does)",
                compute_dtype_name(core.config_->compute.dtype));
  STRIDER_CHECK(std::isfinite(s.scale) && s.scale >= core.config_->loss_scaling.floor && s.good_steps >= 0,
                "set_loss_scale: a scale of {} with {} good steps; the scale is finite and at least the floor {}",
                s.scale, s.good_steps, core.config_->loss_scaling.floor);
  finish_updates();
  core.scaler_ = s;
}

void Engine::model_weights(int64_t b, DType file_dtype, std::span<float> out) {
  EngineCore& core = *core_;
  STRIDER_CHECK(!simulated(), "model_weights: a simulated engine holds no state");
  STRIDER_CHECK(b >= 0 && b < core.place_.blocks && out.size() == core.place_.layouts[b].total_elems(),
                "model_weights: block {} and a buffer of {} elements do not match", b, out.size());
  const BlockState& s = core.store_->block(size_t(b));
  if (file_dtype != DType::kBF16 || core.config_->compute.dtype != at::kBFloat16 || s.compute_begin > 0 ||
      !s.compute_on_host) {
    read_state(b, ExtentKind::kMaster, out);
    return;
  }
  finish_updates();
  core.settle_compute();
  const std::span<uint16_t> c = core.store_->block(size_t(b)).compute;
  bf16_to_float(c, out);
}

std::string Engine::first_non_finite_param() {
  EngineCore& core = *core_;
  for (int64_t b = 0; b < core.place_.blocks; ++b) {
    std::vector<float> w(core.place_.layouts[size_t(b)].total_elems());
    read_state(b, ExtentKind::kMaster, w);
    if (std::isfinite(sum_squares(w))) continue;
    for (int64_t p = core.place_.shards().first_of(b); p < core.place_.shards().end_of(b); ++p) {
      std::vector<float> values(core.piece(p).elems());  // the piece's coordinates
      for (const PieceRun& r : core.piece(p).runs())
        std::copy_n(w.begin() + ptrdiff_t(r.block), r.n, values.begin() + ptrdiff_t(r.at));
      std::string name = core.first_non_finite(p, values.data());
      if (name != "(padding)") return name;
    }
  }
  return "";
}

void Engine::inject_nonfinite_gradient(int64_t b) {
  EngineCore& core = *core_;
  STRIDER_CHECK(b >= 0 && b < core.place_.blocks, "inject_nonfinite_gradient: block {} out of range", b);
  core.fault_block_ = b;  // the next training pass's job takes it
}

// The reference copy (keep_reference): the weights before the first step
// changes them, or as a checkpoint's load writes them.
void EngineCore::ensure_reference() {
  if (!config_->keep_reference || reference_taken_ || priced()) return;
  STRIDER_CHECK(passes_ == 0, "internal: the reference copy is taken after {} passes changed the weights", passes_);
  settle_compute();  // data parallel with a shared compute copy: every rank's slices written
  store_->take_reference();
  reference_taken_ = true;
}

bool Engine::keeps_reference() const { return core_->config_->keep_reference; }

std::span<std::byte> Engine::reference_copy(int64_t b) {
  EngineCore& core = *core_;
  STRIDER_CHECK(!simulated(), "reference_copy: a simulated engine holds no parameters");
  STRIDER_CHECK(core.config_->keep_reference, "reference_copy: this engine keeps no reference copy (keep_reference)");
  STRIDER_CHECK(b >= 0 && b < core.place_.blocks, "reference_copy: block {} out of range (the model has {} blocks)", b,
                core.place_.blocks);
  finish_updates();
  core.ensure_reference();
  core.reference_taken_ = true;  // a load writes it now
  return core.store_->block(size_t(b)).reference;
}

}  // namespace strider
