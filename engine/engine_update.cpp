// The engine's host lanes: the updater thread (CPU AdamW per block, global
// norm, clipping, the ranks' collectives) over the block state in RAM or on
// NVMe (engine_state.cpp reads and writes it between steps).
#include <cmath>
#include <cstring>
#include <limits>
#include <fmt/format.h>

#include "engine/engine.h"
#include "engine/collectives.h"
#include "host/adam_q8.h"
#include "host/bf16.h"
#include "host/error.h"
#include "host/grad_norm.h"

namespace strider {
namespace {

// Bytes AdamW reads and writes per element (the optimizer lane's figure):
// fp32 master, m, v read and written; q8 the compute copy, the extension and
// both codes read and written plus the groups' scales; and the gradient.
uint64_t adam_bytes(StateFormat f, size_t n, size_t grad_bytes) {
  const uint64_t state = f == StateFormat::kFp32 ? 24 * n : 10 * n + 16 * (n / kQ8GroupElems);
  return state + n * grad_bytes;
}

// One piece's q8 state, given where each kind's bytes are: the extension,
// and codes followed by their groups' scales for m and v.
Q8View q8_view(uint16_t* hi, std::byte* ext, std::byte* m, float* m_scale, std::byte* v, float* v_scale) {
  return {hi, reinterpret_cast<uint8_t*>(ext), reinterpret_cast<uint8_t*>(m), m_scale,
          reinterpret_cast<uint8_t*>(v), v_scale};
}
float* scales_after(std::byte* codes, size_t n) { return reinterpret_cast<float*>(codes + n); }

// The simulator's price of a q8 update against an fp32 one on the same CPU:
// the q8 kernel is compute-bound where the fp32 one is memory-bound.
// Measured by build/bench/bench_adam --sizes 16 --reps 3 (16M parameters, bf16
// gradients, AVX-512, 2 threads of the 2-core development machine): fp32
// 1566 M parameters/s, q8 903 M/s, so 1.73 times the time. A CPU with more
// cores per memory channel narrows the gap; no such machine has been measured.
constexpr double kQ8AdamTimeRatio = 1566.0 / 903.0;

// "nan", "inf" or "-inf" (fmt prints a NaN's sign bit: "-nan").
std::string nonfinite_text(double x) { return std::isnan(x) ? "nan" : fmt::format("{}", x); }

// Marks the job skipped (the first reason stands).
void skip(auto& job, std::string reason) {
  if (job.skipped) return;
  job.skipped = true;
  job.skip_reason = std::move(reason);
}

}  // namespace

std::string Engine::first_non_finite(int64_t p, const float* values) const {
  const Piece& pc = piece(p);
  for (const TensorSlot& t : place_.layouts[size_t(pc.block)].slots()) {
    const size_t lo = std::max(pc.begin, t.offset_elems), hi = std::min(pc.end, t.offset_elems + t.numel);
    for (size_t i = lo; i < hi; ++i)
      if (!std::isfinite(values[i - pc.begin])) return t.name;
  }
  return "(padding)";
}

std::string Engine::first_non_finite_grad(int64_t p, const std::byte* grads, Range in) const {
  std::vector<float> values(piece(p).elems(), 0.0f);
  const size_t at = in.begin - piece(p).begin;
  if (place_.grad_bytes == 4)
    std::memcpy(values.data() + at, grads + at * 4, in.elems() * 4);
  else
    bf16_to_float({reinterpret_cast<const uint16_t*>(grads) + at, in.elems()},
                  std::span<float>(values).subspan(at, in.elems()));
  const std::string name = first_non_finite(p, values.data());
  return name == "(padding)" && std::all_of(values.begin(), values.end(), [](float x) { return std::isfinite(x); })
             ? ""
             : name;
}

std::string Engine::first_non_finite_param() {
  for (int64_t b = 0; b < place_.blocks; ++b) {
    std::vector<float> w(place_.layouts[size_t(b)].total_elems());
    read_state(b, ExtentKind::kMaster, w);
    if (std::isfinite(sum_squares(w))) continue;
    for (int64_t p = place_.shards.first_of(b); p < place_.shards.end_of(b); ++p) {
      std::string name = first_non_finite(p, w.data() + piece(p).begin);
      if (name != "(padding)") return name;
    }
  }
  return "";
}

void Engine::inject_nonfinite_gradient(int64_t b) {
  STRIDER_CHECK(b >= 0 && b < place_.blocks, "inject_nonfinite_gradient: block {} out of range", b);
  std::lock_guard lk(mu_);
  fault_block_ = b;
  fault_pass_ = passes_ + 1;
}

void Engine::skip_piece(const UpdateJob& job, int64_t b) {
  if (spills_grads(b)) {
    // Its ring slot is freed by the spill's completion; the spill must be
    // done before the next pass writes the extent again.
    NvmeTicket& spill = grad_spill_[size_t(b)];
    if (spill.valid()) nvme_->wait(spill);
    spill = {};
  } else if (place_.at(b).ring_slot >= 0) {
    release_ring_slot(b);
  }
  {
    std::lock_guard lk(mu_);
    updated_[size_t(b)] = job.pass;
  }
  cv_.notify_all();
}

// Replicated state: the whole gradient summed on every rank. Sharded: only
// this rank's slice of it (the rest stays this rank's own micro-batches').
void Engine::sum_grads_over_ranks(int64_t p) {
  if (dist_update_->ranks().solo()) return;
  const size_t n = piece(p).elems();
  std::byte* g = grad_host(p).data();
  const std::vector<size_t>& cut = place_.at(p).slices;
  auto sum = [&](std::span<float> x) {
    if (sharded()) dist_update_->reduce_scatter_sum(x, cut);
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
  if (!sharded()) {
    float_to_bf16(f, g16);
    return;
  }
  const size_t lo = cut[size_t(config_.state_shard)], hi = cut[size_t(config_.state_shard) + 1];
  float_to_bf16(f.subspan(lo, hi - lo), g16.subspan(lo, hi - lo));
}

void Engine::gather_compute(int64_t p) {
  if (!sharded()) return;
  if (shared_arena_) {  // one compute copy on the machine: the ranks' slices are in it once all have written
    dist_update_->barrier();
    return;
  }
  const std::vector<size_t>& cut = place_.at(p).slices;
  for (size_t r = 0; r < cut.size(); ++r) slice_bytes_[r] = cut[r] * place_.compute_bytes;
  const std::span<std::byte> c = store_->block(size_t(piece(p).block)).compute_bytes();
  dist_update_->all_gather(c.subspan(piece(p).begin * place_.compute_bytes, piece(p).elems() * place_.compute_bytes),
                           slice_bytes_);
}

void Engine::updater_main() {
  for (;;) {
    std::shared_ptr<UpdateJob> job;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      job = jobs_.front();
      jobs_.pop_front();
    }
    try {
      // Gradients land piece by piece in place_.landing order (the head's, then
      // backward's); every per-piece figure is indexed by piece.
      const int64_t P = num_pieces();
      std::vector<double> sumsq(size_t(P), 0.0);
      std::vector<std::string> bad_tensor(static_cast<size_t>(P));  // per piece: first non-finite gradient tensor
      const bool clip = config_.clip_norm > 0;
      int64_t fault_piece = -1;
      {
        std::lock_guard lk(mu_);
        // The first of the block's pieces to land (for the head: what lands first of the whole step).
        if (fault_pass_ == job->pass && fault_block_ >= 0)
          for (int64_t p : place_.landing)
            if (piece(p).block == fault_block_) {
              fault_piece = p;
              break;
            }
      }
      auto land = [&](int64_t b) {
        {
          std::unique_lock lk(mu_);
          cv_.wait(lk, [&] { return grads_recorded_[size_t(b)] >= job->pass || stopping_; });
          STRIDER_CHECK(!stopping_, "the engine stopped before {}'s gradients were copied out", place_.shards.name(spec_, b));
        }
        grads_ready_[size_t(b)]->synchronize();
        sum_grads_over_ranks(b);
        // The summed gradients: the whole piece's, or (sharded) this rank's slice of them.
        const Range own = owned(b);
        const size_t n = own.elems(), at = (own.begin - piece(b).begin) * place_.grad_bytes;
        std::byte* g = grad_host(b).data();
        if (b == fault_piece && n > 0 && own.begin == piece(b).begin) {  // the rank holding its first element
          if (place_.grad_bytes == 4) reinterpret_cast<float*>(g)[0] = std::numeric_limits<float>::quiet_NaN();
          else reinterpret_cast<uint16_t*>(g)[0] = 0x7FC0;  // a bf16 NaN
        }
        if (place_.grad_bytes == 4) sumsq[size_t(b)] = sum_squares({reinterpret_cast<const float*>(g + at), n});
        else sumsq[size_t(b)] = sum_squares_bf16({reinterpret_cast<const uint16_t*>(g + at), n});
        // Sharded: the piece's sum of squares over the ranks' slices (rank order: the same bits everywhere).
        if (sharded()) dist_update_->all_reduce_sum(std::span<double>(&sumsq[size_t(b)], 1));
        // Named now: a ring slot may hold other gradients by the time it matters.
        if (!std::isfinite(sumsq[size_t(b)])) {
          bad_tensor[size_t(b)] = first_non_finite_grad(b, g, own);
          if (bad_tensor[size_t(b)].empty())
            bad_tensor[size_t(b)] = sharded() ? "(in another rank's slice)" : "(none: the sum of squares overflowed)";
        }
        if (spills_grads(b) && n == 0) {
          release_ring_slot(b);  // nothing of it is this rank's to keep
        } else if (spills_grads(b)) {
          // The norm waits for every piece: park this one's gradients (this
          // rank's slice) on NVMe and free the ring slot once they are written.
          const Extent& e = nvme_->extent(b, ExtentKind::kGrad);
          const double w0 = Timeline::now_us();
          const int32_t blk = int32_t(piece(b).block);
          // O_DIRECT writes whole aligned pages: a slice goes to the slot's start first.
          if (at > 0) std::memmove(g, g + at, n * place_.grad_bytes);
          grad_spill_[size_t(b)] = nvme_->write(
              e, grad_host(b).first(e.io_bytes), [this, b, blk, w0, step = job->step, bytes = n * place_.grad_bytes](std::exception_ptr err) {
                if (err) {
                  std::lock_guard lk(mu_);
                  if (!updater_error_) updater_error_ = err;
                } else {
                  timeline_.add({Lane::kNvmeWrite, "nvme write grads", blk, -1, step, w0, Timeline::now_us(),
                                 0, uint64_t(bytes)});
                }
                release_ring_slot(b);
              });
        }
      };
      // The loss of the pass: its D2H precedes the head's gradients on the
      // d2h stream, so it is there once they are.
      auto check_loss = [&] {
        head_stats_ready_->synchronize();
        double loss = 0;
        for (int64_t m = 0; m < config_.accumulation; ++m) loss += head_stats_host_[size_t(m)];
        // One decision for every rank: any rank's non-finite loss skips the step everywhere.
        if (dist_update_->any(!std::isfinite(loss)))
          skip(*job, std::isfinite(loss) ? std::string("another rank's loss is not finite")
                                         : "loss is " + nonfinite_text(loss));
      };
      // Which block to name: the first in forward order with a bad gradient.
      auto name_bad_block = [&] {
        for (int64_t b = 0; b < P; ++b)
          if (!bad_tensor[size_t(b)].empty()) {
            job->nonfinite_block = piece(b).block;
            job->nonfinite_tensor = bad_tensor[size_t(b)];
            return;
          }
      };
      auto publish_norm = [&] {
        double total = 0;
        for (double x : sumsq) total += x;  // piece order: independent of arrival order
        std::lock_guard lk(mu_);
        last_norm_ = std::sqrt(total);
        norm_pass_ = job->pass;
      };
      if (!clip) {
        // Updates overlap backward: the loss and each piece's gradient are
        // checked just before its update. Only the first piece to land can
        // still skip the step; a later one finds pieces already updated.
        for (size_t i = 0; i < place_.landing.size(); ++i) {
          const int64_t b = place_.landing[i];
          land(b);
          if (i == 0) check_loss();
          if (!job->skipped && !std::isfinite(sumsq[size_t(b)])) {
            STRIDER_CHECK(i == 0,
                          "step {}: block {}'s gradient is not finite ({}; first non-finite tensor: {}) after "
                          "{} earlier pieces of the step were updated; without clipping updates overlap backward, "
                          "so the step is partly applied: the run stops here, and nothing of this step may be saved "
                          "(the last checkpoint stays). Clipping (--clip) checks every gradient before any update.",
                          job->step, piece(b).block, place_.shards.name(spec_, b), bad_tensor[size_t(b)], i);
            skip(*job, fmt::format("the gradient of block {} is not finite", piece(b).block));
          }
          if (job->skipped) skip_piece(*job, b);
          else update_piece(*job, place_.landing, i, 1.0);
        }
        if (job->skipped) name_bad_block();
        publish_norm();
        cv_.notify_all();
      } else {
        for (int64_t b : place_.landing) land(b);
        check_loss();
        double total = 0;
        for (double x : sumsq) total += x;
        if (!job->skipped && !std::isfinite(total)) skip(*job, "gradient norm is " + nonfinite_text(std::sqrt(total)));
        if (job->skipped) name_bad_block();
        publish_norm();
        cv_.notify_all();
        if (job->skipped) {
          for (int64_t b = 0; b < P; ++b) skip_piece(*job, b);
        } else {
          // torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), at most 1.
          const double coef = std::min(1.0, config_.clip_norm / (last_norm_ + 1e-6));
          std::vector<int64_t> order(static_cast<size_t>(P));
          for (int64_t b = 0; b < P; ++b) order[size_t(b)] = b;  // forward order
          for (size_t i = 0; i < order.size(); ++i) update_piece(*job, order, i, coef);
        }
      }
    } catch (...) {
      std::lock_guard lk(mu_);
      updater_error_ = std::current_exception();
      cv_.notify_all();
      return;
    }
  }
}

void Engine::release_ring_slot(int64_t b) {
  {
    std::lock_guard lk(mu_);
    ++ring_released_[size_t(place_.at(b).ring_slot)];
  }
  cv_.notify_all();
}

void Engine::start_state_read(int64_t b, int slot_index) {
  NvmeStaging& slot = nvme_staging_[size_t(slot_index)];
  if (slot.reading == b) return;
  for (auto& t : slot.writes) nvme_->wait(t);  // the slot's previous write-back has left
  slot.writes.clear();
  slot.read_begin_us = Timeline::now_us();
  for (auto [kind, buf] : {std::pair{ExtentKind::kMaster, slot.master}, {ExtentKind::kAdamM, slot.m},
                           {ExtentKind::kAdamV, slot.v}}) {
    const Extent& e = nvme_->extent(b, kind);
    slot.reads.push_back(nvme_->read(e, buf.first(e.io_bytes)));
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

void Engine::update_piece(const UpdateJob& job, const std::vector<int64_t>& order, size_t pos, double grad_scale) {
  const int64_t b = order[pos];
  AdamHyper h = config_.adam;
  h.lr = job.lr;
  const AdamStep st = AdamStep::make(h, job.step, grad_scale);
  const Piece& pc = piece(b);
  BlockState& s = store_->block(size_t(pc.block));
  // The elements this rank updates: the piece, or (sharded) its slice of it,
  // at `at` in the block, `st_at` in the block's state slice.
  const Range own = owned(b);
  const size_t n = own.elems(), at = own.begin, st_at = own.begin - s.state_begin;
  if (n == 0) {  // another rank's slice: its update arrives by the gather
    if (place_.at(b).ring_slot >= 0 && !spills_grads(b)) release_ring_slot(b);
    gather_compute(b);
    std::lock_guard lk(mu_);
    updated_[size_t(b)] = job.pass;
    cv_.notify_all();
    return;
  }
  const bool fp32 = !s.compute_f32.empty();
  const StateFormat format = config_.optimizer_state;
  float *p = nullptr, *m = nullptr, *v = nullptr;
  Q8View q;
  if (!on_nvme(b) && format == StateFormat::kFp32) {
    p = s.master.data() + st_at;
    m = s.m.data() + st_at;
    v = s.v.data() + st_at;
  } else if (!on_nvme(b)) {
    const size_t g = st_at / kQ8GroupElems;
    q = {s.compute.data() + at, s.ext.data() + st_at, s.m_codes.data() + st_at, s.m_scale.data() + g,
         s.v_codes.data() + st_at, s.v_scale.data() + g};
  }
  NvmeStaging* slot = nullptr;
  if (on_nvme(b)) {
    // Its state is read ahead into one slot (or read now into the one the
    // previous NVMe update did not use); the next NVMe piece's goes to the other.
    int k = nvme_staging_[0].reading == b ? 0 : nvme_staging_[1].reading == b ? 1 : 1 - last_staging_;
    start_state_read(b, k);  // a no-op when read ahead
    slot = &nvme_staging_[size_t(k)];
    last_staging_ = k;
  }
  for (size_t i = pos + 1; i < order.size(); ++i)
    if (on_nvme(order[i])) {
      start_state_read(order[i], 1 - last_staging_);
      break;
    }
  if (slot) {
    for (auto& t : slot->reads) nvme_->wait(t);
    slot->reads.clear();
    slot->reading = -1;
    timeline_.add({Lane::kNvmeRead, "nvme read state", int32_t(pc.block), -1, job.step, slot->read_begin_us,
                   Timeline::now_us(), 0, uint64_t(state_bytes(n) + (spills_grads(b) ? n * place_.grad_bytes : 0))});
    p = reinterpret_cast<float*>(slot->master.data());
    m = reinterpret_cast<float*>(slot->m.data());
    v = reinterpret_cast<float*>(slot->v.data());
    if (format == StateFormat::kQ8)
      q = q8_view(s.compute.data() + at, slot->master.data(), slot->m.data(), scales_after(slot->m.data(), n),
                  slot->v.data(), scales_after(slot->v.data(), n));
  }
  const double t0 = Timeline::now_us();
  const std::byte* grads =
      spills_grads(b) ? slot->grad.data() : grad_host(b).data() + (at - pc.begin) * place_.grad_bytes;
  AdamArgs args{p, m, v, grads, place_.grad_bytes == 4 ? DType::kF32 : DType::kBF16,
                fp32 ? nullptr : s.compute.data() + at, n};
  if (format == StateFormat::kQ8) {
    adam_->step_q8(st, Q8Args{q, grads, args.grad_dtype, n, uint32_t(at), q8_salt(job.step, pc.block)});
  } else if (fp32) {
    // fp32 compute: the compute copy is the master itself, chunk by chunk.
    float* out = s.compute_f32.data() + at;
    adam_->step(st, args, [&](size_t begin, size_t end) {
      std::memcpy(out + begin, p + begin, (end - begin) * sizeof(float));
    });
  } else {
    adam_->step(st, args);
  }
  timeline_.add({Lane::kOptimizer, "adamw", int32_t(pc.block), -1, job.step, t0, Timeline::now_us(), 0,
                 adam_bytes(format, n, place_.grad_bytes)});
  if (place_.at(b).ring_slot >= 0 && !spills_grads(b)) release_ring_slot(b);
  if (slot) {
    const double w0 = Timeline::now_us();
    const int32_t blk = int32_t(pc.block);
    for (auto [kind, buf] : {std::pair{ExtentKind::kMaster, slot->master}, {ExtentKind::kAdamM, slot->m},
                             {ExtentKind::kAdamV, slot->v}}) {
      const Extent& e = nvme_->extent(b, kind);
      slot->writes.push_back(nvme_->write(e, buf.first(e.io_bytes), [this, blk, w0, step = job.step](std::exception_ptr err) {
        if (!err) timeline_.add({Lane::kNvmeWrite, "nvme write state", blk, -1, step, w0, Timeline::now_us()});
      }));
    }
  }
  gather_compute(b);  // sharded: the other ranks' slices of the new compute copy
  {
    std::lock_guard lk(mu_);
    updated_[size_t(b)] = job.pass;
  }
  cv_.notify_all();
}

// The updater on virtual clocks, called where the real one would act: per
// piece as its gradients land (one pass for the norm: 4 of the 28 bytes per
// parameter AdamW moves; without clipping the update follows at once; with
// clipping a ring block's gradients are spilled to NVMe), then, with clipping,
// every update in forward order once the norm is known. The next NVMe piece's
// state is read while the current one updates.
void Engine::sim_landed(int64_t b) {
  const CostModel& cm = sim_->model();
  SimStep& st = sim_step_;
  const double landed = sim_->event_time_us(*grads_ready_[size_t(b)]);
  st.all_landed = std::max(st.all_landed, landed);
  const uint64_t n = piece(b).elems();
  const int32_t blk = int32_t(piece(b).block);
  if (sharded()) {
    // The piece's collectives, on the updater before its norm: the
    // reduce-scatter of the gradient, the sum of squares, and the compute
    // copy's all-gather (a barrier when the machine's ranks share one copy);
    // each rank moves (W - 1) / W of the piece's bytes each way.
    const double w = config_.state_shards, share = (w - 1) / w;
    uint64_t bytes = uint64_t(share * double(n * place_.grad_bytes));
    if (config_.shared_compute_file.empty()) bytes += uint64_t(share * double(n * place_.compute_bytes));
    SimInterval c = sim_optimizer_.run(landed, cm.collective_us(bytes) + 2 * cm.collective_latency_us);
    timeline_.add({Lane::kOptimizer, "collectives", blk, -1, st.job.step, c.begin_us, c.end_us, 0, bytes});
  }
  SimInterval t = sim_optimizer_.run(landed, cm.adam_us(n) * double(place_.grad_bytes) / 28.0);
  timeline_.add({Lane::kOptimizer, "grad norm", blk, -1, st.job.step, t.begin_us, t.end_us, 0, n * place_.grad_bytes});
  st.norm_known = std::max(st.norm_known, t.end_us);
  if (config_.clip_norm <= 0) {
    sim_update(b, t.end_us);
  } else if (spills_grads(b)) {
    SimInterval w = sim_nvme_write_.run(t.end_us, cm.nvme_write_us(n * place_.grad_bytes));
    timeline_.add({Lane::kNvmeWrite, "nvme write grads", blk, -1, st.job.step, w.begin_us, w.end_us, 0, n * place_.grad_bytes});
    sim_->record_at(*sim_ring_free_[size_t(place_.at(b).ring_slot)], w.end_us);
    st.spilled_us[size_t(b)] = w.end_us;
  }
}

void Engine::sim_update(int64_t b, double ready) {
  const CostModel& cm = sim_->model();
  SimStep& st = sim_step_;
  const uint64_t n = piece(b).elems();
  auto span = [&](Lane lane, const char* name, SimInterval t, uint64_t bytes) {
    timeline_.add({lane, name, int32_t(piece(b).block), -1, st.job.step, t.begin_us, t.end_us, 0, bytes});
  };
  if (on_nvme(b)) {
    const uint64_t bytes = state_bytes(n) + (spills_grads(b) ? n * place_.grad_bytes : 0);
    SimInterval r = sim_nvme_read_.run(std::max(st.read_ahead_from, st.spilled_us[size_t(b)]), cm.nvme_read_us(bytes));
    span(Lane::kNvmeRead, "nvme read state", r, bytes);
    ready = std::max(ready, r.end_us);
  }
  const bool q8 = config_.optimizer_state == StateFormat::kQ8;
  // Sharded, a rank updates its slice. Ranks on one machine (sharing a
  // compute copy) share its memory bus too: their slices together take what
  // the whole piece would, so each rank's lane is busy that long. Ranks on
  // machines of their own each take their slice's time.
  const uint64_t updated = sharded() && config_.shared_compute_file.empty() ? owned(b).elems() : n;
  SimInterval t = sim_optimizer_.run(ready, cm.adam_us(updated) * (q8 ? kQ8AdamTimeRatio : 1.0));
  span(Lane::kOptimizer, "adamw", t, adam_bytes(config_.optimizer_state, n, place_.grad_bytes));
  st.read_ahead_from = t.begin_us;
  if (on_nvme(b))
    span(Lane::kNvmeWrite, "nvme write state", sim_nvme_write_.run(t.end_us, cm.nvme_write_us(state_bytes(n))),
         state_bytes(n));
  if (place_.at(b).ring_slot >= 0 && !spills_grads(b))
    sim_->record_at(*sim_ring_free_[size_t(place_.at(b).ring_slot)], t.end_us);
  sim_->record_at(*sim_update_done_[size_t(b)], t.end_us);
  st.last_update = std::max(st.last_update, t.end_us);
}

double Engine::sim_finish() {
  SimStep& st = sim_step_;
  const bool clip = config_.clip_norm > 0;
  if (clip)
    for (int64_t p = 0; p < num_pieces(); ++p) sim_update(p, st.norm_known);
  // As in a real run, step() returns once the norm is known: after every
  // update without clipping (the norm is published last), before them with.
  sim_step_end_us_ = std::max(st.all_landed, clip ? st.norm_known : st.last_update);
  return sim_step_end_us_;
}

uint64_t Engine::state_bytes(size_t n) const {
  uint64_t total = 0;
  for (StateKind k : {StateKind::kMaster, StateKind::kAdamM, StateKind::kAdamV})
    total += state_kind_bytes(config_.optimizer_state, k, n);
  return total;
}

}  // namespace strider
