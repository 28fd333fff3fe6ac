// SimHostMemory: the host's memory bus in a simulation (gpu/device/sim_device.h),
// shared by a pool's SimDevices and the simulated optimizer.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace strider {

// The host's memory bus, as a pool's SimDevices (their copies) and the host's
// optimizer (its AdamW) share it: each use occupies it for bytes / gbps,
// filling the time left free at and after its start (a calendar of busy
// intervals, so work priced out of virtual-time order still finds the gaps
// before it). A copy then ends when both its own link and the bus are done
// with it: N GPUs' links together can ask more of the bus than it gives.
// One device alone has none (its link is its limit).
//
// The two kinds of use do not queue behind each other alike. A GPU's DMA asks
// for its link's rate (25 GB/s on PCIe 4.0), a small part of the bus, while
// the optimizer's cores stream at whatever the bus gives; a memory controller
// serving both fairly gives the DMA all it asks until the links together ask
// for more than the bus has. So a copy (reserve_copy) waits only for other
// copies' time, and the optimizer's bulk work (reserve_bulk) fills the time
// left free by everything and pays for the copies that ran inside the time it
// already held: that overlap is owed and carried by the optimizer's next use
// (its work priced earlier cannot move), so the bus's total work is conserved.
// Before this split a copy queued behind a whole AdamW job (19 ms for a layer
// of Llama-3.1-8B at 300 GB/s), and a pool's hand-offs at the step's start
// starved while the optimizer ran.
class SimHostMemory {
 public:
  explicit SimHostMemory(double gbps);
  double gbps() const { return gbps_; }
  // `busy_us` of the bus from `begin_us` on, as one calendar (the drive's
  // reads use it so); returns when it is done.
  double reserve(double begin_us, double busy_us);
  // A device's copy of `bytes` from `begin_us`: the time other copies leave free.
  double reserve_copy(double begin_us, uint64_t bytes);
  // The optimizer's `bytes` from `begin_us` (with what copies owe it): the time everything leaves free.
  double reserve_bulk(double begin_us, uint64_t bytes);
  // The bus's busy time so far, all of it (what is owed included).
  double busy_us() const;

 private:
  using Calendar = std::map<double, double>;  // begin -> end, disjoint
  static std::vector<std::pair<double, double>> fill(Calendar& c, double begin_us, double busy_us);
  double us(uint64_t bytes) const { return double(bytes) / (gbps_ * 1e3); }

  mutable std::mutex mu_;
  const double gbps_;
  Calendar busy_;     // every use
  Calendar copies_;   // the copies' alone
  double owed_us_ = 0;  // copies' time inside what the optimizer held, not yet paid
};

}  // namespace strider
