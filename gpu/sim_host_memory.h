// SimHostMemory: the host's memory bus in a simulation (gpu/sim_device.h),
// shared by a pool's SimDevices and the simulated optimizer.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>

namespace strider {

// The host's memory bus, as a pool's SimDevices (their copies) and the host's
// optimizer (its AdamW) share it: each use occupies it for bytes / gbps,
// filling the time left free at and after its start (a calendar of busy
// intervals, so work priced out of virtual-time order still finds the gaps
// before it). A copy then ends when both its own link and the bus are done
// with it: N GPUs' links together can ask more of the bus than it gives.
// One device alone has none (its link is its limit).
class SimHostMemory {
 public:
  explicit SimHostMemory(double gbps);
  double gbps() const { return gbps_; }
  // `busy_us` of the bus from `begin_us` on; returns when it is done.
  double reserve(double begin_us, double busy_us);
  double reserve_bytes(double begin_us, uint64_t bytes) { return reserve(begin_us, double(bytes) / (gbps_ * 1e3)); }
  // The bus's busy time so far, all of it.
  double busy_us() const;

 private:
  mutable std::mutex mu_;
  const double gbps_;
  std::map<double, double> busy_;  // begin -> end, disjoint
};

}  // namespace strider
