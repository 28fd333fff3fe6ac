// Timeline: a span per operation per lane (compute, h2d, d2h on the device;
// optimizer, nvme read, nvme write on the host), the per-step figures the
// engine reports (busy time and fraction per lane, the critical lane, the
// overlap efficiency = busiest lane / step time) and a Chrome trace JSON export
// that Perfetto and chrome://tracing open.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace strider {

// kCollective: what a data-parallel step exchanges with the other ranks (the
// gradients' sums, the compute copy's gather). Its operations run on the
// updater thread, between the optimizer's: a lane of their own in the
// program and the timeline, so that a profile shows them apart, not yet a
// thread of their own.
// kHandOff: a pool's copies between its devices (kHandOut, kHandIn), both
// ways; they run on the devices' d2h and h2d streams.
enum class Lane : uint8_t { kCompute, kH2D, kD2H, kOptimizer, kNvmeRead, kNvmeWrite, kCollective, kHandOff };
inline constexpr int kNumLanes = 8;
std::string_view lane_name(Lane lane);

struct Span {
  Lane lane = Lane::kCompute;
  std::string name;        // "forward", "h2d params", "adamw", ...
  int32_t block = -1;
  int32_t micro_batch = -1;
  int64_t step = -1;
  double begin_us = 0, end_us = 0;  // Timeline::now_us() basis
  double flops = 0;
  uint64_t bytes = 0;
  uint64_t work_peak_bytes = 0;  // compute: ATen's working memory during the op (OpSpan::work_peak_bytes)
  int32_t device = -1;           // device lanes of a pool: its device (a track each in the trace); -1: one device
};

struct LaneStats {
  double busy_s = 0;         // union of the lane's spans inside the window
  double busy_fraction = 0;  // busy_s / step_s
};

struct StepStats {
  double step_s = 0;
  std::array<LaneStats, kNumLanes> lanes{};
  Lane critical = Lane::kCompute;  // the busiest lane
  double overlap_efficiency = 0;   // busiest lane's busy_s / step_s (1.0: everything else hidden)
  double flops = 0;                // compute spans' flops inside the window
};

class Timeline {
 public:
  // Microseconds on the steady clock since a process-wide origin.
  static double now_us();

  // Thread-safe.
  void add(Span s);
  // Figures for spans overlapping [begin_us, end_us), clipped to it.
  StepStats stats(double begin_us, double end_us) const;
  // Writes every span as Chrome trace JSON (atomically: temp file + rename).
  void write_chrome_trace(const std::string& path) const;
  // Drops spans that ended before `us` (keeps memory bounded in long runs).
  void forget_before(double us);
  std::vector<Span> spans() const;

 private:
  mutable std::mutex mu_;
  std::vector<Span> spans_;
};

}  // namespace strider
