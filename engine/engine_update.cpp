// The engine's host lanes: the updater thread (CPU AdamW per block, global
// norm, clipping) and the block state it reads and writes in RAM or on NVMe.
#include <cmath>
#include <cstring>
#include <limits>
#include <fmt/format.h>

#include "engine/engine.h"
#include "host/bf16.h"
#include "host/error.h"
#include "host/grad_norm.h"

namespace strider {
namespace {

// The host-resident span of one kind of a block's fp32 state.
std::span<float> host_state(BlockState& s, ExtentKind kind) {
  return kind == ExtentKind::kMaster ? s.master : kind == ExtentKind::kAdamM ? s.m : s.v;
}

// "nan", "inf" or "-inf" (fmt prints a NaN's sign bit: "-nan").
std::string nonfinite_text(double x) { return std::isnan(x) ? "nan" : fmt::format("{}", x); }

// Marks the job skipped (the first reason stands).
void skip(auto& job, std::string reason) {
  if (job.skipped) return;
  job.skipped = true;
  job.skip_reason = std::move(reason);
}

}  // namespace

std::string Engine::first_non_finite(int64_t b, const float* values) const {
  for (const TensorSlot& t : layouts_[size_t(b)].slots())
    for (size_t i = 0; i < t.numel; ++i)
      if (!std::isfinite(values[t.offset_elems + i])) return t.name;
  return "(padding)";
}

std::string Engine::first_non_finite_param() {
  for (int64_t b = 0; b < num_blocks_; ++b) {
    std::vector<float> w(layouts_[size_t(b)].total_elems());
    read_state(b, ExtentKind::kMaster, w);
    if (!std::isfinite(sum_squares(w))) return first_non_finite(b, w.data());
  }
  return "";
}

void Engine::inject_nonfinite_gradient(int64_t b) {
  STRIDER_CHECK(b >= 0 && b < num_blocks_, "inject_nonfinite_gradient: block {} out of range", b);
  std::lock_guard lk(mu_);
  fault_block_ = b;
  fault_pass_ = passes_ + 1;
}

void Engine::skip_block(const UpdateJob& job, int64_t b) {
  if (spills_grads(b)) {
    // Its ring slot is freed by the spill's completion; the spill must be
    // done before the next pass writes the extent again.
    NvmeTicket& spill = grad_spill_[size_t(b)];
    if (spill.valid()) nvme_->wait(spill);
    spill = {};
  } else if (ring_slot_[size_t(b)] >= 0) {
    release_ring_slot(b);
  }
  {
    std::lock_guard lk(mu_);
    updated_[size_t(b)] = job.pass;
  }
  cv_.notify_all();
}

Engine::NvmeStaging& Engine::idle_staging() {
  // Outside steps (finish_updates() first), slot 0 is free once its last
  // write-back has left.
  NvmeStaging& slot = nvme_staging_[0];
  for (auto& t : slot.writes) nvme_->wait(t);
  for (auto& t : slot.reads) nvme_->wait(t);
  slot.writes.clear();
  slot.reads.clear();
  slot.reading = -1;
  return slot;
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
      // Gradients land in backward order: head, B-2, ..., 0.
      std::vector<double> sumsq(size_t(num_blocks_), 0.0);
      std::vector<std::string> bad_tensor(static_cast<size_t>(num_blocks_));  // per block: first non-finite gradient tensor
      const bool clip = config_.clip_norm > 0;
      auto land = [&](int64_t b) {
        {
          std::unique_lock lk(mu_);
          cv_.wait(lk, [&] { return grads_recorded_[size_t(b)] >= job->pass || stopping_; });
          STRIDER_CHECK(!stopping_, "the engine stopped before block {}'s gradients were copied out", b);
        }
        grads_ready_[b]->synchronize();
        const size_t n = layouts_[size_t(b)].total_elems();
        float* g = reinterpret_cast<float*>(grad_host(b).data());
        {
          std::lock_guard lk(mu_);
          if (fault_block_ == b && fault_pass_ == job->pass) g[0] = std::numeric_limits<float>::quiet_NaN();
        }
        sumsq[size_t(b)] = sum_squares({g, n});
        // Named now: a ring slot may hold other gradients by the time it matters.
        if (!std::isfinite(sumsq[size_t(b)])) bad_tensor[size_t(b)] = first_non_finite(b, g);
        if (spills_grads(b)) {
          // The norm waits for every block: park this one's gradients on NVMe
          // and free the ring slot once they are written.
          const Extent& e = nvme_->extent(b, ExtentKind::kGrad);
          const double w0 = Timeline::now_us();
          grad_spill_[size_t(b)] = nvme_->write(
              e, grad_host(b).first(e.io_bytes), [this, b, w0, step = job->step, bytes = n * 4](std::exception_ptr err) {
                if (err) {
                  std::lock_guard lk(mu_);
                  if (!updater_error_) updater_error_ = err;
                } else {
                  timeline_.add({Lane::kNvmeWrite, "nvme write grads", int32_t(b), -1, step, w0, Timeline::now_us(),
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
        if (!std::isfinite(loss)) skip(*job, "loss is " + nonfinite_text(loss));
      };
      // Which block to name: the first in forward order with a bad gradient.
      auto name_bad_block = [&] {
        for (int64_t b = 0; b <= head_; ++b)
          if (!bad_tensor[size_t(b)].empty()) {
            job->nonfinite_block = b;
            job->nonfinite_tensor = bad_tensor[size_t(b)];
            return;
          }
      };
      auto publish_norm = [&] {
        double total = 0;
        for (double x : sumsq) total += x;  // block order: independent of arrival order
        std::lock_guard lk(mu_);
        last_norm_ = std::sqrt(total);
        norm_pass_ = job->pass;
      };
      if (!clip) {
        // Updates overlap backward: the loss and each block's gradient are
        // checked just before its update. Only the head's (the first) can
        // still skip the step; a later one finds blocks already updated.
        for (int64_t b = head_; b >= 0; --b) {
          land(b);
          if (b == head_) check_loss();
          if (!job->skipped && !std::isfinite(sumsq[size_t(b)])) {
            STRIDER_CHECK(b == head_,
                          "step {}: block {}'s gradient is not finite (first non-finite tensor: {}) after blocks "
                          "{}..{} were updated; without clipping updates overlap backward, so the step is partly "
                          "applied: the run stops here, and nothing of this step may be saved (the last checkpoint "
                          "stays). Clipping (--clip) checks every gradient before any update.",
                          job->step, b, bad_tensor[size_t(b)], head_, b + 1);
            skip(*job, fmt::format("the gradient of block {} is not finite", b));
          }
          if (job->skipped) skip_block(*job, b);
          else update_block(*job, b, 1.0, b - 1);
        }
        if (job->skipped) name_bad_block();
        publish_norm();
        cv_.notify_all();
      } else {
        for (int64_t b = head_; b >= 0; --b) land(b);
        check_loss();
        double total = 0;
        for (double x : sumsq) total += x;
        if (!job->skipped && !std::isfinite(total)) skip(*job, "gradient norm is " + nonfinite_text(std::sqrt(total)));
        if (job->skipped) name_bad_block();
        publish_norm();
        cv_.notify_all();
        if (job->skipped) {
          for (int64_t b = 0; b <= head_; ++b) skip_block(*job, b);
        } else {
          // torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), at most 1.
          const double coef = std::min(1.0, config_.clip_norm / (last_norm_ + 1e-6));
          for (int64_t b = 0; b <= head_; ++b) update_block(*job, b, coef, b < head_ ? b + 1 : -1);  // forward order
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
    ++ring_released_[size_t(ring_slot_[size_t(b)])];
  }
  cv_.notify_all();
}

void Engine::start_state_read(int64_t b) {
  NvmeStaging& slot = nvme_staging_[size_t(nvme_slot_[b] % 2)];
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

void Engine::update_block(const UpdateJob& job, int64_t b, double grad_scale, int64_t next) {
  AdamHyper h = config_.adam;
  h.lr = job.lr;
  const AdamStep st = AdamStep::make(h, job.step, grad_scale);
  BlockState& s = store_->block(size_t(b));
  const size_t n = s.elems();
  const bool fp32 = !s.compute_f32.empty();
  float *p = s.master.data(), *m = s.m.data(), *v = s.v.data();
  NvmeStaging* slot = nullptr;
  if (on_nvme(b)) {
    start_state_read(b);  // a no-op when read ahead
    slot = &nvme_staging_[size_t(nvme_slot_[b] % 2)];
  }
  for (int64_t nb = next; nb >= 0 && nb <= head_; nb += (next > b ? 1 : -1))
    if (on_nvme(nb)) {
      start_state_read(nb);
      break;
    }
  if (slot) {
    for (auto& t : slot->reads) nvme_->wait(t);
    slot->reads.clear();
    slot->reading = -1;
    timeline_.add({Lane::kNvmeRead, "nvme read state", int32_t(b), -1, job.step, slot->read_begin_us,
                   Timeline::now_us(), 0, uint64_t((spills_grads(b) ? 4 : 3) * n * sizeof(float))});
    p = reinterpret_cast<float*>(slot->master.data());
    m = reinterpret_cast<float*>(slot->m.data());
    v = reinterpret_cast<float*>(slot->v.data());
  }
  const double t0 = Timeline::now_us();
  const std::byte* grads = spills_grads(b) ? slot->grad.data() : grad_host(b).data();
  AdamArgs args{p, m, v, grads, DType::kF32, fp32 ? nullptr : s.compute.data(), n};
  if (fp32) {
    // fp32 compute: the compute copy is the master itself, chunk by chunk.
    adam_->step(st, args, [&](size_t begin, size_t end) {
      std::memcpy(s.compute_f32.data() + begin, p + begin, (end - begin) * sizeof(float));
    });
  } else {
    adam_->step(st, args);
  }
  timeline_.add({Lane::kOptimizer, "adamw", int32_t(b), -1, job.step, t0, Timeline::now_us(), 0,
                 uint64_t(n * 28)});
  if (ring_slot_[size_t(b)] >= 0 && !spills_grads(b)) release_ring_slot(b);
  if (slot) {
    const double w0 = Timeline::now_us();
    for (auto [kind, buf] : {std::pair{ExtentKind::kMaster, slot->master}, {ExtentKind::kAdamM, slot->m},
                             {ExtentKind::kAdamV, slot->v}}) {
      const Extent& e = nvme_->extent(b, kind);
      slot->writes.push_back(nvme_->write(e, buf.first(e.io_bytes), [this, b, w0, step = job.step](std::exception_ptr err) {
        if (!err) timeline_.add({Lane::kNvmeWrite, "nvme write state", int32_t(b), -1, step, w0, Timeline::now_us()});
      }));
    }
  }
  {
    std::lock_guard lk(mu_);
    updated_[size_t(b)] = job.pass;
  }
  cv_.notify_all();
}

// The updater on virtual clocks, called where the real one would act: per
// block as its gradients land (one pass for the norm: 4 of the 28 bytes per
// parameter AdamW moves; without clipping the update follows at once; with
// clipping a ring block's gradients are spilled to NVMe), then, with clipping,
// every update in forward order once the norm is known. The next NVMe block's
// state is read while the current one updates.
void Engine::sim_landed(int64_t b) {
  const CostModel& cm = sim_->model();
  SimStep& st = sim_step_;
  const double landed = sim_->event_time_us(*grads_ready_[b]);
  st.all_landed = std::max(st.all_landed, landed);
  const uint64_t n = layouts_[size_t(b)].total_elems();
  SimInterval t = sim_optimizer_.run(landed, cm.adam_us(n) * 4.0 / 28.0);
  timeline_.add({Lane::kOptimizer, "grad norm", int32_t(b), -1, st.job.step, t.begin_us, t.end_us, 0, n * 4});
  st.norm_known = std::max(st.norm_known, t.end_us);
  if (config_.clip_norm <= 0) {
    sim_update(b, t.end_us);
  } else if (spills_grads(b)) {
    SimInterval w = sim_nvme_write_.run(t.end_us, cm.nvme_write_us(n * 4));
    timeline_.add({Lane::kNvmeWrite, "nvme write grads", int32_t(b), -1, st.job.step, w.begin_us, w.end_us, 0, n * 4});
    sim_->record_at(*sim_ring_free_[size_t(ring_slot_[size_t(b)])], w.end_us);
    st.spilled_us[size_t(b)] = w.end_us;
  }
}

void Engine::sim_update(int64_t b, double ready) {
  const CostModel& cm = sim_->model();
  SimStep& st = sim_step_;
  const uint64_t n = layouts_[size_t(b)].total_elems();
  auto span = [&](Lane lane, const char* name, SimInterval t, uint64_t bytes) {
    timeline_.add({lane, name, int32_t(b), -1, st.job.step, t.begin_us, t.end_us, 0, bytes});
  };
  if (on_nvme(b)) {
    const uint64_t bytes = (spills_grads(b) ? 4 : 3) * n * 4;
    SimInterval r = sim_nvme_read_.run(std::max(st.read_ahead_from, st.spilled_us[size_t(b)]), cm.nvme_read_us(bytes));
    span(Lane::kNvmeRead, "nvme read state", r, bytes);
    ready = std::max(ready, r.end_us);
  }
  SimInterval t = sim_optimizer_.run(ready, cm.adam_us(n));
  span(Lane::kOptimizer, "adamw", t, n * 28);
  st.read_ahead_from = t.begin_us;
  if (on_nvme(b))
    span(Lane::kNvmeWrite, "nvme write state", sim_nvme_write_.run(t.end_us, cm.nvme_write_us(3 * n * 4)), 3 * n * 4);
  if (ring_slot_[size_t(b)] >= 0 && !spills_grads(b))
    sim_->record_at(*sim_ring_free_[size_t(ring_slot_[size_t(b)])], t.end_us);
  sim_->record_at(*sim_update_done_[b], t.end_us);
  st.last_update = std::max(st.last_update, t.end_us);
}

double Engine::sim_finish() {
  SimStep& st = sim_step_;
  const bool clip = config_.clip_norm > 0;
  if (clip)
    for (int64_t b = 0; b <= head_; ++b) sim_update(b, st.norm_known);
  // As in a real run, step() returns once the norm is known: after every
  // update without clipping (the norm is published last), before them with.
  sim_step_end_us_ = std::max(st.all_landed, clip ? st.norm_known : st.last_update);
  return sim_step_end_us_;
}

void Engine::read_state(int64_t b, ExtentKind kind, std::span<float> out) {
  STRIDER_CHECK(!simulated(), "read_state: a simulated engine holds no state");
  finish_updates();
  STRIDER_CHECK(b >= 0 && b < num_blocks_ && out.size() == layouts_[b].total_elems(),
                "read_state: block {} and a buffer of {} elements do not match", b, out.size());
  if (!on_nvme(b)) {
    std::span<float> src = host_state(store_->block(size_t(b)), kind);
    std::copy(src.begin(), src.end(), out.begin());
    return;
  }
  NvmeStaging& slot = idle_staging();
  const Extent& e = nvme_->extent(b, kind);
  nvme_->wait(nvme_->read(e, slot.master.first(e.io_bytes)));
  std::memcpy(out.data(), slot.master.data(), out.size_bytes());
}

void Engine::write_state(int64_t b, ExtentKind kind, std::span<const float> in) {
  STRIDER_CHECK(!simulated(), "write_state: a simulated engine holds no state");
  finish_updates();
  STRIDER_CHECK(b >= 0 && b < num_blocks_ && in.size() == layouts_[b].total_elems(),
                "write_state: block {} and a buffer of {} elements do not match", b, in.size());
  BlockState& s = store_->block(size_t(b));
  if (kind == ExtentKind::kMaster) {  // the compute copy follows the master
    if (!s.compute.empty()) float_to_bf16(in, s.compute);
    else std::copy(in.begin(), in.end(), s.compute_f32.begin());
  }
  if (!on_nvme(b)) {
    std::copy(in.begin(), in.end(), host_state(s, kind).begin());
    return;
  }
  NvmeStaging& slot = idle_staging();
  const Extent& e = nvme_->extent(b, kind);
  std::memset(slot.master.data(), 0, e.io_bytes);
  std::memcpy(slot.master.data(), in.data(), in.size_bytes());
  nvme_->wait(nvme_->write(e, slot.master.first(e.io_bytes)));
}

}  // namespace strider
