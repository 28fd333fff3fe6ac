// SimDevice: the Device seam as a cost model. It does no work: copies move no
// bytes and launched closures are never called. Each operation is priced from
// a CostModel and placed on its stream's virtual clock, so the engine's
// unchanged schedule answers "how fast would this train on machine X?".
//
// Virtual time, in microseconds from the device's start (or reset_clock()):
//   start(op) = max(stream clock, every event the stream waited on before it,
//                   the PCIe link's clock for copies)
//   end(op)   = start(op) + cost(op)      and the stream's clock becomes end(op)
//   record(e, s) stamps e with s's clock; wait(s, e) raises s's clock to e's stamp.
// There is no "now": the host is never behind the device, so Event::query()
// is always true and every synchronize returns at once. What the host itself
// does (CPU AdamW, NVMe) the engine prices with the same CostModel on
// SimHostLanes; see "Simulating the host" below.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "gpu/device/cost_model.h"
#include "gpu/device/device.h"
#include "gpu/device/device_ledger.h"
#include "gpu/device/sim_host_memory.h"
#include "host/state_format.h"

namespace strider {

// A stretch of virtual time.
struct SimInterval {
  double begin_us = 0;
  double end_us = 0;
};

// A serial host lane (CPU optimizer, NVMe read, NVMe write) in virtual time.
struct SimHostLane {
  double clock_us = 0;  // when the lane's last job ends
  // A job costing `cost_us` that may not start before `ready_us` (e.g. the
  // event_time_us() of the D2H it consumes); returns when it ran.
  SimInterval run(double ready_us, double cost_us);
};

// Simulating the host. The engine prices its host work itself and feeds the
// result back as events, exactly where a real run blocks or waits:
//   1. host work that consumes device output starts at
//        ready = sim.event_time_us(d2h_done)          (0 for a never-recorded event)
//        SimInterval t = optimizer_lane.run(ready, model.adam_us(params)
//                                                   [+ nvme read/write on their lanes]);
//   2. its completion becomes an event on the virtual clock:
//        sim.record_at(update_done, t.end_us);
//   3. device work that consumes it waits on that event as usual:
//        sim.wait(StreamId::kH2D, update_done);  copy_h2d(...)
// The step's time is max(sim.virtual_time_us(), every host lane's clock_us).
// Closures never run, so nothing computed by one (a loss, a norm) exists in a
// simulation; the engine must not read such results when kind() == kSim.
class SimDevice final : public Device {
 public:
  static constexpr size_t kAlignBytes = 256;  // as cudaMalloc (and CpuDevice) guarantee

  // Budget: options.budget_bytes, or model.device_memory_bytes when 0.
  // options.record_spans keeps an OpSpan (virtual µs) per copy and launch.
  explicit SimDevice(CostModel model, const DeviceOptions& options = {});
  ~SimDevice() override;  // releases the address space of buffers still alive
  SimDevice(const SimDevice&) = delete;
  SimDevice& operator=(const SimDevice&) = delete;

  DeviceKind kind() const override { return DeviceKind::kSim; }
  std::string name() const override;  // "sim:h200,h2d_gbps=12"
  int ordinal() const override { return 0; }

  // Fake device memory: each allocation is its own inaccessible (PROT_NONE)
  // address range, so pointers are unique and 256-byte aligned, cost no RAM,
  // never collide with host memory, and fault if anything dereferences them.
  DeviceBuffer allocate(size_t bytes, std::string_view what) override;
  size_t budget_bytes() const override { return ledger_.budget_bytes(); }
  size_t allocated_bytes() const override;
  size_t peak_allocated_bytes() const override;
  size_t allocation_count() const override;

  // Checked like CpuDevice (device side inside one allocation, host side not
  // device memory), priced, and placed on the clock; no byte moves.
  void copy_h2d(StreamId s, void* dst_device, const void* src_host, size_t bytes, OpTag tag = {}) override;
  // Priced as one copy of its bytes (rows of a few KiB or more, as the engine sends).
  void copy_h2d_rows(StreamId s, void* dst_device, size_t dst_pitch, const void* src_host, size_t src_pitch,
                     size_t row_bytes, size_t rows, OpTag tag = {}) override;
  void copy_d2h(StreamId s, void* dst_host, const void* src_device, size_t bytes, OpTag tag = {}) override;
  // Priced from tag.flops; `fn` is never called.
  void launch(StreamId s, OpTag tag, LaunchFn fn) override;

  std::unique_ptr<Event> make_event() override;
  void record(Event& e, StreamId s) override;
  void wait(StreamId s, const Event& e) override;

  // Immediate: virtual work is done as soon as it is enqueued.
  void synchronize(StreamId s) override {}
  void synchronize() override {}

  void drain_spans(std::vector<OpSpan>& out) override;
  // No ATen runs and the cost model prices time, not memory: always 0.
  uint64_t work_peak_bytes() const override { return 0; }
  void reset_work_peak() override {}
  std::shared_ptr<MemoryRegistrar> host_registrar() override { return nullptr; }
  // Prices compute at the cost model's fp16-accumulate rate from now on (CostModel::with_fp16_accumulate).
  void set_fp16_accumulate(bool on) override;

  // ---- virtual time ----
  const CostModel& model() const { return model_; }
  // The latest end over all streams: the device's makespan so far.
  double virtual_time_us() const;
  double stream_time_us(StreamId s) const;
  // When `e`'s latest record happens in virtual time; 0 if never recorded.
  double event_time_us(const Event& e) const;
  // Records `e` at `time_us` (host work finished then), for device streams to wait on.
  void record_at(Event& e, double time_us);
  // A new event already recorded at `time_us`.
  std::unique_ptr<Event> make_host_event(double time_us);
  // Every clock back to 0; events recorded before become never-recorded (their
  // waits no-ops). Spans not yet drained are kept, in the old time base.
  void reset_clock();
  uint64_t epoch() const;
  // A pool's devices share the host's memory bus (make_devices); nullptr: none.
  void share_host_memory(std::shared_ptr<SimHostMemory> host) { host_ = std::move(host); }
  SimHostMemory* host_memory() const { return host_.get(); }

 protected:
  void free_memory(std::byte* data, size_t bytes) noexcept override;

 private:
  // Places an op of `cost_us` on stream `s` (and `link` if a copy, and the
  // shared host memory's bus for its bytes); records its span.
  void place(StreamId s, OpKind kind, const OpTag& tag, double cost_us, double* link_clock);
  static int stream_index(StreamId s);

  CostModel model_;  // set_fp16_accumulate changes its compute rate, before any work
  bool fp16_accumulate_ = false;
  const DeviceOptions options_;

  mutable std::mutex mutex_;  // one host thread drives the engine, but keep the seam thread-safe
  DeviceLedger ledger_;       // accounted bytes (kAlignBytes); each maps a page-rounded range

  double clock_us_[kNumStreams] = {0, 0, 0};
  double h2d_link_us_ = 0;  // when the H2D direction is free (both directions if shared_bus)
  double d2h_link_us_ = 0;
  uint64_t epoch_ = 1;      // bumped by reset_clock(); events remember the epoch they were recorded in
  std::vector<OpSpan> spans_;
  std::shared_ptr<SimHostMemory> host_;
};

// "sim:<preset>[,key=value...]" -> a SimDevice (make_device uses this).
std::unique_ptr<Device> make_sim_device(std::string_view spec, const DeviceOptions& options);

}  // namespace strider
