// ATen's working memory: the counting CPU allocator sees what ATen allocates
// (on intra-op worker threads too), the CPU device puts each compute op's peak
// in its span, and a working-memory limit fails the op that exceeds it. The
// CUDA half ([cuda]) reads the caching allocator and skips without a GPU.
#include "tests/catch_torch.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>  // GetCPUAllocator: the raw interface oneDNN uses

#include <atomic>
#include <thread>
#include <vector>

#include "gpu/device/cpu_device.h"
#include "gpu/device/cuda_device.h"
#include "gpu/device/device.h"
#include "gpu/memory/aten_memory.h"
#include "host/error.h"

using namespace strider;

namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

// Bytes, as ATen allocates them (kByte: one per element, no rounding in c10).
at::Tensor bytes_tensor(uint64_t n) { return at::empty({int64_t(n)}, at::kByte); }

std::unique_ptr<Device> cpu_device(uint64_t work_limit = 0) {
  return make_device({.spec = "cpu", .record_spans = true, .work_limit_bytes = work_limit});
}

// Compute spans by name (copies and ops of other names left out).
std::vector<OpSpan> drained(Device& d) {
  std::vector<OpSpan> spans;
  d.drain_spans(spans);
  return spans;
}
const OpSpan& span_named(const std::vector<OpSpan>& spans, std::string_view name) {
  for (const OpSpan& s : spans)
    if (s.tag.name == name) return s;
  FAIL("no span named " << name);
  return spans.front();
}

// at::parallel_for over two chunks with two threads: chunk 1 runs on one of
// ATen's OpenMP workers, not on the caller. Allocates `alloc_bytes` there (and
// notes the live count while it holds them); returns the thread that ran it.
std::thread::id on_worker(uint64_t alloc_bytes, uint64_t* seen_live = nullptr) {
#ifndef _OPENMP
  FAIL("aten_memory_test.cpp was built without OpenMP: at::parallel_for would run on one thread "
       "(tests/gpu/CMakeLists.txt adds -fopenmp when CMake finds OpenMP)");
#endif
  at::set_num_threads(2);
  std::thread::id worker;
  at::parallel_for(0, 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i != 1) continue;
      worker = std::this_thread::get_id();
      at::Tensor t = bytes_tensor(alloc_bytes);
      if (seen_live != nullptr) *seen_live = aten_cpu_counts().live_bytes;
    }
  });
  return worker;
}

}  // namespace

TEST_CASE("the counter counts what ATen allocates, until it is freed", "[gpu][aten_memory]") {
  install_aten_cpu_counter();
  install_aten_cpu_counter();  // idempotent
  REQUIRE(aten_cpu_counter_installed());
  const AtenCpuCounts before = aten_cpu_counts();
  {
    at::Tensor t = bytes_tensor(10 * kMiB);
    const AtenCpuCounts during = aten_cpu_counts();
    CHECK(during.live_bytes - before.live_bytes == 10 * kMiB);
    CHECK(during.allocations == before.allocations + 1);
    CHECK(during.peak_bytes >= before.live_bytes + 10 * kMiB);
    t.add_(1);  // the tensor's memory is real memory
  }
  CHECK(aten_cpu_counts().live_bytes == before.live_bytes);
  reset_aten_cpu_peak();
  CHECK(aten_cpu_counts().peak_bytes == aten_cpu_counts().live_bytes);

  // The raw interface, which oneDNN (ideep) allocates through: data == context
  // holds, and raw_deallocate finds the size.
  c10::Allocator* a = c10::GetCPUAllocator();
  void* p = a->raw_allocate(4096);
  CHECK(aten_cpu_counts().live_bytes == before.live_bytes + 4096);
  a->raw_deallocate(p);
  CHECK(aten_cpu_counts().live_bytes == before.live_bytes);
}

TEST_CASE("allocations on ATen's intra-op worker threads are counted", "[gpu][aten_memory]") {
  install_aten_cpu_counter();
  const uint64_t base = aten_cpu_counts().live_bytes;
  const uint64_t allocations = aten_cpu_counts().allocations;
  uint64_t seen = 0;
  WorkWatch watch(&aten_cpu_meter(), OpTag{"parallel"}, 0);
  const std::thread::id worker = on_worker(10 * kMiB, &seen);
  const uint64_t peak = watch.finish();
  REQUIRE(worker != std::this_thread::get_id());  // the chunk did run on a worker
  CHECK(seen >= base + 10 * kMiB);                 // ...and its allocation was counted there
  CHECK(peak >= 10 * kMiB);
  CHECK(aten_cpu_counts().allocations >= allocations + 1);
  CHECK(aten_cpu_counts().live_bytes == base);
}

TEST_CASE("the CPU device puts each compute op's working memory in its span", "[gpu][aten_memory][cpu_device]") {
  auto dev = cpu_device();
  DeviceBuffer buf = dev->allocate(4096, "buf");
  std::vector<uint8_t> host(4096, 1);
  std::atomic<bool> on_worker_thread{false};
  dev->copy_h2d(StreamId::kH2D, buf.data(), host.data(), 4096, OpTag{"h2d"});
  dev->launch(StreamId::kCompute, OpTag{"three then one", 2}, [](const LaunchContext&) {
    { at::Tensor t = bytes_tensor(3 * kMiB); }
    at::Tensor u = bytes_tensor(1 * kMiB);
  });
  dev->launch(StreamId::kCompute, OpTag{"nothing"}, [](const LaunchContext&) {});
  dev->launch(StreamId::kCompute, OpTag{"in workers", 3}, [&on_worker_thread](const LaunchContext&) {
    on_worker_thread = on_worker(5 * kMiB) != std::this_thread::get_id();
  });
  dev->synchronize();
  const std::vector<OpSpan> spans = drained(*dev);
  REQUIRE(spans.size() == 4);
  // Nothing else allocates ATen memory meanwhile (this thread waits), so the
  // figures are exact up to ATen's own bookkeeping.
  CHECK(span_named(spans, "three then one").work_peak_bytes >= 3 * kMiB);
  CHECK(span_named(spans, "three then one").work_peak_bytes < 3 * kMiB + 64 * 1024);
  CHECK(span_named(spans, "nothing").work_peak_bytes == 0);
  CHECK(span_named(spans, "h2d").work_peak_bytes == 0);  // copies are not ATen's
  REQUIRE(on_worker_thread);
  CHECK(span_named(spans, "in workers").work_peak_bytes >= 5 * kMiB);
  CHECK(dev->work_peak_bytes() == span_named(spans, "in workers").work_peak_bytes);
  dev->reset_work_peak();
  CHECK(dev->work_peak_bytes() == 0);
}

TEST_CASE("an op past the working-memory limit fails, naming itself, the bytes and the limit, and the device goes on",
          "[gpu][aten_memory][cpu_device]") {
  auto dev = cpu_device(4 * kMiB);
  const uint64_t live_before = aten_cpu_counts().live_bytes;
  std::atomic<bool> after_ran{false};
  dev->launch(StreamId::kCompute, OpTag{"within", 1}, [](const LaunchContext&) { bytes_tensor(1 * kMiB); });
  dev->launch(StreamId::kCompute, OpTag{"too big", 7}, [](const LaunchContext&) {
    at::Tensor held = bytes_tensor(1 * kMiB);
    bytes_tensor(8 * kMiB);
  });
  dev->launch(StreamId::kCompute, OpTag{"after", 2}, [&after_ran](const LaunchContext&) {
    bytes_tensor(2 * kMiB);
    after_ran = true;
  });
  CHECK_THROWS_WITH(dev->synchronize(),
                    Catch::Contains("'too big' (block 7)") && Catch::Contains("8388608 bytes") &&
                        Catch::Contains("1048576 bytes more than when it began") &&
                        Catch::Contains("limit of 4194304 bytes") && Catch::Contains("work_limit_bytes"));
  CHECK(after_ran);                    // later ops still run, as after any failed op
  CHECK_NOTHROW(dev->synchronize());   // reported once
  const std::vector<OpSpan> spans = drained(*dev);
  CHECK(span_named(spans, "too big").work_peak_bytes <= 4 * kMiB);  // the refused bytes never counted
  CHECK(span_named(spans, "after").work_peak_bytes >= 2 * kMiB);
  CHECK(aten_cpu_counts().live_bytes == live_before);  // nothing leaked by the refusal

  // Refused on an intra-op worker thread: at::parallel_for carries it to the op.
  dev->launch(StreamId::kCompute, OpTag{"too big in workers", 8}, [](const LaunchContext&) { on_worker(6 * kMiB); });
  CHECK_THROWS_WITH(dev->synchronize(), Catch::Contains("'too big in workers' (block 8)") &&
                                            Catch::Contains("6291456 bytes"));
  dev->launch(StreamId::kCompute, OpTag{"fine again"}, [](const LaunchContext&) { bytes_tensor(3 * kMiB); });
  CHECK_NOTHROW(dev->synchronize());
}

TEST_CASE("cuda: each compute op's working memory is the caching allocator's peak, and the limit holds",
          "[cuda][gpu][aten_memory]") {
  const CudaProbe probe = probe_cuda();
  if (probe.device_count == 0) {
    WARN("skipped: no GPU (" << probe.reason << ")");
    return;
  }
#if STRIDER_TEST_TORCH_CUDA
  auto on_gpu = [](uint64_t n) { return at::empty({int64_t(n)}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA)); };
  auto dev = make_device({.spec = "cuda:0", .budget_bytes = 64 * kMiB, .record_spans = true});
  dev->launch(StreamId::kCompute, OpTag{"eight", 1}, [&](const LaunchContext&) {
    at::Tensor t = on_gpu(8 * kMiB);
    t.fill_(1);
  });
  dev->synchronize();
  CHECK(dev->work_peak_bytes() >= 8 * kMiB);
  CHECK(dev->work_peak_bytes() < 8 * kMiB + kMiB);

  {
    auto limited = make_device({.spec = "cuda:0", .budget_bytes = 64 * kMiB, .work_limit_bytes = 4 * kMiB});
    CHECK_THROWS_WITH(limited->launch(StreamId::kCompute, OpTag{"too big", 7},
                                      [&](const LaunchContext&) { on_gpu(8 * kMiB).fill_(1); }),
                      Catch::Contains("'too big' (block 7)") && Catch::Contains("4194304"));
    limited->synchronize();
  }
  // The cap is process-wide; the limited device lifted it when it went.
  CHECK_NOTHROW(dev->launch(StreamId::kCompute, OpTag{"eight again"},
                            [&](const LaunchContext&) { on_gpu(8 * kMiB).fill_(1); }));
  dev->synchronize();
#else
  WARN("built without torch's CUDA half: the CUDA device measures no working memory");
#endif
}
