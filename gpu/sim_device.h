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

#include "gpu/device.h"
#include "gpu/device_ledger.h"
#include "gpu/sim_host_memory.h"
#include "host/state_format.h"

namespace strider {

// One machine: the GPU, its PCIe link and the host lanes that feed it.
// Units: GB/s are 1e9 bytes per second; TFLOP/s are 1e12 FLOP per second.
struct CostModel {
  std::string name = "custom";  // preset name plus overrides, for messages

  // ---- the GPU ----
  double peak_tflops = 100;  // dense bf16 (and fp16) tensor-core peak with fp32 accumulation (datasheet)
  // Dense fp16 peak with fp16 accumulation (--matmul-accumulate fp16): a
  // GeForce part's is twice its fp32-accumulate rate, a data-centre part's
  // the same. 0: peak_tflops.
  double fp16_accumulate_tflops = 0;
  // This machine with its GEMMs accumulating fp16 in fp16: peak_tflops at that rate.
  CostModel with_fp16_accumulate() const;
  double mfu = 0.5;          // sustained fraction of peak for our block forward/backward ops
  double compute_latency_us = 0;  // fixed cost per launched op (host enqueue, launch gaps)
  size_t device_memory_bytes = size_t{16} << 30;  // usable device memory: the default budget

  // ---- PCIe ----
  double h2d_gbps = 25;          // sustained pinned host -> device
  double d2h_gbps = 25;          // sustained device -> pinned host
  double copy_latency_us = 0;    // fixed cost per copy (cudaMemcpyAsync setup, DMA start)
  // PCIe is full duplex: each direction has its own lanes, so an H2D and a D2H
  // overlap at full rate (false). true models one shared, half-duplex bus:
  // every copy, either way, waits for the previous one.
  bool shared_bus = false;

  // ---- the host (priced by the engine, not by SimDevice) ----
  // The CPU AdamW: each format's kernel runs at its rate per core on
  // cpu_cores cores, or as fast as the memory bus moves its bytes, whichever
  // is slower (adam_params_per_s).
  std::string cpu = "unnamed";            // what the preset assumes, for messages
  double cpu_cores = 16;                  // cores the optimizer's threads run on
  double cpu_mem_gbps = 70;               // sustained memory bandwidth (STREAM triad)
  // The kernels' rates on one core, data in cache so that memory does not
  // bound them: measured on an AMD EPYC core of the Zen 4 design (AVX-512),
  // the rtx4090 preset's Ryzen's, by build/bench/bench_adam --sizes 0.03
  // --threads 1 --reps 20: fp32 2057-2073 M parameters/s, q8 1247-1273 with
  // the VBMI kernel (with --sizes 0.25: 2050-2053 and 1240-1249; the kernel
  // before VBMI's byte permutations printed 1212-1219). An Intel Xeon core
  // (the machine of earlier sessions) gave fp32 1797 and q8 1100, q8 with
  // the kernel before its AVX-512 encode was rewritten. Every preset keeps
  // them.
  // Assumption: its cores run them as fast (a different clock or core
  // scales both).
  double cpu_adam_core_params_per_s = 2.05e9;
  double cpu_q8_core_params_per_s = 1.25e9;
  double nvme_read_gbps = 7;             // optimizer state read back from the NVMe tier
  double nvme_write_gbps = 5;            // optimizer state written to the NVMe tier

  // ---- between data-parallel ranks (priced by the engine) ----
  // What one rank's part of a collective moves per second (its share of a
  // gradient's reduce-scatter; with a compute copy per rank, of the
  // all-gather), and the fixed cost of each collective. On one machine the
  // ranks' collectives go through host memory (Gloo over loopback); between
  // machines, through the network (`strider plan --link` sets them).
  // Assumption for one machine: Gloo over loopback TCP moves ~5-10 GB/s per
  // stream on a current CPU; 6. Override it with a measurement.
  double collective_gbps = 6;
  double collective_latency_us = 50;
  // The host's memory bandwidth: what N GPUs' copies on one machine share.
  double host_memory_gbps() const { return cpu_mem_gbps; }

  // Bytes of memory traffic per parameter of one AdamW step with bf16
  // gradients. fp32: read w, m, v and the gradient; write w, m, v and the bf16
  // compute copy (12+2+12+2). q8: read and write the compute copy, the
  // master's extension byte, m's and v's codes (2 x 5), their groups' scales
  // (2 x 8 bytes per 128), and read the gradient (2).
  static constexpr double kAdamBytesPerParam = 28;
  static constexpr double kQ8AdamBytesPerParam = 12.125;
  static double adam_bytes_per_param(StateFormat format) {
    return format == StateFormat::kQ8 ? kQ8AdamBytesPerParam : kAdamBytesPerParam;
  }
  // The AdamW rate for a format's kernel: min(cores x its rate per core,
  // memory bandwidth / its bytes per parameter).
  double adam_params_per_s(StateFormat format) const;
  // Sets the fp32 rate to a measured figure: the memory bus to what it
  // implies, the cores to not bound it (the q8 rate follows the same bus).
  void set_adam_params_per_s(double fp32_params_per_s);

  // A named machine: "rtx4090", "h200". Unknown names throw, listing the known ones.
  static CostModel preset(std::string_view name);
  static std::vector<std::string> preset_names();
  // "<preset>[,key=value...]", e.g. "h200,h2d_gbps=12,mfu=0.35".
  static CostModel parse(std::string_view spec);
  // Sets one field from "key=value"; an unknown key or a bad value throws naming it.
  void apply_override(std::string_view key_value);
  // The keys apply_override knows, each with a line of help.
  static std::vector<std::pair<std::string, std::string>> override_keys();
  // Throws naming the first field that is not a usable rate (<= 0, NaN) or latency (< 0).
  void validate() const;
  // One line per field, for a plan's printout.
  std::string describe() const;

  // Prices, in microseconds.
  double sustained_tflops() const { return peak_tflops * mfu; }
  double compute_us(double flops) const;
  double h2d_us(uint64_t bytes) const;
  double d2h_us(uint64_t bytes) const;
  double adam_us(uint64_t params, StateFormat format = StateFormat::kFp32) const;
  double host_memory_us(uint64_t bytes) const;  // one pass over host memory (the bus, no compute)
  double nvme_read_us(uint64_t bytes) const;
  double nvme_write_us(uint64_t bytes) const;
  double collective_us(uint64_t bytes) const;
};

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
