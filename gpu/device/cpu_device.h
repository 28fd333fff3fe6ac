// CpuDevice: the Device seam on host threads, so everything the engine does on
// a GPU also runs (and is tested) on a machine without one.
//
// Device memory is host memory under a hard byte budget. Each stream is a
// worker thread running its queue in order; events are real cross-thread
// signals. Chaos mode (seeded) sleeps a random while before queued operations,
// so a missing wait corrupts a result in a test instead of on a GPU later.
//
// Working memory: each op launched on the compute stream is watched by the
// process's WorkMeter (gpu/device/work_meter.h; registered by make_device in builds
// with torch, which counts every ATen CPU allocation of every thread). The
// meter is process-wide, so what it attributes to an op is everything ATen
// allocated anywhere while the op ran. The engine's figures are still the
// op's own: one compute stream runs one op at a time, its intra-op worker
// threads are the op's, the copy streams do no ATen allocation, and the
// engine's host threads (its caller, the updater) allocate no ATen memory
// mid-step. What pollutes a figure: another thread of the process allocating
// ATen CPU tensors meanwhile (a test's main thread, Python code running beside
// a step, a second device computing at the same time).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gpu/device/device.h"
#include "gpu/device/device_ledger.h"
#include "gpu/device/work_meter.h"

namespace strider {

class CpuDevice final : public Device {
 public:
  static constexpr size_t kDefaultBudgetBytes = size_t{1} << 30;
  static constexpr size_t kAlignBytes = 256;  // as cudaMalloc guarantees

  explicit CpuDevice(const DeviceOptions& options = {});
  ~CpuDevice() override;  // drains every queue, then stops the workers
  CpuDevice(const CpuDevice&) = delete;
  CpuDevice& operator=(const CpuDevice&) = delete;

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  std::string name() const override;
  int ordinal() const override { return 0; }

  DeviceBuffer allocate(size_t bytes, std::string_view what) override;
  size_t budget_bytes() const override { return ledger_.budget_bytes(); }
  size_t allocated_bytes() const override;
  size_t peak_allocated_bytes() const override;
  size_t allocation_count() const override;

  void copy_h2d(StreamId s, void* dst_device, const void* src_host, size_t bytes, OpTag tag = {}) override;
  void copy_h2d_rows(StreamId s, void* dst_device, size_t dst_pitch, const void* src_host, size_t src_pitch,
                     size_t row_bytes, size_t rows, OpTag tag = {}) override;
  void copy_d2h(StreamId s, void* dst_host, const void* src_device, size_t bytes, OpTag tag = {}) override;
  void launch(StreamId s, OpTag tag, LaunchFn fn) override;

  std::unique_ptr<Event> make_event() override;
  void record(Event& e, StreamId s) override;
  void wait(StreamId s, const Event& e) override;

  void synchronize(StreamId s) override;
  void synchronize() override;

  void drain_spans(std::vector<OpSpan>& out) override;
  uint64_t work_peak_bytes() const override { return work_peak_.load(); }
  void reset_work_peak() override { work_peak_.store(0); }
  // Records what an arena registers, and from then on every copy's host side
  // must lie in it, as on a GPU that pins it.
  std::shared_ptr<MemoryRegistrar> host_registrar() override { return registered_; }
  // Releases the calling thread's idle OpenMP team (libgomp only; see the .cpp).
  void prepare_driver_thread() override;

 protected:
  void free_memory(std::byte* data, size_t bytes) noexcept override;

 private:
  struct Op;
  struct Worker;

  void enqueue(StreamId s, Op op);
  void run_worker(Worker& w);
  void check_device_range(const void* p, size_t bytes, const char* op, const char* role) const;
  void check_host_range(const void* p, size_t bytes, const char* op, const char* role) const;
  void rethrow_failure();
  double now_us() const;

  const DeviceOptions options_;
  const std::chrono::steady_clock::time_point start_;
  WorkMeter* const meter_;  // the registered meter when made; nullptr: nothing measured
  std::atomic<uint64_t> work_peak_{0};  // raised by the compute worker

  mutable std::mutex mem_mutex_;
  DeviceLedger ledger_;  // guarded by mem_mutex_
  const std::shared_ptr<HostRegistry> registered_;  // its own lock; shared with the arenas it registers

  std::mutex spans_mutex_;
  std::vector<OpSpan> spans_;

  std::mutex error_mutex_;
  std::string first_error_;  // the first op that threw since the last synchronize

  std::vector<std::unique_ptr<Worker>> workers_;  // one per StreamId
};

}  // namespace strider
