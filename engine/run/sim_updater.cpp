#include "engine/run/sim_updater.h"

#include <algorithm>

#include "host/error.h"

namespace strider {

SimUpdater::SimUpdater(SimDevice& device, const Placement& place, StateFormat format, int64_t ring_slots,
                       Timeline& timeline)
    : sim_(device), place_(place), format_(format), timeline_(timeline), drive_reads_(device.model().nvme_read_gbps),
      compute_written_us_(size_t(place.num_pieces()), 0.0) {
  for (int64_t p = 0; p < place.num_pieces(); ++p) update_done_.push_back(device.make_event());
  for (int64_t r = 0; r < ring_slots; ++r) ring_free_.push_back(device.make_event());
}

void SimUpdater::begin(const StepProgram& program, std::shared_ptr<UpdateJob> job) {
  program_ = &program;
  step_ = job->step;
  next_ = 0;
  begin_us_ = end_us_;
  thread_us_ = 0;
  previous_end_.assign(program.ops.size(), 0.0);
  if (end_.size() == program.ops.size()) std::swap(previous_end_, end_);
  end_.assign(program.ops.size(), 0.0);
  landed_us_.assign(size_t(place_.num_pieces()), -1.0);
}

void SimUpdater::landed(int64_t p, const Event& landed) {
  landed_us_[size_t(p)] = sim_.event_time_us(landed);
  advance();
}

void SimUpdater::advance() {
  const std::vector<StepOp>& ops = program_->ops;
  for (; next_ < ops.size(); ++next_) {
    const StepOp& op = ops[next_];
    if (op.on_device()) continue;
    if (op.kind == StepOpKind::kLand && landed_us_[size_t(op.piece)] < 0) return;  // not enqueued yet
    double ready = thread_us_;
    for (int32_t a : op.after)
      if (a >= 0 && !ops[size_t(a)].on_device()) ready = std::max(ready, end_[size_t(a)]);
    for (int32_t a : op.after_previous)
      if (!ops[size_t(a)].on_device()) ready = std::max(ready, previous_end_[size_t(a)]);
    run(op, ready, end_[next_]);
  }
}

PassEnd SimUpdater::end(UpdateJob&) {
  const std::vector<StepOp>& ops = program_->ops;
  for (const int32_t l : program_->landed)  // -1: a frozen piece, which lands nothing
    STRIDER_CHECK(l < 0 || landed_us_[size_t(ops[size_t(l)].piece)] >= 0,
                  "simulated pass: piece {}'s gradients never landed", l < 0 ? -1 : ops[size_t(l)].piece);
  advance();
  end_us_ = end_[size_t(program_->norm)];
  for (const int32_t l : program_->landed)
    if (l >= 0) end_us_ = std::max(end_us_, end_[size_t(l)]);
  return {.priced = true, .begin_us = begin_us_, .end_us = end_us_};
}

// A pool's devices share the host's memory bus (SimHostMemory) with the
// optimizer: its bytes (and the copies' time inside what it held before,
// SimHostMemory::reserve_bulk) take the bus's free time from the job's start,
// and the job ends no sooner than the bus has carried them. The copies go
// first (a DMA asks for a small part of the bus). One device has no shared bus: its
// optimizer lane is the CostModel's rate alone (which a bus-bound kernel's
// rate already is).
SimInterval SimUpdater::on_host_bus(SimInterval t, uint64_t bytes) {
  SimHostMemory* bus = sim_.host_memory();
  if (bus == nullptr || bytes == 0) return t;
  const double done = bus->reserve_bulk(t.begin_us, bytes);
  if (done > t.end_us) t.end_us = optimizer_.clock_us = done;
  return t;
}

void SimUpdater::read_compute(ComputeSlot& slot, std::span<const int64_t> pieces, uint64_t bytes,
                              const StepOp& r, Device& dev) {
  auto& sim = static_cast<SimDevice&>(dev);
  double ready = slot.copied_on >= 0 ? sim.event_time_us(*slot.copied[size_t(slot.copied_on)]) : 0.0;
  for (int64_t p : pieces)
    ready = std::max({ready, sim.event_time_us(*update_done_[size_t(p)]), compute_written_us_[size_t(p)]});
  const double cost = sim_.model().nvme_read_us(bytes);
  const double end = drive_reads_.reserve(ready, cost);
  span(Lane::kNvmeRead, "nvme read compute", r.piece, {end - cost, end}, bytes);
  sim.record_at(*slot.read_done[size_t(r.device)], end);
  slot.block = r.block;
}

void SimUpdater::span(Lane lane, const char* name, int64_t p, SimInterval t, uint64_t bytes) {
  timeline_.add({lane, name, p >= 0 ? int32_t(place_.piece(p).block) : -1, -1, step_, t.begin_us, t.end_us, 0, bytes});
}

// Each operation where the real updater runs it: the optimizer and
// collective lanes' in program order on its thread (which waits for each
// piece's gradients; thread_us_ serialises them, as the one thread does); the
// NVMe reads and writes are issued there and run on their own lanes.
void SimUpdater::run(const StepOp& op, double ready, double& end) {
  const CostModel& cm = sim_.model();
  const int64_t p = op.piece;
  const uint64_t n = p >= 0 ? place_.piece(p).elems() : 0, grad_bytes = n * place_.grad_bytes;
  const int world = int(place_.block_slices[0].size()) - 1;  // the ranks holding slices (1: not sharded)
  const double share = double(world - 1) / double(world);
  end = ready;
  switch (op.kind) {
    case StepOpKind::kLand:
      end = thread_us_ = std::max(ready, landed_us_[size_t(p)]);
      return;
    case StepOpKind::kSumRanks: {
      // The gradient's reduce-scatter (this rank's (W - 1) / W of the piece
      // each way) and its sum of squares' all-reduce.
      const uint64_t bytes = uint64_t(share * double(grad_bytes));
      const SimInterval t = collective_.run(ready, cm.collective_us(bytes) + cm.collective_latency_us);
      span(Lane::kCollective, "reduce-scatter", p, t, bytes);
      end = thread_us_ = t.end_us;
      return;
    }
    case StepOpKind::kSumSquares: {
      // One read of the gradients over the memory bus (sharded: this rank's
      // slice on its share of the bus, ranks on one machine).
      const uint64_t own = op.as<SliceArgs>().over_slices ? place_.at(p).owned.elems() * place_.grad_bytes : grad_bytes;
      const SimInterval t = on_host_bus(optimizer_.run(ready, cm.host_memory_us(grad_bytes)), own);
      span(Lane::kOptimizer, "grad norm", p, t, grad_bytes);
      end = thread_us_ = t.end_us;
      return;
    }
    case StepOpKind::kSpill: {
      const SimInterval t = nvme_write_.run(ready, cm.nvme_write_us(grad_bytes));
      span(Lane::kNvmeWrite, "nvme write grads", p, t, grad_bytes);
      sim_.record_at(*ring_free_[size_t(place_.at(p).ring_slot)], t.end_us);
      end = t.end_us;
      return;
    }
    case StepOpKind::kReadState: {
      const uint64_t bytes = state_read_bytes(place_, format_, p, n);
      SimInterval t = nvme_read_.run(ready, cm.nvme_read_us(bytes));
      // The drive's time: after the compute copies' reads that took it
      // (none: the lane's own order, unchanged).
      t.end_us = nvme_read_.clock_us = std::max(t.end_us, drive_reads_.reserve(t.begin_us, t.end_us - t.begin_us));
      span(Lane::kNvmeRead, "nvme read state", p, t, bytes);
      end = t.end_us;
      return;
    }
    case StepOpKind::kAdamW: {
      // Sharded, a rank updates its slice. Ranks on one machine (sharing a
      // compute copy) share its memory bus too: their slices together take
      // what the whole piece would, so each rank's lane is busy that long.
      // Ranks on machines of their own each take their slice's time.
      const SliceArgs& a = op.as<SliceArgs>();
      const uint64_t own = a.over_slices ? place_.at(p).owned.elems() : n;
      const uint64_t updated = a.shared_copy ? n : own;
      // Each format's kernel at its rate (CostModel::adam_params_per_s: its
      // cores or the memory bus), its bytes on the shared host bus too (a
      // pool's; ranks on one machine: the slice's, on the rank's share).
      const SimInterval t = on_host_bus(optimizer_.run(ready, cm.adam_us(updated, format_)),
                                        adam_bytes(format_, own, place_.grad_bytes));
      span(Lane::kOptimizer, "adamw", p, t, adam_bytes(format_, n, place_.grad_bytes));
      if (place_.at(p).ring_slot >= 0 && !place_.at(p).spills_grads)
        sim_.record_at(*ring_free_[size_t(place_.at(p).ring_slot)], t.end_us);
      end = thread_us_ = t.end_us;
      return;
    }
    case StepOpKind::kWriteState: {
      const uint64_t bytes = state_write_bytes(place_, format_, p, n);
      const SimInterval t = nvme_write_.run(ready, cm.nvme_write_us(bytes));
      span(Lane::kNvmeWrite, "nvme write state", p, t, bytes);
      compute_written_us_[size_t(p)] = t.end_us;
      end = t.end_us;
      return;
    }
    case StepOpKind::kGather: {
      // The other ranks' slices of the new compute copy, or (one machine,
      // one shared copy) a barrier.
      const bool shared = op.as<SliceArgs>().shared_copy;
      const uint64_t bytes = shared ? 0 : uint64_t(share * double(n * place_.compute_bytes));
      const SimInterval t = collective_.run(ready, cm.collective_us(bytes));
      span(Lane::kCollective, shared ? "barrier" : "all-gather", p, t, bytes);
      end = thread_us_ = t.end_us;
      return;
    }
    case StepOpKind::kUpdated:
      sim_.record_at(*update_done_[size_t(p)], ready);
      thread_us_ = ready;
      return;
    case StepOpKind::kCheckLoss:
    case StepOpKind::kCheckGrad:
    case StepOpKind::kNorm:  // decisions, no time of their own
      thread_us_ = ready;
      return;
    STRIDER_DEVICE_OP_KINDS:  // every kind is named (-Werror=switch): a new host one needs its price here
      break;
  }
  throw Error(fmt::format("the simulated updater was given the device operation '{}'", op_name(op.kind)));
}

}  // namespace strider
