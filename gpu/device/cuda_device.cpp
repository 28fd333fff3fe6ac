// CudaDevice: see cuda_device.h. Compiled only when STRIDER_HAVE_CUDA.
#include "gpu/device/cuda_device.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <vector>

#include "gpu/device/cuda_check.h"
#include "gpu/device/cuda_handles.h"
#include "host/error.h"
#include "host/pinned_arena.h"

#if STRIDER_HAVE_TORCH_CUDA
#include <ATen/ATen.h>                      // the GEMMs that reserve cuBLAS workspaces
#include <ATen/Context.h>                   // lazyInitDevice: the caching allocator exists after it
#include <c10/cuda/CUDACachingAllocator.h>  // its statistics (working memory) and memory fraction (the limit)
#include <c10/cuda/CUDAGuard.h>             // CUDAStreamGuard: ATen's current stream for a scope
#include <c10/cuda/CUDAStream.h>            // getStreamFromExternal: wraps our cudaStream_t
#include <c10/util/Exception.h>             // c10::OutOfMemoryError
#endif

namespace strider {
namespace {

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

using cuda_detail::CudaEvent;
using cuda_detail::CurrentDevice;

#if STRIDER_HAVE_TORCH_CUDA
// at::globalContext()'s allow-fp16-accumulation for cuBLAS, set for a scope.
class Fp16AccumulateScope {
 public:
  explicit Fp16AccumulateScope(bool on) : was_(at::globalContext().allowFP16AccumulationCuBLAS()) {
    if (on != was_) at::globalContext().setAllowFP16AccumulationCuBLAS(on);
  }
  ~Fp16AccumulateScope() {
    if (at::globalContext().allowFP16AccumulationCuBLAS() != was_) at::globalContext().setAllowFP16AccumulationCuBLAS(was_);
  }
  Fp16AccumulateScope(const Fp16AccumulateScope&) = delete;
  Fp16AccumulateScope& operator=(const Fp16AccumulateScope&) = delete;

 private:
  bool was_;
};
#endif

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, const DeviceOptions& options) : ordinal_(ordinal), options_(options) {
    CurrentDevice cd(ordinal_);
    cudaDeviceProp prop{};
    STRIDER_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal_));
    size_t free_bytes = 0, total_bytes = 0;
    STRIDER_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    name_ = fmt::format("cuda:{} {} (sm_{}{}, {:.1f} GiB)", ordinal_, prop.name, prop.major, prop.minor,
                        total_bytes / double(1ull << 30));
    budget_bytes_ = options.budget_bytes != 0 ? options.budget_bytes : auto_cuda_budget_bytes(free_bytes);
    STRIDER_CHECK(budget_bytes_ > 0,
                  "{}: {} bytes free, no more than the margin of {:.0f}% and {} MiB kept for the CUDA context and "
                  "ATen's allocator; free GPU memory, or give the device budget a size",
                  name_, free_bytes, kCudaBudgetMarginFraction * 100, kCudaBudgetMarginBytes >> 20);
    STRIDER_CHECK(budget_bytes_ <= free_bytes,
                  "{}: device budget of {} bytes exceeds the {} bytes free on the GPU; lower the budget",
                  name_, budget_bytes_, free_bytes);
    for (auto& s : streams_) STRIDER_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    init_work_meter(total_bytes);
    if (options_.record_spans) {
      STRIDER_CUDA_CHECK(cudaStreamCreateWithFlags(&anchor_stream_, cudaStreamNonBlocking));
      cudaEvent_t epoch = nullptr;
      STRIDER_CUDA_CHECK(cudaEventCreate(&epoch));
      anchors_.push_back(Anchor{epoch, 0.0});
      STRIDER_CUDA_CHECK(cudaEventRecord(epoch, anchor_stream_));
      STRIDER_CUDA_CHECK(cudaEventSynchronize(epoch));
      anchor_host_ = std::chrono::steady_clock::now();
    }
  }

  ~CudaDevice() override {
    for (auto s : streams_) (void)cudaStreamSynchronize(s);
#if STRIDER_HAVE_TORCH_CUDA
    if (options_.work_limit_bytes > 0 && metering_) {
      try {  // the cap is process-wide: back to none, the default (a cap set before us is not restored)
        c10::cuda::CUDACachingAllocator::setMemoryFraction(1.0, static_cast<c10::DeviceIndex>(ordinal_));
      } catch (...) {
      }
    }
#endif
    for (auto& p : pending_) {
      (void)cudaEventDestroy(p.begin);
      (void)cudaEventDestroy(p.end);
    }
    for (auto e : spare_) (void)cudaEventDestroy(e);
    for (const Anchor& a : anchors_) (void)cudaEventDestroy(a.event);
    if (anchor_stream_ != nullptr) (void)cudaStreamDestroy(anchor_stream_);
    for (auto s : streams_) (void)cudaStreamDestroy(s);
  }
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override { return name_; }
  int ordinal() const override { return ordinal_; }

  DeviceBuffer allocate(size_t bytes, std::string_view what) override {
    STRIDER_CHECK(bytes > 0, "{}: allocation '{}' of 0 bytes", name_, what);
    const size_t rounded = round_up(bytes, 256);
    std::lock_guard lk(mem_mutex_);
    if (allocated_bytes_ + rounded > budget_bytes_) {
      throw Error(fmt::format(
          "{}: allocating '{}' of {} bytes would exceed the device budget of {} bytes ({} in use, {} free); "
          "raise the budget or shrink the request (fewer cache units)",
          name_, what, rounded, budget_bytes_, allocated_bytes_, budget_bytes_ - allocated_bytes_));
    }
    CurrentDevice cd(ordinal_);
    void* p = nullptr;
    cudaError_t rc = cudaMalloc(&p, rounded);
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();
      size_t free_bytes = 0, total_bytes = 0;
      (void)cudaMemGetInfo(&free_bytes, &total_bytes);
      throw Error(fmt::format("{}: cudaMalloc of {} bytes for '{}' failed: {} ({} bytes free on the GPU); "
                              "lower the device budget or free other GPU users",
                              name_, rounded, what, cudaGetErrorName(rc), free_bytes));
    }
    allocated_bytes_ += rounded;
    peak_bytes_ = std::max(peak_bytes_, allocated_bytes_);
    ++allocation_count_;
    return DeviceBuffer(this, static_cast<std::byte*>(p), rounded);
  }
  size_t budget_bytes() const override { return budget_bytes_; }
  size_t allocated_bytes() const override { std::lock_guard lk(mem_mutex_); return allocated_bytes_; }
  size_t peak_allocated_bytes() const override { std::lock_guard lk(mem_mutex_); return peak_bytes_; }
  size_t allocation_count() const override { std::lock_guard lk(mem_mutex_); return allocation_count_; }

  void copy_h2d(StreamId s, void* dst_device, const void* src_host, size_t bytes, OpTag tag) override {
    CurrentDevice cd(ordinal_);
    tag.bytes = bytes;
    traced(s, OpKind::kCopyH2D, tag, [&] {
      STRIDER_CUDA_CHECK(cudaMemcpyAsync(dst_device, src_host, bytes, cudaMemcpyHostToDevice, stream(s)));
    });
  }
  void copy_h2d_rows(StreamId s, void* dst_device, size_t dst_pitch, const void* src_host, size_t src_pitch,
                     size_t row_bytes, size_t rows, OpTag tag) override {
    check_rows(dst_pitch, src_pitch, row_bytes, rows, "copy_h2d_rows");
    if (rows == 0) return;
    CurrentDevice cd(ordinal_);
    tag.bytes = row_bytes * rows;
    traced(s, OpKind::kCopyH2D, tag, [&] {
      STRIDER_CUDA_CHECK(cudaMemcpy2DAsync(dst_device, dst_pitch, src_host, src_pitch, row_bytes, rows,
                                           cudaMemcpyHostToDevice, stream(s)));
    });
  }
  void copy_d2h(StreamId s, void* dst_host, const void* src_device, size_t bytes, OpTag tag) override {
    CurrentDevice cd(ordinal_);
    tag.bytes = bytes;
    traced(s, OpKind::kCopyD2H, tag, [&] {
      STRIDER_CUDA_CHECK(cudaMemcpyAsync(dst_host, src_device, bytes, cudaMemcpyDeviceToHost, stream(s)));
    });
  }
  void launch(StreamId s, OpTag tag, LaunchFn fn) override {
    STRIDER_CHECK(fn != nullptr, "{}: launch of an empty closure for '{}'", name_, tag.name);
    CurrentDevice cd(ordinal_);
    const LaunchContext ctx{DeviceKind::kCuda, ordinal_, stream(s), s};
    uint64_t work = 0;
    traced(
        s, OpKind::kCompute, tag,
        [&] {
#if STRIDER_HAVE_TORCH_CUDA
          // ATen enqueues on its "current" stream; make that ours for the closure.
          c10::cuda::CUDAStreamGuard guard(
              c10::cuda::getStreamFromExternal(stream(s), static_cast<c10::DeviceIndex>(ordinal_)));
          // ATen's switch is the process's, not the thread's: set for this
          // closure's GEMMs (the caller's thread enqueues them now), then
          // restored, so other ATen work in the process keeps its own.
          Fp16AccumulateScope acc(fp16_accumulate_);
          if (s == StreamId::kCompute && metering_) {
            work = metered(tag, [&] { run_launched(fn, ctx); });
            return;
          }
#endif
          run_launched(fn, ctx);
        },
        &work);
  }

  void set_fp16_accumulate(bool on) override { fp16_accumulate_ = on; }

  std::unique_ptr<Event> make_event() override { return std::make_unique<CudaEvent>(this, ordinal_); }
  void record(Event& e, StreamId s) override {
    CurrentDevice cd(ordinal_);
    STRIDER_CUDA_CHECK(cudaEventRecord(own(e).get(), stream(s)));
  }
  void wait(StreamId s, const Event& e) override {
    CurrentDevice cd(ordinal_);
    // Another GPU's event too (a pool): CUDA orders streams across devices.
    auto* ce = dynamic_cast<const CudaEvent*>(&e);
    STRIDER_CHECK(ce != nullptr, "{}: the event was not made by a CUDA device", name_);
    STRIDER_CUDA_CHECK(cudaStreamWaitEvent(stream(s), ce->get(), 0));
  }

  void synchronize(StreamId s) override {
    CurrentDevice cd(ordinal_);
    STRIDER_CUDA_CHECK(cudaStreamSynchronize(stream(s)));
  }
  void synchronize() override {
    for (int i = 0; i < kNumStreams; ++i) synchronize(static_cast<StreamId>(i));
  }

  void drain_spans(std::vector<OpSpan>& out) override {
    std::lock_guard lk(spans_mutex_);
    // The anchors' times, in order: each from the one before (seconds apart).
    for (size_t i = 1; i < anchors_.size(); ++i) {
      if (anchors_[i].us >= 0) continue;
      const cudaError_t rc = cudaEventQuery(anchors_[i].event);
      if (rc == cudaErrorNotReady) {
        (void)cudaGetLastError();
        break;
      }
      STRIDER_CUDA_CHECK(rc);
      float ms = 0;
      STRIDER_CUDA_CHECK(cudaEventElapsedTime(&ms, anchors_[i - 1].event, anchors_[i].event));
      anchors_[i].us = anchors_[i - 1].us + double(ms) * 1e3;
    }
    for (auto it = pending_.begin(); it != pending_.end();) {
      cudaError_t rc = cudaEventQuery(it->end);
      if (rc == cudaErrorNotReady) {
        (void)cudaGetLastError();
        ++it;
        continue;
      }
      STRIDER_CUDA_CHECK(rc);
      const Anchor& a = anchors_[it->anchor];
      if (a.us < 0) {  // its anchor's own time is not known yet (it always is by now: see traced)
        ++it;
        continue;
      }
      // Each span from its own events: its start a few seconds at most from
      // its anchor, its length from begin to end, both in float ms at about
      // 0.5 us; the anchors' times add up in double.
      float since_anchor_ms = 0, length_ms = 0;
      STRIDER_CUDA_CHECK(cudaEventElapsedTime(&since_anchor_ms, a.event, it->begin));
      STRIDER_CUDA_CHECK(cudaEventElapsedTime(&length_ms, it->begin, it->end));
      const double begin_us = a.us + double(since_anchor_ms) * 1e3;
      out.push_back(OpSpan{it->stream, it->kind, it->tag, begin_us, begin_us + double(length_ms) * 1e3,
                           it->work_peak_bytes});
      spare_.push_back(it->begin);
      spare_.push_back(it->end);
      it = pending_.erase(it);
    }
  }

  uint64_t work_peak_bytes() const override { return work_peak_.load(); }
  void reset_work_peak() override { work_peak_.store(0); }

  std::shared_ptr<MemoryRegistrar> host_registrar() override { return make_cuda_host_registrar(); }

 protected:
  void free_memory(std::byte* data, size_t bytes) noexcept override {
    std::lock_guard lk(mem_mutex_);
    int prev = 0;
    (void)cudaGetDevice(&prev);
    (void)cudaSetDevice(ordinal_);
    (void)cudaFree(data);
    (void)cudaSetDevice(prev);
    allocated_bytes_ -= bytes;
  }

 private:
  struct PendingSpan {
    StreamId stream;
    OpKind kind;
    OpTag tag;
    cudaEvent_t begin;
    cudaEvent_t end;
    uint64_t work_peak_bytes;
    size_t anchor;  // the anchor its begin is timed from (anchors_)
  };

  // ATen's working memory (docs/design.md: the plan counts it; this measures it).
  // A closure only enqueues kernels, but the caching allocator accounts each
  // allocation when it is made, on this host thread, and a freed block is
  // reused only by work later in the same stream: the allocated-bytes peak
  // during the closure is what the op holds on the device. The caching
  // allocator is per device and process-wide: ATen work another thread
  // enqueues on this GPU meanwhile is counted too, and the peak statistics
  // are reset at each op (torch.cuda.max_memory_allocated() in the same
  // process reads the last op's peak).
#if STRIDER_HAVE_TORCH_CUDA
  // cuBLAS (and cuBLASLt) keep a workspace per handle and stream, allocated
  // by ATen's caching allocator at the first GEMM on that stream: left to
  // then, it would be charged to that op's working memory against the limit.
  // One small GEMM per stream and dtype allocates them now, before any op is
  // metered; their bytes are held for the device's life and counted apart
  // (blas_workspace_bytes: inside the cap, outside every op's figure).
  void reserve_blas_workspaces() {
    namespace cca = c10::cuda::CUDACachingAllocator;
    const auto dev = static_cast<c10::DeviceIndex>(ordinal_);
    const int64_t before = cca::getDeviceStats(dev).allocated_bytes[0].current;
    for (cudaStream_t st : streams_) {
      c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(st, dev));
      for (at::ScalarType t : {at::kFloat, at::kBFloat16}) {
        const at::Tensor a = at::ones({64, 64}, at::TensorOptions().dtype(t).device(at::kCUDA, dev));
        (void)at::mm(a, a);
      }
      STRIDER_CUDA_CHECK(cudaStreamSynchronize(st));
    }
    const int64_t after = cca::getDeviceStats(dev).allocated_bytes[0].current;
    blas_workspace_bytes_ = after > before ? uint64_t(after - before) : 0;
  }
#endif

  void init_work_meter(size_t total_bytes) {
#if STRIDER_HAVE_TORCH_CUDA
    namespace cca = c10::cuda::CUDACachingAllocator;
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);  // creates the caching allocator's per-device state
    try {
      (void)cca::getDeviceStats(static_cast<c10::DeviceIndex>(ordinal_));
      metering_ = true;
      reserve_blas_workspaces();
    } catch (const std::exception& e) {
      // A pluggable allocator (torch.cuda.memory.CUDAPluggableAllocator) may keep no statistics.
      STRIDER_CHECK(options_.work_limit_bytes == 0,
                    "{}: a working-memory limit of {} bytes was asked for, but ATen's CUDA allocator keeps no "
                    "statistics to enforce it with ({})",
                    name_, options_.work_limit_bytes, e.what());
      return;
    }
    if (options_.work_limit_bytes > 0) {
      // The cap is on everything the caching allocator reserves on this GPU
      // in this process; strider's units are cudaMalloc'ed outside it. It
      // reserves in segments (up to 20 MiB for a 1-10 MiB request, 2 MiB
      // multiples above), so the cap leaves kSegmentSlackBytes for rounding;
      // the exact limit is checked on each op's peak after it is enqueued.
      const double cap = double(options_.work_limit_bytes + kSegmentSlackBytes + blas_workspace_bytes_);
      cca::setMemoryFraction(std::min(1.0, cap / double(total_bytes)), static_cast<c10::DeviceIndex>(ordinal_));
    }
#else
    STRIDER_CHECK(options_.work_limit_bytes == 0,
                  "{}: a working-memory limit of {} bytes was asked for, but this build has no torch CUDA "
                  "(STRIDER_HAVE_TORCH_CUDA) to measure ATen's allocations with",
                  name_, options_.work_limit_bytes);
#endif
  }

#if STRIDER_HAVE_TORCH_CUDA
  // Runs `body` (one compute closure) and returns ATen's working memory
  // during it; throws strider::Error, naming the op, when it exceeds the limit.
  template <class F>
  uint64_t metered(const OpTag& tag, F&& body) {
    namespace cca = c10::cuda::CUDACachingAllocator;
    const auto dev = static_cast<c10::DeviceIndex>(ordinal_);
    const uint64_t limit = options_.work_limit_bytes;
    // allocated_bytes[0]: StatType::AGGREGATE, whose namespace moved between torch versions.
    cca::resetPeakStats(dev);
    const int64_t base = cca::getDeviceStats(dev).allocated_bytes[0].current;
    try {
      body();
    } catch (const c10::OutOfMemoryError& e) {
      if (limit == 0) throw;
      throw Error(fmt::format("{}: op '{}' (block {}) ran out of ATen working memory under the limit of {} bytes "
                              "(DeviceOptions::work_limit_bytes; ATen's allocator capped at the limit + {} bytes): "
                              "{}; raise the limit, or shrink the micro-batch or the sequence",
                              name_, tag.name, tag.block, limit, kSegmentSlackBytes, e.what()));
    }
    const int64_t peak = cca::getDeviceStats(dev).allocated_bytes[0].peak;
    const uint64_t work = peak > base ? uint64_t(peak - base) : 0;
    if (work > work_peak_.load()) work_peak_.store(work);  // launches come from one host thread at a time
    STRIDER_CHECK(limit == 0 || work <= limit,
                  "{}: op '{}' (block {}) needed {} bytes of ATen working memory, over the limit of {} bytes "
                  "(DeviceOptions::work_limit_bytes); raise the limit, or shrink the micro-batch or the sequence",
                  name_, tag.name, tag.block, work, limit);
    return work;
  }
#endif

  cudaStream_t stream(StreamId s) const {
    const int i = static_cast<int>(s);
    STRIDER_CHECK(i >= 0 && i < kNumStreams, "{}: no stream {}", name_, i);
    return streams_[i];
  }
  const CudaEvent& own(const Event& e) const {
    auto* ce = dynamic_cast<const CudaEvent*>(&e);
    STRIDER_CHECK(ce != nullptr && ce->owner() == this,
                  "{}: event was made by another device; use this device's make_event()", name_);
    return *ce;
  }

  // Brackets the enqueue with timing events when spans are recorded.
  // `work`, if given, is read after the enqueue (the op's working memory).
  template <class F>
  void traced(StreamId s, OpKind kind, const OpTag& tag, F&& enqueue, const uint64_t* work = nullptr) {
    if (!options_.record_spans) {
      enqueue();
      return;
    }
    cudaEvent_t begin = take_timing_event();
    cudaEvent_t end = take_timing_event();
    size_t anchor = 0;
    try {
      anchor = current_anchor();
      STRIDER_CUDA_CHECK(cudaEventRecord(begin, stream(s)));
      enqueue();
      STRIDER_CUDA_CHECK(cudaEventRecord(end, stream(s)));
    } catch (...) {
      std::lock_guard lk(spans_mutex_);
      spare_.push_back(begin);
      spare_.push_back(end);
      throw;
    }
    std::lock_guard lk(spans_mutex_);
    pending_.push_back(PendingSpan{s, kind, tag, begin, end, work != nullptr ? *work : 0, anchor});
  }
  // The anchor a span recorded now is timed from: a new one every
  // kAnchorEvery, recorded on a stream with no work, so that it completes
  // when recorded and every event recorded after it is later on the GPU.
  // A float of milliseconds since one fixed epoch would lose resolution as
  // the run goes on (about 4 us after a minute, 0.25 ms after an hour).
  size_t current_anchor() {
    std::lock_guard lk(spans_mutex_);
    const auto now = std::chrono::steady_clock::now();
    if (now - anchor_host_ >= kAnchorEvery) {
      cudaEvent_t e = nullptr;
      STRIDER_CUDA_CHECK(cudaEventCreate(&e));
      anchors_.push_back(Anchor{e, -1.0});
      STRIDER_CUDA_CHECK(cudaEventRecord(e, anchor_stream_));
      anchor_host_ = now;
    }
    return anchors_.size() - 1;
  }
  cudaEvent_t take_timing_event() {
    {
      std::lock_guard lk(spans_mutex_);
      if (!spare_.empty()) {
        cudaEvent_t e = spare_.back();
        spare_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    STRIDER_CUDA_CHECK(cudaEventCreate(&e));
    return e;
  }

  static constexpr uint64_t kSegmentSlackBytes = uint64_t{32} << 20;

  const int ordinal_;
  const DeviceOptions options_;
  std::string name_;
  bool metering_ = false;               // ATen's allocator keeps statistics (torch CUDA builds)
  bool fp16_accumulate_ = false;        // set_fp16_accumulate: cuBLAS may accumulate fp16 GEMMs in fp16
  std::atomic<uint64_t> work_peak_{0};
  uint64_t blas_workspace_bytes_ = 0;  // cuBLAS workspaces reserved at start (reserve_blas_workspaces)
  size_t budget_bytes_ = 0;
  cudaStream_t streams_[kNumStreams] = {};

  mutable std::mutex mem_mutex_;
  size_t allocated_bytes_ = 0;
  size_t peak_bytes_ = 0;
  size_t allocation_count_ = 0;

  std::mutex spans_mutex_;
  // Span times: anchors_[0] is the epoch (recorded when the device was made);
  // us is each anchor's time since it, once known (-1 before).
  struct Anchor {
    cudaEvent_t event;
    double us;
  };
  static constexpr std::chrono::seconds kAnchorEvery{5};
  std::vector<Anchor> anchors_;
  std::chrono::steady_clock::time_point anchor_host_;
  cudaStream_t anchor_stream_ = nullptr;
  std::deque<PendingSpan> pending_;
  std::vector<cudaEvent_t> spare_;
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(int ordinal, const DeviceOptions& options) {
  const CudaProbe probe = probe_cuda();
  STRIDER_CHECK(probe.device_count > 0, "cuda:{} requested but {}; use the device \"cpu\"", ordinal, probe.reason);
  STRIDER_CHECK(ordinal >= 0 && ordinal < probe.device_count, "cuda:{} requested but only {} CUDA device(s) exist",
                ordinal, probe.device_count);
  return std::make_unique<CudaDevice>(ordinal, options);
}

}  // namespace strider
