// CpuDevice: stream order, events as cross-thread signals, the byte budget,
// copy checks, failed ops, timeline spans, and how it meters compute ops'
// working memory (with a stand-in meter: this binary links no torch; the real
// one is tested in aten_memory_test.cpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "gpu/device/cpu_device.h"
#include "gpu/device/work_meter.h"
#include "host/error.h"

using namespace strider;

namespace {
DeviceOptions chaos_options(uint64_t seed) {
  DeviceOptions o;
  o.spec = "cpu";
  o.chaos.enabled = true;
  o.chaos.seed = seed;
  o.chaos.max_delay_us = 100;
  return o;
}

// Holds `stream` on a gate the test opens, then stores `v` into `value`: so
// "not done yet" is certain rather than a matter of timing. Open the gate
// with the returned promise's set_value().
std::promise<void> gated_store(Device& dev, StreamId stream, std::atomic<int>& value, int v) {
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  dev.launch(stream, OpTag{"gate"}, [opened](const LaunchContext&) { opened.wait(); });
  dev.launch(stream, OpTag{"produce"}, [&value, v](const LaunchContext&) { value.store(v); });
  return gate;
}
}  // namespace

TEST_CASE("a stream runs its operations in order, under chaos", "[gpu][cpu_device]") {
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    CpuDevice dev(chaos_options(seed));
    std::vector<int> seen;  // touched only by the compute worker until synchronize
    for (int i = 0; i < 40; ++i) dev.launch(StreamId::kCompute, OpTag{"append"}, [&seen, i](const LaunchContext&) { seen.push_back(i); });
    dev.synchronize(StreamId::kCompute);
    REQUIRE(seen.size() == 40);
    for (int i = 0; i < 40; ++i) REQUIRE(seen[i] == i);
  }
}

TEST_CASE("an event orders work across streams and signals the host", "[gpu][cpu_device]") {
  CpuDevice dev(chaos_options(7));
  auto never = dev.make_event();
  CHECK(never->query());  // never recorded: complete, as in CUDA
  never->synchronize();
  dev.wait(StreamId::kCompute, *never);  // a no-op, must not block

  std::atomic<int> value{0};
  std::promise<void> gate = gated_store(dev, StreamId::kH2D, value, 42);
  auto produced = dev.make_event();
  dev.record(*produced, StreamId::kH2D);
  dev.wait(StreamId::kCompute, *produced);
  int consumed = -1;
  dev.launch(StreamId::kCompute, OpTag{"consume"}, [&](const LaunchContext&) { consumed = value.load(); });
  auto consumed_event = dev.make_event();
  dev.record(*consumed_event, StreamId::kCompute);

  CHECK_FALSE(produced->query());
  CHECK_FALSE(consumed_event->query());
  gate.set_value();
  consumed_event->synchronize();
  CHECK(produced->query());
  CHECK(consumed == 42);
  dev.synchronize();
}

TEST_CASE("device memory stays under the byte budget", "[gpu][cpu_device]") {
  DeviceOptions o;
  o.budget_bytes = 4096;
  CpuDevice dev(o);
  DeviceBuffer a = dev.allocate(1000, "a");  // rounded to 1024
  CHECK(a.bytes() == 1024);
  CHECK(reinterpret_cast<uintptr_t>(a.data()) % CpuDevice::kAlignBytes == 0);
  DeviceBuffer b = dev.allocate(3072, "b");
  CHECK(dev.allocated_bytes() == 4096);
  try {
    (void)dev.allocate(1, "one more");
    FAIL("allocation past the budget did not throw");
  } catch (const Error& e) {
    const std::string msg = e.what();
    CHECK_THAT(msg, Catch::Contains("budget of 4096 bytes") && Catch::Contains("'one more' of 256 bytes"));
  }
  { DeviceBuffer gone = std::move(b); }
  CHECK(dev.allocated_bytes() == 1024);
  CHECK(dev.peak_allocated_bytes() == 4096);
  CHECK(dev.allocation_count() == 2);
  DeviceBuffer c = dev.allocate(3072, "c");  // freed bytes are usable again
  CHECK(dev.allocated_bytes() == 4096);
}

TEST_CASE("copies move bytes and refuse swapped host/device pointers", "[gpu][cpu_device]") {
  CpuDevice dev(chaos_options(3));
  DeviceBuffer buf = dev.allocate(1 << 12, "buf");
  std::vector<uint8_t> src(1 << 12), dst(1 << 12, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  auto up = dev.make_event();
  dev.copy_h2d(StreamId::kH2D, buf.data(), src.data(), src.size());
  dev.record(*up, StreamId::kH2D);
  dev.wait(StreamId::kD2H, *up);
  dev.copy_d2h(StreamId::kD2H, dst.data(), buf.data(), dst.size());
  dev.synchronize();
  CHECK(dst == src);

  CHECK_THROWS_WITH(dev.copy_h2d(StreamId::kH2D, dst.data(), src.data(), 16),
                    Catch::Contains("not inside one device allocation"));
  CHECK_THROWS_WITH(dev.copy_h2d(StreamId::kH2D, buf.data(), buf.data() + 64, 16),
                    Catch::Contains("is device memory, expected host memory"));
  CHECK_THROWS_WITH(dev.copy_d2h(StreamId::kD2H, dst.data(), buf.data() + 4000, 200),
                    Catch::Contains("not inside one device allocation"));
}

TEST_CASE("a copy of rows takes each row from its pitch to its own, and refuses what does not fit", "[gpu][cpu_device]") {
  CpuDevice dev(chaos_options(5));
  DeviceBuffer buf = dev.allocate(64 * 12, "buf");  // 768 bytes: the 256-byte rounding adds none
  std::vector<uint8_t> src(100 * 12), back(64 * 12, 0), fill(64 * 12, 0xEE);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 13 + 5);
  dev.copy_h2d(StreamId::kH2D, buf.data(), fill.data(), fill.size());  // what lies between the rows stays
  // Rows of 24 bytes from 100 apart in the host to 64 apart on the device,
  // starting 8 bytes into each.
  dev.copy_h2d_rows(StreamId::kH2D, buf.data(), 64, src.data() + 8, 100, 24, 12, OpTag{"rows"});
  dev.synchronize(StreamId::kH2D);
  dev.copy_d2h(StreamId::kD2H, back.data(), buf.data(), back.size());
  dev.synchronize();
  for (size_t r = 0; r < 12; ++r)
    for (size_t b = 0; b < 64; ++b) {
      INFO("row " << r << " byte " << b);
      REQUIRE(back[r * 64 + b] == (b < 24 ? src[r * 100 + 8 + b] : 0xEE));
    }

  CHECK_THROWS_WITH(dev.copy_h2d_rows(StreamId::kH2D, buf.data(), 16, src.data(), 100, 24, 2),
                    Catch::Contains("copy_h2d_rows") && Catch::Contains("rows of 24 bytes do not fit"));
  CHECK_THROWS_WITH(dev.copy_h2d_rows(StreamId::kH2D, buf.data(), 64, src.data(), 100, 24, 13),
                    Catch::Contains("not inside one device allocation"));
  CHECK_THROWS_WITH(dev.copy_h2d_rows(StreamId::kH2D, buf.data(), 64, src.data(), SIZE_MAX / 4, 24, 8),
                    Catch::Contains("overflow"));
  dev.copy_h2d_rows(StreamId::kH2D, buf.data(), 64, src.data(), 100, 24, 0);  // nothing to do
  dev.synchronize();
}

TEST_CASE("a pool's devices wait for each other's events, and only its own device records one", "[gpu][cpu_device]") {
  DeviceOptions a_opt = chaos_options(3), b_opt = chaos_options(4);
  a_opt.pool_index = 0;
  b_opt.pool_index = 1;
  CpuDevice a(a_opt), b(b_opt);
  CHECK(b.name() == "cpu:1 (chaos seed 4)");
  std::atomic<int> value{0};
  std::promise<void> gate = gated_store(a, StreamId::kD2H, value, 7);
  auto handed = a.make_event();
  a.record(*handed, StreamId::kD2H);
  b.wait(StreamId::kH2D, *handed);  // device b's stream waits for device a's point
  int taken = -1;
  b.launch(StreamId::kH2D, OpTag{"take"}, [&](const LaunchContext&) { taken = value.load(); });
  auto took = b.make_event();
  b.record(*took, StreamId::kH2D);
  CHECK_FALSE(took->query());
  gate.set_value();
  took->synchronize();
  CHECK(taken == 7);
  CHECK_THROWS_WITH(b.record(*handed, StreamId::kH2D), Catch::Contains("made by another device"));
  b.launch(StreamId::kCompute, OpTag{"exploding op", 2}, [](const LaunchContext&) { throw Error("kaboom"); });
  CHECK_THROWS_WITH(b.synchronize(), Catch::StartsWith("cpu:1 (chaos seed 4): compute op 'exploding op'"));
  a.synchronize();
}

TEST_CASE("a failed operation surfaces at synchronize, naming it", "[gpu][cpu_device]") {
  CpuDevice dev;
  dev.launch(StreamId::kCompute, OpTag{"exploding op", 5}, [](const LaunchContext&) { throw Error("kaboom"); });
  bool later_ran = false;
  dev.launch(StreamId::kCompute, OpTag{"later"}, [&](const LaunchContext&) { later_ran = true; });
  CHECK_THROWS_WITH(dev.synchronize(), Catch::Contains("exploding op") && Catch::Contains("block 5") &&
                                           Catch::Contains("kaboom") && Catch::Contains("compute"));
  CHECK(later_ran);        // events after a failure still complete: no deadlocks
  CHECK_NOTHROW(dev.synchronize());  // reported once
}

TEST_CASE("spans record each copy and launch with its lane, tag and times", "[gpu][cpu_device]") {
  DeviceOptions o = chaos_options(11);
  o.record_spans = true;
  CpuDevice dev(o);
  DeviceBuffer buf = dev.allocate(4096, "buf");
  std::vector<uint8_t> host(4096, 1);
  std::atomic<int> contexts_ok{0};
  for (int b = 0; b < 3; ++b) {
    dev.copy_h2d(StreamId::kH2D, buf.data(), host.data(), 4096, OpTag{"h2d params", b});
    // Catch2 assertions are not thread-safe: note on the worker, check here.
    dev.launch(StreamId::kCompute, OpTag{"forward", b, 1e6}, [&contexts_ok](const LaunchContext& ctx) {
      if (ctx.kind == DeviceKind::kCpu && ctx.native_stream == nullptr && ctx.stream == StreamId::kCompute)
        ++contexts_ok;
    });
  }
  auto e = dev.make_event();
  dev.record(*e, StreamId::kD2H);  // event plumbing has no span
  dev.synchronize();
  std::vector<OpSpan> spans;
  dev.drain_spans(spans);
  CHECK(contexts_ok == 3);
  REQUIRE(spans.size() == 6);
  int h2d = 0, compute = 0;
  double last_end[kNumStreams] = {0, 0, 0};
  for (const OpSpan& s : spans) {
    CHECK(s.begin_us <= s.end_us);
    const int lane = static_cast<int>(s.stream);
    CHECK(s.begin_us >= last_end[lane]);  // one lane's ops never overlap
    last_end[lane] = s.end_us;
    if (s.kind == OpKind::kCopyH2D) {
      CHECK(s.stream == StreamId::kH2D);
      CHECK(s.tag.bytes == 4096);
      CHECK(s.tag.block == h2d++);
    } else {
      CHECK(s.kind == OpKind::kCompute);
      CHECK(std::string(s.tag.name) == "forward");
      CHECK(s.tag.flops == 1e6);
      CHECK(s.tag.block == compute++);
    }
  }
  spans.clear();
  dev.drain_spans(spans);
  CHECK(spans.empty());
}

namespace {
// Charges each watched op a fixed figure per begin() and refuses ops named
// "refused", as the real meter refuses an allocation past the limit.
class FakeMeter final : public WorkMeter {
 public:
  int begin(const OpTag& tag, uint64_t limit_bytes) override {
    if (std::string_view(tag.name) == "refused") throw Error(fmt::format("refused at limit {}", limit_bytes));
    limits.push_back(limit_bytes);
    names.emplace_back(tag.name);
    return int(names.size());
  }
  uint64_t end(int handle) noexcept override { return uint64_t(handle) * 1000; }
  const char* what() const override { return "fake"; }
  // Touched by the compute worker only, read after synchronize.
  std::vector<uint64_t> limits;
  std::vector<std::string> names;
};
}  // namespace

TEST_CASE("compute-stream launches are metered: the figure in the span and the maximum, the limit passed on",
          "[gpu][cpu_device]") {
  FakeMeter meter;
  register_work_meter(&meter);
  struct Unregister {
    ~Unregister() { register_work_meter(nullptr); }
  } unregister;
  DeviceOptions o;
  o.record_spans = true;
  o.work_limit_bytes = 12345;
  CpuDevice dev(o);
  dev.launch(StreamId::kCompute, OpTag{"first", 0}, [](const LaunchContext&) {});
  dev.launch(StreamId::kD2H, OpTag{"not compute", 1}, [](const LaunchContext&) {});
  dev.launch(StreamId::kCompute, OpTag{"second", 2}, [](const LaunchContext&) {});
  dev.synchronize();
  CHECK(meter.names == std::vector<std::string>{"first", "second"});  // the copy streams are not metered
  CHECK(meter.limits == std::vector<uint64_t>{12345, 12345});
  std::vector<OpSpan> spans;
  dev.drain_spans(spans);
  REQUIRE(spans.size() == 3);
  for (const OpSpan& s : spans) {
    const std::string name = s.tag.name;
    CHECK(s.work_peak_bytes == (name == "first" ? 1000u : name == "second" ? 2000u : 0u));
  }
  CHECK(dev.work_peak_bytes() == 2000);
  dev.reset_work_peak();
  CHECK(dev.work_peak_bytes() == 0);

  // A refusal while the op runs fails the op, as any failed op does.
  bool later_ran = false;
  dev.launch(StreamId::kCompute, OpTag{"refused", 4}, [](const LaunchContext&) {});
  dev.launch(StreamId::kCompute, OpTag{"later"}, [&](const LaunchContext&) { later_ran = true; });
  CHECK_THROWS_WITH(dev.synchronize(), Catch::Contains("'refused' (block 4)") && Catch::Contains("limit 12345"));
  CHECK(later_ran);
}

namespace {
// Counts the ops it watches at once.
class ConcurrencyMeter final : public WorkMeter {
 public:
  int begin(const OpTag&, uint64_t) override {
    std::lock_guard lk(mu);
    most = std::max(most, ++active);
    return 0;
  }
  uint64_t end(int) noexcept override {
    std::lock_guard lk(mu);
    --active;
    return 0;
  }
  const char* what() const override { return "concurrency"; }
  std::mutex mu;
  int active = 0, most = 0;
};
}  // namespace

TEST_CASE("metered compute of several CPU devices in one process takes turns: each op's figure is its own",
          "[gpu][cpu_device]") {
  // The process-wide meter cannot tell two devices' allocations apart, so
  // their metered ops never overlap.
  ConcurrencyMeter meter;
  register_work_meter(&meter);
  struct Unregister {
    ~Unregister() { register_work_meter(nullptr); }
  } unregister;
  CpuDevice a(DeviceOptions{}), b(DeviceOptions{});
  for (int i = 0; i < 6; ++i)
    for (CpuDevice* d : {&a, &b})
      d->launch(StreamId::kCompute, OpTag{"sleeps", i},
                [](const LaunchContext&) { std::this_thread::sleep_for(std::chrono::milliseconds(3)); });
  a.synchronize();
  b.synchronize();
  CHECK(meter.most == 1);  // unserialised, the two devices' 3 ms ops overlap: 2
}

TEST_CASE("without a meter nothing is measured, and a working-memory limit is refused at construction",
          "[gpu][cpu_device]") {
  REQUIRE(registered_work_meter() == nullptr);  // this binary links no torch: nothing registers one
  DeviceOptions o;
  o.record_spans = true;
  {
    CpuDevice dev(o);
    dev.launch(StreamId::kCompute, OpTag{"op"}, [](const LaunchContext&) { std::vector<char> v(1 << 20); });
    dev.synchronize();
    std::vector<OpSpan> spans;
    dev.drain_spans(spans);
    REQUIRE(spans.size() == 1);
    CHECK(spans[0].work_peak_bytes == 0);
    CHECK(dev.work_peak_bytes() == 0);
  }
  o.work_limit_bytes = 1 << 20;
  CHECK_THROWS_WITH(CpuDevice(o), Catch::Contains("limit of 1048576 bytes") && Catch::Contains("no WorkMeter"));
}

TEST_CASE("once host memory is registered, a copy's host side must lie in it, as a GPU pins it", "[gpu][cpu_device]") {
  CpuDevice dev(chaos_options(5));
  DeviceBuffer buf = dev.allocate(1 << 12, "buf");
  std::vector<uint8_t> plain(1 << 12, 1);
  dev.copy_h2d(StreamId::kH2D, buf.data(), plain.data(), 64);  // nothing registered: plain memory copies
  dev.synchronize();
  {
    PinnedArena arena(1 << 16, {.lock = LockPolicy::kNone, .huge_pages = false});
    auto copied = arena.carve(1 << 12, 256, "copied");
    auto state = arena.carve(1 << 12, 256, "state", ArenaUse::kHostOnly);
    arena.attach(dev.host_registrar(), ArenaPart::kCopied);
    dev.copy_h2d(StreamId::kH2D, buf.data(), copied.data(), copied.size());
    dev.copy_d2h(StreamId::kD2H, copied.data(), buf.data(), copied.size());
    dev.synchronize();
    CHECK_THROWS_WITH(dev.copy_h2d(StreamId::kH2D, buf.data(), state.data(), 64),
                      Catch::Contains("copy_h2d") && Catch::Contains("did not register") &&
                          Catch::Contains("ArenaUse::kCopied"));
    CHECK_THROWS_WITH(dev.copy_d2h(StreamId::kD2H, plain.data(), buf.data(), 64),
                      Catch::Contains("copy_d2h") && Catch::Contains("did not register"));
    // Registering the same memory twice is refused, as cudaHostRegister does.
    CHECK_THROWS_WITH(dev.host_registrar()->register_memory(copied.data(), 64), Catch::Contains("already registered"));
  }
  // The arena unregistered itself: plain memory copies again.
  dev.copy_h2d(StreamId::kH2D, buf.data(), plain.data(), 64);
  dev.synchronize();
}
