// The host table's handlers of a landed piece's gradients (run_host_op,
// host_update.cpp): their sum of squares, the norm's part, and under
// clipping their spill to NVMe until the norm is known.
#include <cstring>
#include <limits>

#include "engine/run/collectives.h"
#include "engine/run/updater.h"
#include "host/grad_norm.h"

namespace strider {

void EngineCore::op_sum_squares(const StepOp& op, PassFigures& fig) {
  const int64_t b = op.piece;
  // The summed gradients: the whole piece's, or (sharded) this rank's slice
  // of them, range by range (a piece of two ranges sums as the same two
  // pieces would: the norm adds the parts in piece order).
  const Range own = owned(b);
  const size_t n = own.elems();
  std::byte* g = grad_host(b).data();
  if (b == fig.fault_piece && n > 0 && own.begin == 0) {  // the rank holding its first element
    if (place_.grad_bytes == 4) reinterpret_cast<float*>(g)[0] = std::numeric_limits<float>::quiet_NaN();
    else reinterpret_cast<uint16_t*>(g)[0] = 0x7FC0;  // a bf16 NaN
  }
  // One part per range of the piece (0 where this rank holds none of it).
  std::vector<double>& parts = fig.parts[size_t(b)];
  parts.assign(piece(b).ranges.size(), 0.0);
  for (const PieceRun& r : place_.at(b).owned_runs()) {
    const std::byte* x = g + r.at * place_.grad_bytes;
    parts[r.range] = place_.grad_bytes == 4 ? sum_squares({reinterpret_cast<const float*>(x), r.n})
                                            : sum_squares_bf16({reinterpret_cast<const uint16_t*>(x), r.n});
  }
  // Sharded: each part summed over the ranks' slices (rank order: the same
  // bits everywhere).
  if (op.as<SliceArgs>().over_slices) dist_update_->all_reduce_sum(std::span<double>(parts));
  double& sq = fig.sumsq[size_t(b)];
  for (double x : parts) sq += x;
  // Named now: a ring slot may hold other gradients by the time it matters.
  if (!std::isfinite(sq)) {
    std::string& bad = fig.bad_tensor[size_t(b)];
    bad = first_non_finite_grad(b, g, own);
    if (bad.empty()) bad = op.as<SliceArgs>().over_slices ? "(in another rank's slice)" : "(none: the sum of squares overflowed)";
  }
}


void EngineCore::op_spill(const StepOp& op, const UpdateJob& job) {
  const int64_t b = op.piece;
  // The norm waits for every piece: park this one's gradients (this
  // rank's slice) on NVMe and free the ring slot once they are written.
  const Range own = owned(b);
  const size_t n = own.elems(), at = own.begin * place_.grad_bytes;
  if (n == 0) {
    release_ring_slot(b);  // nothing of it is this rank's to keep
    return;
  }
  std::byte* g = grad_host(b).data();
  const Extent& e = nvme_->extent(b, ExtentKind::kGrad);
  const double w0 = Timeline::now_us();
  const int32_t blk = int32_t(piece(b).block);
  // O_DIRECT writes whole aligned pages: a slice goes to the slot's start first.
  if (at > 0) std::memmove(g, g + at, n * place_.grad_bytes);
  grad_spill_[size_t(b)] = nvme_->write(
      e, grad_host(b).first(e.io_bytes), [this, b, blk, w0, step = job.step, bytes = n * place_.grad_bytes](std::exception_ptr err) {
        if (err) {
          updater_->fail(err);
        } else {
          timeline_.add({Lane::kNvmeWrite, "nvme write grads", blk, -1, step, w0, Timeline::now_us(), 0,
                         uint64_t(bytes)});
        }
        release_ring_slot(b);
      });
}

}  // namespace strider
