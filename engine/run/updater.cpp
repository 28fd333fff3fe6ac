// EngineCore::Updater (engine/run/updater.h): the host executor that runs
// the operations, on its own thread, and what the other threads wait on.
#include "engine/run/updater.h"

#include <cmath>
#include <fmt/format.h>

#include "engine/run/collectives.h"
#include "host/error.h"

namespace strider {

EngineCore::Updater::Updater(EngineCore& engine)
    : e_(engine),
      updated_(size_t(engine.num_pieces()), 0),
      grads_recorded_(size_t(engine.num_pieces()), 0),
      ring_released_(engine.grad_ring_.size(), 0),
      compute_written_(size_t(engine.num_pieces())) {
  thread_ = std::thread([this] { main(); });
}

void EngineCore::Updater::stop() {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void EngineCore::Updater::wait_compute_written() {
  for (auto& t : compute_written_)
    if (t.valid()) try { e_.nvme_->wait(t); } catch (...) {}
}

void EngineCore::Updater::rethrow() {
  if (error_) std::rethrow_exception(error_);
}

void EngineCore::Updater::fail(std::exception_ptr error) {
  {
    std::lock_guard lk(mu_);
    if (!error_) error_ = error;
  }
  cv_.notify_all();
}

void EngineCore::Updater::begin(const StepProgram& program, std::shared_ptr<UpdateJob> job) {
  {
    std::lock_guard lk(mu_);
    job->pass = passes_ + 1;
    jobs_.push_back({&program, std::move(job)});
  }
  cv_.notify_all();
}

void EngineCore::Updater::landed(int64_t p, const Event&) {
  {
    std::lock_guard lk(mu_);
    grads_recorded_[size_t(p)] = passes_ + 1;
  }
  cv_.notify_all();
}

void EngineCore::Updater::after_update(int64_t p, Device&) {
  std::unique_lock lk(mu_);
  // A pass abandon() gave up never updates; abandon() returned once every
  // earlier pass's job was left, so nothing before it is still to wait for
  // (abandon and this wait run on the same thread, the caller's).
  cv_.wait(lk, [&] { return updated_[size_t(p)] >= passes_ || abandoned_ >= passes_ || error_ || stopping_; });
  rethrow();
}

void EngineCore::Updater::finish_updates() {
  for (int64_t p = 0; p < e_.num_pieces(); ++p)
    if (e_.updates(p)) after_update(p, e_.device());
}

bool EngineCore::Updater::abandon(const UpdateJob& job) {
  std::unique_lock lk(mu_);
  abandoned_ = std::max(abandoned_, job.pass);
  cv_.notify_all();  // a kLand of the pass waiting for its gradient gives up
  cv_.wait(lk, [&] { return left_ >= job.pass || error_; });
  rethrow();  // a host operation failed (this pass's or an earlier one's): the updater has stopped
  return applied_ >= job.pass;
}

void EngineCore::Updater::after_ring(int r, int64_t use, Device&) {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return ring_released_[size_t(r)] >= use || error_; });
  rethrow();
}

void EngineCore::Updater::release_ring(int r) {
  {
    std::lock_guard lk(mu_);
    ++ring_released_[size_t(r)];
  }
  cv_.notify_all();
}

void EngineCore::Updater::compute_written(int64_t p, NvmeTicket t) {
  std::lock_guard lk(mu_);
  compute_written_[size_t(p)] = t;
}

void EngineCore::Updater::read_compute(ComputeSlot& slot, std::span<const int64_t> pieces, uint64_t bytes,
                                       const StepOp& r, Device& dev) {
  if (slot.copied_on >= 0) slot.copied[size_t(slot.copied_on)]->synchronize();  // its last load's copies left it
  slot.read_begin_us = Timeline::now_us();
  slot.block = r.block;
  slot.read_bytes = bytes;
  for (int64_t p : pieces) {
    if (e_.updates(p)) after_update(p, dev);  // the previous pass's update of it, whose write-back...
    NvmeTicket written;
    {
      std::lock_guard lk(mu_);
      written = compute_written_[size_t(p)];
    }
    if (written.valid()) e_.nvme_->wait(written);  // ...must have landed before it is read
    const Extent& x = e_.nvme_->extent(p, ExtentKind::kCompute);
    slot.reads.push_back(e_.nvme_->read(x, slot.bytes.subspan(e_.place_.at(p).compute_staging_at, x.io_bytes)));
  }
}

void EngineCore::Updater::await_compute(ComputeSlot& slot, const StepOp& v, Device&) {
  // A failed read or checksum stops the step, naming the layer, the extent and the file.
  try {
    for (auto& t : slot.reads) e_.nvme_->wait(t);
  } catch (const Error& err) {
    for (auto& t : slot.reads) try { e_.nvme_->wait(t); } catch (...) {}  // none still writes into the slot
    slot.reads.clear();
    throw Error(fmt::format("reading the compute copy of {} from NVMe: {}", e_.spec_.block_name(v.block), err.what()));
  }
  slot.reads.clear();
  e_.timeline_.add({Lane::kNvmeRead, "nvme read compute", int32_t(v.block), -1, e_.steps_ + 1, slot.read_begin_us,
                    Timeline::now_us(), 0, slot.read_bytes});
}

// The loss is known once the head ran; the pass ends when every gradient
// has landed and the norm is known (the updates may continue). The updater
// decided whether the step is skipped before it published the norm.
PassEnd EngineCore::Updater::end(UpdateJob& job) {
  e_.synchronize_devices(StreamId::kCompute);
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return norm_pass_ >= job.pass || error_; });
  rethrow();
  // The pass ended (a failure before here leaves it to abandon()): the waits
  // for updates now mean this pass's. No thread waits on them meanwhile.
  ++passes_;
  return {.grad_norm = last_norm_};
}

void EngineCore::Updater::publish_norm(double norm, int64_t pass) {
  {
    std::lock_guard lk(mu_);
    last_norm_ = norm;
    norm_pass_ = pass;
  }
  cv_.notify_all();
}

// The updater thread: the host operations of each training pass's program
// (engine/program/step_program.h), in order, through one table (run_host_op).
void EngineCore::Updater::main() {
  for (;;) {
    Job next;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      next = jobs_.front();
      jobs_.pop_front();
    }
    UpdateJob& job = *next.job;
    try {
      const int64_t P = e_.num_pieces();
      PassFigures fig;
      fig.sumsq.assign(size_t(P), 0.0);
      fig.parts.assign(size_t(P), {});
      fig.bad_tensor.resize(size_t(P));
      // The first of the block's pieces to land (for the head: what lands first of the whole step).
      if (job.fault_block >= 0)
        for (int64_t p : e_.place_.landing)
          if (e_.piece(p).block == job.fault_block) {
            fig.fault_piece = p;
            break;
          }
      for (const StepOp& op : next.program->ops) {
        if (op.on_device()) continue;
        {
          std::lock_guard lk(mu_);
          if (abandoned_ >= job.pass) break;  // its device work failed: nothing more of it comes
        }
        run_host_op(op, job, fig);
      }
    } catch (...) {
      fail(std::current_exception());
      return;
    }
    {
      std::lock_guard lk(mu_);
      left_ = job.pass;
    }
    cv_.notify_all();
  }
}

void EngineCore::Updater::run_host_op(const StepOp& op, UpdateJob& job, PassFigures& fig) {
  const int64_t b = op.piece;
  switch (op.kind) {
    case StepOpKind::kLand: {
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return grads_recorded_[size_t(b)] >= job.pass || stopping_ || abandoned_ >= job.pass; });
        STRIDER_CHECK(!stopping_, "the engine stopped before {}'s gradients were copied out",
                      e_.place_.shards().name(e_.spec_, b));
        if (grads_recorded_[size_t(b)] < job.pass) return;  // abandoned: main() leaves the job
      }
      e_.grads_ready_[size_t(b)]->synchronize();
      return;
    }
    case StepOpKind::kSumRanks: {
      if (e_.dist_update_->ranks().solo()) return;
      const double t0 = Timeline::now_us();
      const bool slice = op.as<SliceArgs>().over_slices;
      e_.sum_grads_over_ranks(b, slice);
      e_.timeline_.add({Lane::kCollective, slice ? "reduce-scatter" : "all-reduce", int32_t(e_.piece(b).block), -1,
                     job.step, t0, Timeline::now_us(), 0, uint64_t(e_.piece(b).elems() * e_.place_.grad_bytes)});
      return;
    }
    case StepOpKind::kSumSquares:
      e_.op_sum_squares(op, fig);
      return;
    case StepOpKind::kSpill:
      e_.op_spill(op, job);
      return;
    case StepOpKind::kCheckLoss:
      e_.op_check_loss(job);
      return;
    case StepOpKind::kCheckGrad:
      e_.op_check_grad(op, job, fig);
      return;
    case StepOpKind::kNorm:
      e_.op_norm(op, job, fig);
      return;
    case StepOpKind::kReadState:
      if (job.skipped) return;
      e_.start_state_read(b, e_.next_read_slot_);
      e_.next_read_slot_ = 1 - e_.next_read_slot_;
      return;
    case StepOpKind::kAdamW:
      if (job.skipped) {
        e_.skip_piece(b);
        return;
      }
      {
        std::lock_guard lk(mu_);
        applied_ = job.pass;  // from here the state is neither the last step's nor this one's
      }
      e_.update_piece(job, b, fig.grad_scale);
      return;
    case StepOpKind::kWriteState:
      if (!job.skipped) e_.write_state_back(b, job.step);
      return;
    case StepOpKind::kGather: {
      if (job.skipped) return;
      const double t0 = Timeline::now_us();
      const bool shared = op.as<SliceArgs>().shared_copy;
      e_.gather_compute(b, shared);
      e_.timeline_.add({Lane::kCollective, shared ? "barrier" : "all-gather", int32_t(e_.piece(b).block), -1, job.step,
                     t0, Timeline::now_us(), 0, shared ? 0 : uint64_t(e_.piece(b).elems() * e_.place_.compute_bytes)});
      return;
    }
    case StepOpKind::kUpdated: {
      {
        std::lock_guard lk(mu_);
        updated_[size_t(b)] = job.pass;
      }
      cv_.notify_all();
      return;
    }
    STRIDER_DEVICE_OP_KINDS:  // every kind is named (-Werror=switch): a new one needs its handler here or in run_device_op
      break;
  }
  throw Error(fmt::format("the updater was given the device operation '{}'", op_name(op.kind)));
}


}  // namespace strider
