#include "engine/program/timeline.h"

#include <algorithm>
#include <chrono>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "io/atomic_file.h"

namespace strider {

std::string_view lane_name(Lane lane) {
  switch (lane) {
    case Lane::kCompute: return "compute";
    case Lane::kH2D: return "h2d";
    case Lane::kD2H: return "d2h";
    case Lane::kOptimizer: return "optimizer";
    case Lane::kNvmeRead: return "nvme read";
    case Lane::kNvmeWrite: return "nvme write";
    case Lane::kCollective: return "collective";
    case Lane::kHandOff: return "hand-off";
  }
  return "?";
}

double Timeline::now_us() {
  static const auto origin = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - origin).count();
}

void Timeline::add(Span s) {
  std::lock_guard lk(mu_);
  spans_.push_back(std::move(s));
}

StepStats Timeline::stats(double begin_us, double end_us) const {
  StepStats st;
  st.step_s = std::max(0.0, end_us - begin_us) * 1e-6;
  std::array<std::vector<std::pair<double, double>>, kNumLanes> iv;
  {
    std::lock_guard lk(mu_);
    for (const Span& s : spans_) {
      const double b = std::max(s.begin_us, begin_us), e = std::min(s.end_us, end_us);
      if (e <= b) continue;
      iv[static_cast<int>(s.lane)].emplace_back(b, e);
      if (s.lane == Lane::kCompute && s.end_us > s.begin_us)
        st.flops += s.flops * (e - b) / (s.end_us - s.begin_us);
    }
  }
  double busiest = 0;
  for (int l = 0; l < kNumLanes; ++l) {
    auto& v = iv[l];
    std::sort(v.begin(), v.end());
    double busy = 0, cur_b = 0, cur_e = -1;
    for (auto [b, e] : v) {  // union of intervals: overlapping spans count once
      if (b > cur_e) {
        if (cur_e > cur_b) busy += cur_e - cur_b;
        cur_b = b;
        cur_e = e;
      } else {
        cur_e = std::max(cur_e, e);
      }
    }
    if (cur_e > cur_b) busy += cur_e - cur_b;
    st.lanes[l].busy_s = busy * 1e-6;
    st.lanes[l].busy_fraction = st.step_s > 0 ? st.lanes[l].busy_s / st.step_s : 0;
    if (st.lanes[l].busy_s > busiest) {
      busiest = st.lanes[l].busy_s;
      st.critical = static_cast<Lane>(l);
    }
  }
  st.overlap_efficiency = st.step_s > 0 ? busiest / st.step_s : 0;
  return st;
}

void Timeline::write_chrome_trace(const std::string& path) const {
  using nlohmann::json;
  json events = json::array();
  for (int l = 0; l < kNumLanes; ++l)
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 1}, {"tid", l},
                      {"args", {{"name", std::string(lane_name(static_cast<Lane>(l)))}}}});
  std::vector<Span> copy = spans();
  // A pool's devices: a process each ("device d"), with its device lanes.
  int pool = 0;
  for (const Span& s : copy) pool = std::max(pool, s.device + 1);
  for (int d = 0; d < pool; ++d) {
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 2 + d}, {"args", {{"name", fmt::format("device {}", d)}}}});
    for (Lane l : {Lane::kCompute, Lane::kH2D, Lane::kD2H, Lane::kHandOff})
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 2 + d}, {"tid", static_cast<int>(l)},
                        {"args", {{"name", std::string(lane_name(l))}}}});
  }
  for (const Span& s : copy) {
    std::string name = s.name;
    if (s.block >= 0) name += " b" + std::to_string(s.block);
    if (s.micro_batch >= 0) name += " mb" + std::to_string(s.micro_batch);
    json args = {{"step", s.step}, {"block", s.block}, {"micro_batch", s.micro_batch}};
    if (s.bytes) args["bytes"] = s.bytes;
    if (s.flops) args["flops"] = s.flops;
    if (s.work_peak_bytes) args["work_peak_bytes"] = s.work_peak_bytes;
    if (s.device >= 0) args["device"] = s.device;
    events.push_back({{"name", name}, {"ph", "X"}, {"pid", s.device >= 0 ? 2 + s.device : 1}, {"tid", static_cast<int>(s.lane)},
                      {"ts", s.begin_us}, {"dur", std::max(0.0, s.end_us - s.begin_us)}, {"args", args}});
  }
  json doc = {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
  const std::string text = doc.dump();
  write_file_atomic(path, std::as_bytes(std::span(text)));
}

void Timeline::forget_before(double us) {
  std::lock_guard lk(mu_);
  std::erase_if(spans_, [us](const Span& s) { return s.end_us < us; });
}

std::vector<Span> Timeline::spans() const {
  std::lock_guard lk(mu_);
  return spans_;
}

}  // namespace strider
