#include "gpu/device/sim_host_memory.h"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "host/error.h"

namespace strider {

SimHostMemory::SimHostMemory(double gbps) : gbps_(gbps) {
  STRIDER_CHECK(std::isfinite(gbps) && gbps > 0, "SimHostMemory: {} GB/s is not a bandwidth", gbps);
}

double SimHostMemory::busy_us() const {
  std::lock_guard lk(mu_);
  double total = owed_us_;
  for (const auto& [a, b] : busy_) total += b - a;
  return total;
}

// Takes `busy_us` of the calendar's free time from `begin_us` on, in order;
// returns the intervals taken (already in the calendar).
std::vector<std::pair<double, double>> SimHostMemory::fill(Calendar& c, double begin_us, double busy_us) {
  double t = begin_us, left = busy_us;
  std::vector<std::pair<double, double>> taken;
  // The busy interval that may reach into `begin_us`, then each after it: fill the gaps in order.
  auto it = c.upper_bound(t);
  if (it != c.begin() && std::prev(it)->second > t) --it;
  for (; it != c.end() && left > 0; ++it) {
    if (it->first > t) {
      const double take = std::min(it->first - t, left);
      taken.emplace_back(t, t + take);
      left -= take;
      t += take;
      if (left <= 0) break;
    }
    t = std::max(t, it->second);
  }
  if (left > 0) taken.emplace_back(t, t + left);
  for (const auto& [a, b] : taken) c[a] = b;
  return taken;
}

double SimHostMemory::reserve(double begin_us, double busy_us) {
  std::lock_guard lk(mu_);
  const auto taken = fill(busy_, begin_us, busy_us);
  return taken.empty() ? begin_us : taken.back().second;
}

double SimHostMemory::reserve_copy(double begin_us, uint64_t bytes) {
  std::lock_guard lk(mu_);
  const auto taken = fill(copies_, begin_us, us(bytes));
  // Into the whole bus's calendar: the parts no other use holds; the parts the
  // optimizer holds (copies never overlap copies) are owed by it.
  for (const auto& [a, b] : taken) {
    double t = a;
    auto it = busy_.upper_bound(t);
    if (it != busy_.begin() && std::prev(it)->second > t) --it;
    for (; it != busy_.end() && it->first < b && t < b; ++it) {
      if (it->first > t) busy_[t] = it->first;  // free before this busy interval
      owed_us_ += std::max(0.0, std::min(b, it->second) - std::max(t, it->first));
      t = std::max(t, it->second);
    }
    if (t < b) busy_[t] = b;
  }
  return taken.empty() ? begin_us : taken.back().second;
}

double SimHostMemory::reserve_bulk(double begin_us, uint64_t bytes) {
  std::lock_guard lk(mu_);
  const double need = us(bytes) + owed_us_;
  owed_us_ = 0;
  const auto taken = fill(busy_, begin_us, need);
  return taken.empty() ? begin_us : taken.back().second;
}

}  // namespace strider
