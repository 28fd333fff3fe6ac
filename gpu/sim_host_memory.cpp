#include "gpu/sim_host_memory.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "host/error.h"

namespace strider {

SimHostMemory::SimHostMemory(double gbps) : gbps_(gbps) {
  STRIDER_CHECK(std::isfinite(gbps) && gbps > 0, "SimHostMemory: {} GB/s is not a bandwidth", gbps);
}

double SimHostMemory::busy_us() const {
  std::lock_guard lk(mu_);
  double total = 0;
  for (const auto& [a, b] : busy_) total += b - a;
  return total;
}

double SimHostMemory::reserve(double begin_us, double busy_us) {
  std::lock_guard lk(mu_);
  double t = begin_us, left = busy_us;
  std::vector<std::pair<double, double>> taken;
  // The busy interval that may reach into `begin_us`, then each after it: fill the gaps in order.
  auto it = busy_.upper_bound(t);
  if (it != busy_.begin() && std::prev(it)->second > t) --it;
  for (; it != busy_.end() && left > 0; ++it) {
    if (it->first > t) {
      const double take = std::min(it->first - t, left);
      taken.emplace_back(t, t + take);
      left -= take;
      t += take;
      if (left <= 0) break;
    }
    t = std::max(t, it->second);
  }
  if (left > 0) taken.emplace_back(t, t + left), t += left;
  for (const auto& [a, b] : taken) busy_[a] = b;
  return t;
}

}  // namespace strider
