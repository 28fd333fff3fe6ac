// The Device seam: everything the engine asks of a GPU, drawn small enough that
// a CPU device (tests, no GPU), the CUDA device and, later, a cost-model
// SimDevice all implement it. Plain C++: no torch, no CUDA headers here.
//
// The model is CUDA's: a stream runs its operations in order; an event marks a
// point in a stream; another stream (or the host) can wait for that point.
// Every operation carries an OpTag (what it is, which block, its cost) so a
// SimDevice can price it and the timeline can draw it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace strider {

class MemoryRegistrar;  // host/pinned_arena.h

enum class DeviceKind : uint8_t { kCpu, kCuda, kSim };  // kSim: gpu/device/sim_device.h, no memory, no work

// The lanes of the sliding window. Operations on one stream run in order;
// operations on different streams overlap unless an event orders them.
enum class StreamId : uint8_t { kCompute = 0, kH2D = 1, kD2H = 2 };
inline constexpr int kNumStreams = 3;
std::string_view stream_name(StreamId s);  // "compute", "h2d", "d2h"

enum class OpKind : uint8_t { kCopyH2D, kCopyD2H, kCompute };
std::string_view op_kind_name(OpKind k);
// Throws naming `op` unless each row fits its pitch on both sides and the
// rows' extent fits a size_t (Device::copy_h2d_rows).
void check_rows(size_t dst_pitch, size_t src_pitch, size_t row_bytes, size_t rows, const char* op);

// What an operation is, for the timeline and for a cost model.
struct OpTag {
  const char* name = "";  // a string literal ("h2d params", "forward"); must outlive the op
  int32_t block = -1;     // block index, -1 when not about one block
  double flops = 0;       // compute ops: floating-point operations (SimDevice, model FLOP/s)
  uint64_t bytes = 0;     // bytes moved; copies fill this in themselves
};

// One finished operation on one lane, in microseconds since the device started
// (CPU: the worker's wall clock; CUDA: event times against a start event).
struct OpSpan {
  StreamId stream = StreamId::kCompute;
  OpKind kind = OpKind::kCompute;
  OpTag tag;
  double begin_us = 0;
  double end_us = 0;
  // Compute ops on the compute stream: ATen's working memory, the most bytes
  // it held during the op above what it held when the op began (CPU: counted
  // by gpu/memory/aten_memory.h; CUDA: the caching allocator's allocated bytes). 0
  // where not measured (copies, other streams, SimDevice, no counter).
  uint64_t work_peak_bytes = 0;
};

// Handed to a closure run by Device::launch.
struct LaunchContext {
  DeviceKind kind = DeviceKind::kCpu;
  int ordinal = 0;               // CUDA device index; 0 on the CPU
  void* native_stream = nullptr; // cudaStream_t for our own kernels; nullptr on the CPU
  StreamId stream = StreamId::kCompute;
};
using LaunchFn = std::function<void(const LaunchContext&)>;

// What every launched closure runs inside, on every device that runs them
// (CpuDevice on its stream threads, CudaDevice on the caller's): the same
// stated ATen thread-local modes, whatever thread runs it and whatever modes
// its caller was in (torch.autocast, torch.inference_mode, grad mode). The
// seam knows no ATen: make_device registers the scope (gpu/blocks/compute_modes.h)
// in builds with torch. nullptr: none (the closure runs as is).
using LaunchScope = void (*)(const std::function<void()>& body);
void set_launch_scope(LaunchScope scope);
LaunchScope launch_scope();
// Runs `fn(ctx)` inside the registered scope.
inline void run_launched(const LaunchFn& fn, const LaunchContext& ctx) {
  if (LaunchScope scope = launch_scope()) scope([&] { fn(ctx); });
  else fn(ctx);
}

// A point in a stream. Made by Device::make_event. Only its device records
// it; any device of the same kind may wait for it (a pool's devices order
// their streams across devices that way; CUDA: cudaStreamWaitEvent), and any
// host thread may synchronize on it.
class Event {
 public:
  virtual ~Event() = default;
  // True when the work captured by the latest record() is done (or never recorded).
  virtual bool query() const = 0;
  // Blocks the calling host thread until query() would return true.
  virtual void synchronize() const = 0;
};

class Device;

// Device memory, owned. Freed (never throwing) when destroyed; the device must
// outlive it. Copies deleted, moves allowed.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device* device, std::byte* data, size_t bytes) : device_(device), data_(data), bytes_(bytes) {}
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;

  std::byte* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void reset() noexcept;
  Device* device_ = nullptr;
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
};

class Device {
 public:
  virtual ~Device() = default;

  // Which implementation, and a name for messages ("cpu", "cuda:0 NVIDIA H200").
  virtual DeviceKind kind() const = 0;
  virtual std::string name() const = 0;
  // CUDA device index (for at::Device); 0 on the CPU.
  virtual int ordinal() const = 0;

  // Allocates device memory; throws strider::Error naming `what`, the request and the budget.
  virtual DeviceBuffer allocate(size_t bytes, std::string_view what) = 0;
  // Bytes the device may hand out in total (the budget).
  virtual size_t budget_bytes() const = 0;
  // Bytes handed out now, the most ever handed out at once, and how many allocations so far.
  virtual size_t allocated_bytes() const = 0;
  virtual size_t peak_allocated_bytes() const = 0;
  virtual size_t allocation_count() const = 0;

  // Enqueues a copy of `bytes` from pinned host memory to device memory on `s`.
  virtual void copy_h2d(StreamId s, void* dst_device, const void* src_host, size_t bytes, OpTag tag = {}) = 0;
  // Enqueues a copy of `bytes` from device memory to pinned host memory on `s`.
  virtual void copy_d2h(StreamId s, void* dst_host, const void* src_device, size_t bytes, OpTag tag = {}) = 0;
  // Enqueues one copy of `rows` rows of `row_bytes` each from pinned host
  // memory, `src_pitch` bytes apart, to device memory `dst_pitch` bytes apart
  // (cudaMemcpy2DAsync): a strided range in one copy, not one per row (a
  // sub-layer piece's columns of down_proj are a row each of its [H, I]). A
  // GPU's DMA moves rows of a few KiB or more near its contiguous rate.
  virtual void copy_h2d_rows(StreamId s, void* dst_device, size_t dst_pitch, const void* src_host, size_t src_pitch,
                             size_t row_bytes, size_t rows, OpTag tag = {}) = 0;
  // Runs `fn` in stream order on `s`. CUDA: calls it now, on this thread, with
  // ATen's current stream set to `s`, so it only enqueues kernels; CPU: calls it
  // later on the stream's worker, which does the work. Capture by value.
  virtual void launch(StreamId s, OpTag tag, LaunchFn fn) = 0;

  // A new event, not yet recorded.
  virtual std::unique_ptr<Event> make_event() = 0;
  // Marks in `e` the point after all work enqueued on `s` so far.
  virtual void record(Event& e, StreamId s) = 0;
  // Makes later work on `s` wait for `e`'s latest record (a no-op if never
  // recorded). `e` may be another device's of the same kind (a pool).
  virtual void wait(StreamId s, const Event& e) = 0;

  // Blocks the host until all work enqueued on `s` so far is done; rethrows a failed op.
  virtual void synchronize(StreamId s) = 0;
  // Blocks until every stream is idle; rethrows a failed op.
  virtual void synchronize() = 0;

  // Moves the spans of finished ops into `out` (only with DeviceOptions::record_spans).
  virtual void drain_spans(std::vector<OpSpan>& out) = 0;

  // The largest OpSpan::work_peak_bytes of any compute op finished since the
  // device was made or reset_work_peak() (measured with or without spans).
  virtual uint64_t work_peak_bytes() const = 0;
  // Starts that maximum afresh; call with no compute op in flight.
  virtual void reset_work_peak() = 0;

  // What must register the pinned arena for this device (cudaHostRegister); nullptr if nothing.
  virtual std::shared_ptr<MemoryRegistrar> host_registrar() = 0;

  // Called on the host thread that drives a pass (enqueues its ops and waits
  // on them), before the pass. The CPU device releases that thread's idle
  // OpenMP workers so that its compute stream's team is the process's only
  // one (see CpuDevice); a GPU has nothing to do.
  virtual void prepare_driver_thread() {}

  // fp16 GEMMs accumulate in fp16 (ComputeOptions::fp16_accumulate): CUDA
  // sets cuBLAS's allow-fp16-accumulation around each launch, SimDevice
  // prices compute at its cost model's fp16-accumulate rate. The CPU device's
  // GEMMs accumulate in fp32 whatever is asked: it refuses (this default).
  virtual void set_fp16_accumulate(bool on);

 protected:
  friend class DeviceBuffer;
  // Returns memory from allocate(); never throws.
  virtual void free_memory(std::byte* data, size_t bytes) noexcept = 0;
};

// Chaos for the CPU device: random delays before queued operations, so that a
// missing wait shows up as a wrong result in a test.
struct ChaosOptions {
  bool enabled = false;
  uint64_t seed = 1;
  uint32_t max_delay_us = 200;  // each op sleeps 0 (half the time) or up to this
};

// A CUDA device's budget when none is given (strider's --device-budget auto,
// strider.EngineConfig's device_budget "auto"): its free memory at start less
// a margin for what strider does not allocate itself (the CUDA context's
// growth, cuBLAS workspaces, the caching allocator's rounding), 5% of the
// free memory and 512 MiB; 0 when the margin takes it all.
inline constexpr double kCudaBudgetMarginFraction = 0.05;
inline constexpr uint64_t kCudaBudgetMarginBytes = uint64_t{512} << 20;
inline uint64_t auto_cuda_budget_bytes(uint64_t free_bytes) {
  const double margin = kCudaBudgetMarginFraction * double(free_bytes) + double(kCudaBudgetMarginBytes);
  return double(free_bytes) > margin ? uint64_t(double(free_bytes) - margin) : 0;
}

struct DeviceOptions {
  std::string spec = "auto";  // "auto" (CUDA if a GPU is usable, else CPU), "cpu", "cuda", "cuda:N"
  size_t budget_bytes = 0;    // 0: CPU 1 GiB; CUDA auto_cuda_budget_bytes of its free memory at start-up
  bool record_spans = false;  // keep an OpSpan per copy and launch for drain_spans
  ChaosOptions chaos;         // CPU device only
  // ATen working memory one compute op may use (OpSpan::work_peak_bytes); 0:
  // no limit. An op that needs more fails naming itself, the bytes and the
  // limit: CPU, inside the op (reported by synchronize, like any failed op);
  // CUDA, from launch (the caching allocator capped to the limit, and each
  // op's peak checked after it is enqueued).
  uint64_t work_limit_bytes = 0;
  // A device of a pool (make_devices): its place in the pool, in its name
  // ("cpu:1") and in its chaos seed; -1: a device of its own.
  int pool_index = -1;
};

// The device `options.spec` asks for; "auto" says in `why` (if given) what it chose and why.
std::unique_ptr<Device> make_device(const DeviceOptions& options, std::string* why = nullptr);

// The devices of a pool (docs/pool.md, "How the pool runs"): `devices` is
// a count ("2": that many of `options.spec`'s kind: cuda:0..N-1 for CUDA, N
// CPU devices, each with its own streams, budget and chaos seed) or a list
// of specs ("cuda:0,cuda:2"); "" or "1": the one device `options.spec` names.
// Each gets `options`' budget. A GPU named twice is two devices on one card
// (they share its memory: it needs a budget, not auto). A simulated pool's
// devices share one host memory bus (gpu/device/sim_host_memory.h, SimHostMemory).
// Throws naming the entry that is not a device or a mix of kinds.
std::vector<std::unique_ptr<Device>> make_devices(const DeviceOptions& options, const std::string& devices);
// The specs make_devices would make (of `spec`'s kind for a count), without
// making them: its size is the pool's.
std::vector<std::string> pool_specs(const std::string& spec, const std::string& devices);

// What make_device would make of `spec`, without making it: the kind, the
// CUDA ordinal, and why ("auto" probes for a GPU). Throws on an unknown spec.
struct DeviceChoice {
  DeviceKind kind = DeviceKind::kCpu;
  int ordinal = 0;  // CUDA only
  std::string why;
};
DeviceChoice choose_device(const std::string& spec);

}  // namespace strider
