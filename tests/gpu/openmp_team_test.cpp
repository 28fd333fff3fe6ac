// The CPU device and OpenMP: before a pass the driving thread's idle OpenMP
// team is released (CpuDevice::prepare_driver_thread), so that the compute
// stream's team is the process's only one and libgomp keeps its workers
// spinning between parallel regions instead of sleeping in the kernel.
#include <catch2/catch.hpp>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <thread>

#include "gpu/device/cpu_device.h"

using namespace strider;

namespace {

// Threads of this process now (/proc/self/task).
int process_threads() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// Polls until the process has at most `target` threads (a released worker
// exits a moment after it is told); returns the last count seen.
int wait_for_threads_at_most(int target) {
  int n = process_threads();
  for (int i = 0; i < 200 && n > target; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    n = process_threads();
  }
  return n;
}

// Runs a parallel region of `team` threads on the device's compute stream and
// returns how many threads it had.
int compute_stream_team(CpuDevice& dev, int team) {
  std::atomic<int> got{0};
  dev.launch(StreamId::kCompute, OpTag{"parallel region"}, [&got, team](const LaunchContext&) {
#pragma omp parallel num_threads(team)
    {
#pragma omp single
      got = omp_get_num_threads();
    }
  });
  dev.synchronize();
  return got;
}

}  // namespace

TEST_CASE("the CPU device releases the driving thread's idle OpenMP team, not the compute stream's", "[cpu]") {
  CpuDevice dev;
  constexpr int kTeam = 3;  // two workers besides the thread that starts the region
  // The compute stream's own team, made before the driver's.
  REQUIRE(compute_stream_team(dev, kTeam) == kTeam);
  const int base = process_threads();  // this thread, the stream's and its team

  // Catch2 asserts on the test's thread only: the driver records, this checks.
  int first = 0, with_team = 0, released = 0, again = 0;
  std::thread driver([&] {
#pragma omp parallel num_threads(kTeam)
    {
#pragma omp atomic
      ++first;
    }
    with_team = process_threads();
    dev.prepare_driver_thread();
    released = wait_for_threads_at_most(with_team - (kTeam - 1));
    // Twice is harmless, and the driver can still run parallel regions after.
    dev.prepare_driver_thread();
#pragma omp parallel num_threads(kTeam)
    {
#pragma omp atomic
      ++again;
    }
  });
  driver.join();
  REQUIRE(first == kTeam);
  CHECK(released == with_team - (kTeam - 1));  // its two workers are gone
  CHECK(again == kTeam);

  // The driver's last team exits with it, a moment after the join: wait for
  // that, so the count below is not taken while its workers are leaving.
  const int before = wait_for_threads_at_most(base);
  CHECK(before == base);
  // The compute stream's team was left alone: its workers still run its regions.
  CHECK(compute_stream_team(dev, kTeam) == kTeam);
  CHECK(process_threads() == before);  // no team had to be built again
}
