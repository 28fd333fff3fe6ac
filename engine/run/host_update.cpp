// The host operations' handlers (the updater's table, engine/run/updater.cpp):
// CPU AdamW per piece, the checks, the global norm and clipping, the ranks'
// collectives, over the block state in RAM or on NVMe (block_state.cpp
// reads and writes it between steps).
#include <cmath>
#include <cstring>
#include <limits>
#include <fmt/format.h>

#include "engine/run/collectives.h"
#include "engine/run/updater.h"
#include "host/adam_q8.h"
#include "host/bf16.h"
#include "host/error.h"
#include "host/grad_norm.h"

namespace strider {
namespace {

// One piece's q8 state, given where each kind's bytes are: the extension,
// and codes followed by their groups' scales for m and v.
Q8View q8_view(uint16_t* hi, std::byte* ext, std::byte* m, float* m_scale, std::byte* v, float* v_scale) {
  return {hi, reinterpret_cast<uint8_t*>(ext), reinterpret_cast<uint8_t*>(m), m_scale,
          reinterpret_cast<uint8_t*>(v), v_scale};
}
float* scales_after(std::byte* codes, size_t n) { return reinterpret_cast<float*>(codes + n); }

// "nan", "inf" or "-inf" (fmt prints a NaN's sign bit: "-nan").
std::string nonfinite_text(double x) { return std::isnan(x) ? "nan" : fmt::format("{}", x); }

// Marks the job skipped (the first reason stands).
void skip(auto& job, std::string reason) {
  if (job.skipped) return;
  job.skipped = true;
  job.skip_reason = std::move(reason);
}

}  // namespace

std::string EngineCore::first_non_finite(int64_t p, const float* values) const {
  for (const PieceRun& r : piece(p).runs())
    for (const TensorSlot& t : place_.layouts[size_t(piece(p).block)].slots()) {
      const size_t lo = std::max(r.block, t.offset_elems), hi = std::min(r.block + r.n, t.offset_elems + t.numel);
      for (size_t i = lo; i < hi; ++i)
        if (!std::isfinite(values[r.at + (i - r.block)])) return t.name;
    }
  return "(padding)";
}

std::string EngineCore::first_non_finite_grad(int64_t p, const std::byte* grads, Range in) const {
  std::vector<float> values(piece(p).elems(), 0.0f);
  if (place_.grad_bytes == 4)
    std::memcpy(values.data() + in.begin, grads + in.begin * 4, in.elems() * 4);
  else
    bf16_to_float({reinterpret_cast<const uint16_t*>(grads) + in.begin, in.elems()},
                  std::span<float>(values).subspan(in.begin, in.elems()));
  const std::string name = first_non_finite(p, values.data());
  return name == "(padding)" && std::all_of(values.begin(), values.end(), [](float x) { return std::isfinite(x); })
             ? ""
             : name;
}

void EngineCore::skip_piece(int64_t b) {
  if (spills_grads(b)) {
    // Its ring slot is freed by the spill's completion; the spill must be
    // done before the next pass writes the extent again.
    NvmeTicket& spill = grad_spill_[size_t(b)];
    if (spill.valid()) nvme_->wait(spill);
    spill = {};
  } else if (place_.at(b).ring_slot >= 0) {
    release_ring_slot(b);
  }
}

// Replicated state: the whole gradient summed on every rank. Sharded: only
// this rank's slice of it (the rest stays this rank's own micro-batches').
void EngineCore::sum_grads_over_ranks(int64_t p, bool slice) {
  if (dist_update_->ranks().solo()) return;
  const size_t n = piece(p).elems();
  std::byte* g = grad_host(p).data();
  const std::vector<size_t>& cut = place_.at(p).slices;
  auto sum = [&](std::span<float> x) {
    if (slice) dist_update_->reduce_scatter_sum(x, cut);
    else dist_update_->all_reduce_sum(x);
  };
  if (place_.grad_bytes == 4) {
    sum(std::span<float>(reinterpret_cast<float*>(g), n));
    return;
  }
  // bf16 on the host: summed in fp32, rounded once (to nearest even).
  std::span<uint16_t> g16(reinterpret_cast<uint16_t*>(g), n);
  std::span<float> f = std::span<float>(dist_scratch_).first(n);
  bf16_to_float(g16, f);
  sum(f);
  if (!slice) {
    float_to_bf16(f, g16);
    return;
  }
  const ElemRange own = place_.at(p).owned;  // this rank's slice
  float_to_bf16(f.subspan(own.begin, own.elems()), g16.subspan(own.begin, own.elems()));
}

void EngineCore::gather_compute(int64_t p, bool shared) {
  if (shared) {  // one compute copy on the machine: the ranks' slices are in it once all have written
    dist_update_->barrier();
    return;
  }
  // Range by range: each is contiguous in the block's compute copy, the ranks' slices cut to it.
  const std::vector<size_t>& bounds = place_.block_slices[size_t(piece(p).block)];
  const BlockState& c = store_->block(size_t(piece(p).block));
  for (const ElemRange& range : piece(p).ranges) {
    for (size_t r = 0; r < bounds.size(); ++r)
      slice_bytes_[r] = (std::clamp(bounds[r], range.begin, range.end) - range.begin) * place_.compute_bytes;
    dist_update_->all_gather(c.compute_range(range.begin, range.elems()), slice_bytes_);
  }
}

void EngineCore::op_check_loss(UpdateJob& job) {
  // The loss of the pass: its D2H precedes the head's gradients on the
  // d2h stream, so it is there once they are.
  head_stats_ready_->synchronize();
  double loss = 0;
  for (int64_t m = 0; m < place_.micro_batches; ++m) loss += head_stats_host_[size_t(m)];
  // One decision for every rank: any rank's non-finite loss skips the step everywhere.
  if (dist_update_->any(!std::isfinite(loss)))
    skip(job, std::isfinite(loss) ? std::string("another rank's loss is not finite") : "loss is " + nonfinite_text(loss));
}

void EngineCore::op_check_grad(const StepOp& op, UpdateJob& job, const PassFigures& fig) {
  // Without clipping updates overlap backward: only the first piece to
  // land can still skip the step; a later one finds pieces already updated.
  const int64_t b = op.piece;
  if (job.skipped || std::isfinite(fig.sumsq[size_t(b)])) return;
  const int64_t updated_before = op.as<CheckArgs>().updated_before;
  STRIDER_CHECK(updated_before == 0,
                "step {}: block {}'s gradient is not finite ({}; first non-finite tensor: {}) after "
                "{} earlier pieces of the step were updated; without clipping updates overlap backward, "
                "so the step is partly applied: the run stops here, and nothing of this step may be saved "
                "(the last checkpoint stays). Clipping (--clip) checks every gradient before any update.",
                job.step, piece(b).block, place_.shards().name(spec_, b), fig.bad_tensor[size_t(b)], updated_before);
  skip(job, fmt::format("the gradient of block {} is not finite", piece(b).block));
}

void EngineCore::op_norm(const StepOp& op, UpdateJob& job, PassFigures& fig) {
  const NormArgs& a = op.as<NormArgs>();
  double total = 0;
  for (const std::vector<double>& parts : fig.parts)  // piece order: independent of arrival order
    for (double x : parts) total += x;
  if (a.gate && !job.skipped && !std::isfinite(total)) skip(job, "gradient norm is " + nonfinite_text(std::sqrt(total)));
  if (job.skipped)  // name the first block in forward order with a bad gradient
    for (int64_t p = 0; p < num_pieces(); ++p)
      if (!fig.bad_tensor[size_t(p)].empty()) {
        job.nonfinite_block = piece(p).block;
        job.nonfinite_tensor = fig.bad_tensor[size_t(p)];
        break;
      }
  // The gradients of a loss-scaled pass are the scale times the loss's:
  // the norm is of the loss's, and every update divides the scale out.
  const double unscale = a.unscale ? 1.0 / job.loss_scale : 1.0;
  const double norm = std::sqrt(total) * unscale;
  updater_->publish_norm(norm, job.pass);
  // torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), at most 1.
  if (a.gate) fig.grad_scale = unscale * (a.clip > 0 ? std::min(1.0, a.clip / (norm + 1e-6)) : 1.0);
}

void EngineCore::release_ring_slot(int64_t b) { updater_->release_ring(place_.at(b).ring_slot); }

void EngineCore::start_state_read(int64_t b, int slot_index) {
  NvmeStaging& slot = nvme_staging_[size_t(slot_index)];
  if (slot.reading == b) return;
  for (auto& t : slot.writes) nvme_->wait(t);  // the slot's previous write-back has left
  slot.writes.clear();
  slot.written = -1;
  // ...and the piece's own last one, from the other slot (with one NVMe
  // piece, the previous pass's write-back of this very state).
  for (NvmeStaging& other : nvme_staging_)
    if (other.written == b)
      for (auto& t : other.writes) nvme_->wait(t);
  slot.read_begin_us = Timeline::now_us();
  for (auto [kind, buf] : {std::pair{ExtentKind::kMaster, slot.master}, {ExtentKind::kAdamM, slot.m},
                           {ExtentKind::kAdamV, slot.v}}) {
    const Extent& e = nvme_->extent(b, kind);
    slot.reads.push_back(nvme_->read(e, buf.first(e.io_bytes)));
  }
  if (compute_on_nvme(b) && state_uses_compute_copy(place_.store.format)) {
    // q8's master is the compute copy's high half and its extension: both.
    // (fp32's update writes the whole compute copy from the master.)
    const Extent& e = nvme_->extent(b, ExtentKind::kCompute);
    slot.reads.push_back(nvme_->read(e, slot.compute.first(e.io_bytes)));
  }
  if (spills_grads(b)) {
    NvmeTicket& spill = grad_spill_[size_t(b)];
    if (spill.valid()) nvme_->wait(spill);  // the read must see the whole write
    spill = {};
    const Extent& e = nvme_->extent(b, ExtentKind::kGrad);
    slot.reads.push_back(nvme_->read(e, slot.grad.first(e.io_bytes)));
  }
  slot.reading = b;
}

void EngineCore::update_piece(const UpdateJob& job, int64_t b, double grad_scale) {
  AdamHyper h = adam_hyper_;
  h.lr = job.lr;
  const AdamStep decayed = AdamStep::make(h, job.step, grad_scale);
  h.weight_decay = 0;
  const AdamStep spared = AdamStep::make(h, job.step, grad_scale);  // norms and biases (PiecePlace::runs)
  const Piece& pc = piece(b);
  BlockState& s = store_->block(size_t(pc.block));
  // The elements this rank updates: the piece, or (sharded) its slice of it,
  // `n` of them from `own` in the piece's coordinates; each run says where
  // its stretch lies in the block (the block's state slice starts at s.state_begin).
  const Range own = owned(b);
  const size_t n = own.elems();
  if (n == 0) {  // another rank's slice: its update arrives by the gather
    if (place_.at(b).ring_slot >= 0 && !spills_grads(b)) release_ring_slot(b);
    return;
  }
  const bool fp32 = place_.compute_bytes == 4;  // the compute copy is fp32
  const StateFormat format = place_.store.format;
  NvmeStaging* slot = nullptr;
  if (on_nvme(b)) {
    // Its state was read into a staging slot (kReadState), in the piece's coordinates.
    for (NvmeStaging& x : nvme_staging_)
      if (x.reading == b) slot = &x;
    STRIDER_CHECK(slot != nullptr, "the update of {} found no read of its state", place_.shards().name(spec_, b));
    for (auto& t : slot->reads) nvme_->wait(t);
    slot->reads.clear();
    slot->reading = -1;
    slot->holding = b;
    timeline_.add({Lane::kNvmeRead, "nvme read state", int32_t(pc.block), -1, job.step, slot->read_begin_us,
                   Timeline::now_us(), 0, state_read_bytes(place_, format, b, n)});
  }
  // Where the updated compute copy goes: the block's in RAM, or (on NVMe)
  // the staging slot's, in the piece's coordinates, written back with the state.
  auto compute16 = [&](const UpdateRun& run) {
    return compute_on_nvme(b) ? reinterpret_cast<uint16_t*>(slot->compute.data()) + run.at : s.compute_at(run.block);
  };
  const double t0 = Timeline::now_us();
  const std::byte* grads =
      spills_grads(b) ? slot->grad.data() : grad_host(b).data() + own.begin * place_.grad_bytes;
  const DType grad_dtype = place_.grad_bytes == 4 ? DType::kF32 : DType::kBF16;
  // Each run of tensors alike: its gradients at run.at, its state at run.at
  // in the staging slot (NVMe) or at run.block in the block (RAM); q8: whole groups.
  for (const UpdateRun& run : place_.at(b).runs()) {
    const AdamStep& st = run.decay ? decayed : spared;
    const size_t k = run.at, len = run.n, at = run.block, st_at = run.block - s.state_begin;
    const std::byte* g = grads + k * place_.grad_bytes;
    if (format == StateFormat::kQ8) {
      Q8View q;
      if (slot) {
        std::byte *m = slot->m.data(), *v = slot->v.data();
        q = q8_view(compute16(run), slot->master.data() + k, m + k, scales_after(m, n) + k / kQ8GroupElems,
                    v + k, scales_after(v, n) + k / kQ8GroupElems);
      } else {
        const size_t gi = st_at / kQ8GroupElems;
        q = {s.compute_at(at), s.ext.data() + st_at, s.m_codes.data() + st_at, s.m_scale.data() + gi,
             s.v_codes.data() + st_at, s.v_scale.data() + gi};
      }
      adam_->step_q8(st, Q8Args{q, g, grad_dtype, len, uint32_t(at), q8_salt(job.step, pc.block)});
      continue;
    }
    float *p = nullptr, *m = nullptr, *v = nullptr;
    if (slot) {
      p = reinterpret_cast<float*>(slot->master.data()) + k;
      m = reinterpret_cast<float*>(slot->m.data()) + k;
      v = reinterpret_cast<float*>(slot->v.data()) + k;
    } else {
      p = s.master.data() + st_at;
      m = s.m.data() + st_at;
      v = s.v.data() + st_at;
    }
    if (fp32) {
      // fp32 compute: the compute copy is the master itself, chunk by chunk.
      float* out = compute_on_nvme(b) ? reinterpret_cast<float*>(slot->compute.data()) + k
                                      : s.compute_f32.data() + (at - s.compute_begin);
      adam_->step(st, AdamArgs{p, m, v, g, grad_dtype, nullptr, len}, [&](size_t begin, size_t end) {
        std::memcpy(out + begin, p + begin, (end - begin) * sizeof(float));
      });
    } else {
      adam_->step(st, AdamArgs{p, m, v, g, grad_dtype, compute16(run), len, s.compute_dtype});
    }
  }
  timeline_.add({Lane::kOptimizer, "adamw", int32_t(pc.block), -1, job.step, t0, Timeline::now_us(), 0,
                 adam_bytes(format, n, place_.grad_bytes)});
  if (place_.at(b).ring_slot >= 0 && !spills_grads(b)) release_ring_slot(b);
}

void EngineCore::write_state_back(int64_t b, int64_t step) {
  NvmeStaging* slot = nullptr;
  for (NvmeStaging& x : nvme_staging_)
    if (x.holding == b) slot = &x;
  STRIDER_CHECK(slot != nullptr, "the write-back of {} found no updated state", place_.shards().name(spec_, b));
  slot->holding = -1;
  slot->written = b;
  const double w0 = Timeline::now_us();
  const int32_t blk = int32_t(piece(b).block);
  for (auto [kind, buf] : {std::pair{ExtentKind::kMaster, slot->master}, {ExtentKind::kAdamM, slot->m},
                           {ExtentKind::kAdamV, slot->v}, {ExtentKind::kCompute, slot->compute}}) {
    if (kind == ExtentKind::kCompute && !compute_on_nvme(b)) continue;
    const Extent& e = nvme_->extent(b, kind);
    slot->writes.push_back(nvme_->write(e, buf.first(e.io_bytes), [this, blk, w0, step](std::exception_ptr err) {
      if (!err) timeline_.add({Lane::kNvmeWrite, "nvme write state", blk, -1, step, w0, Timeline::now_us()});
    }));
  }
  if (compute_on_nvme(b)) updater_->compute_written(b, slot->writes.back());  // the next load's read of it waits for this
}

}  // namespace strider
