// SimDevice: the engine's schedule on virtual clocks. Toy cost models with
// round numbers give step times that are computed by hand in the comments; the
// device must reproduce them exactly (up to floating-point rounding).
#include <catch2/catch.hpp>
#include <tuple>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "gpu/device/cache_unit_pool.h"
#include "gpu/device/sim_device.h"
#include "host/error.h"
#include "ring.h"

using namespace strider;

namespace {

Approx us(double v) { return Approx(v).epsilon(1e-12).margin(1e-9); }

// A machine with round numbers: every price below is an integer number of µs.
//   compute: 0.5 TFLOP/s sustained = 5e5 FLOP/µs, +2 µs per op
//   h2d:     0.5 GB/s = 500 bytes/µs, +1 µs per copy
//   d2h:     1 GB/s = 1000 bytes/µs, +1 µs per copy
CostModel toy_model() {
  CostModel m;
  m.name = "toy";
  m.peak_tflops = 1;
  m.mfu = 0.5;
  m.compute_latency_us = 2;
  m.h2d_gbps = 0.5;
  m.d2h_gbps = 1;
  m.copy_latency_us = 1;
  m.device_memory_bytes = size_t{1} << 20;
  m.set_adam_params_per_s(1e9);
  return m;
}

DeviceOptions with_spans() {
  DeviceOptions o;
  o.record_spans = true;
  return o;
}

// The ring's compute: one launch of `flops`, whose closure must never run.
test::RingCompute priced_compute(double flops, std::shared_ptr<int> calls) {
  return [flops, calls](Device& dev, const uint16_t*, float*, size_t, int block) {
    dev.launch(StreamId::kCompute, OpTag{"forward", block, flops}, [calls](const LaunchContext&) { ++*calls; });
  };
}

std::vector<OpSpan> spans_of(std::vector<OpSpan> all, StreamId s) {
  std::vector<OpSpan> out;
  for (const OpSpan& sp : all)
    if (sp.stream == s) out.push_back(sp);
  return out;
}

}  // namespace

// tests/gpu/ring.h, forward mode, K = 2, 4 blocks of 1000 elements, unchanged:
// H2D of 2000 bytes per block (issued one block ahead; a unit is rewritten only
// after the compute that read it), one compute per block, then one D2H of all
// activations (4 x 1000 x 4 = 16000 bytes) after the last compute.
TEST_CASE("sim: transfers hidden behind compute give sum of compute + first H2D", "[gpu][sim_device]") {
  CostModel m = toy_model();
  // H = 1 + 2000/500 = 5 µs; C = 2 + 5e6/5e5 = 12 µs; D = 1 + 16000/1000 = 17 µs.
  // C >= H, so every H2D after the first hides behind the compute before it:
  //   h2d0 [0,5]  h2d1 [5,10]  c0 [5,17]  h2d2 waits c0: [17,22]  c1 [17,29]
  //   h2d3 waits c1: [29,34]  c2 [29,41]  c3 [41,53]  d2h [53,70]
  // step = H + 4C + D = 5 + 48 + 17 = 70 µs.
  SimDevice dev(m, with_spans());
  auto calls = std::make_shared<int>(0);
  test::RingConfig cfg;
  cfg.mode = test::RingMode::kForward;
  cfg.units = 2;
  cfg.blocks = 4;
  cfg.elems = 1000;
  test::run_ring(dev, cfg, priced_compute(5e6, calls));
  CHECK(*calls == 0);
  CHECK(dev.virtual_time_us() == us(70));
  CHECK(dev.stream_time_us(StreamId::kCompute) == us(53));

  std::vector<OpSpan> spans;
  dev.drain_spans(spans);
  const auto compute = spans_of(spans, StreamId::kCompute);
  REQUIRE(compute.size() == 4);
  for (int b = 0; b < 4; ++b) {  // back to back from the first H2D's end: the GPU never waits
    CHECK(compute[b].begin_us == us(5 + 12 * b));
    CHECK(compute[b].end_us == us(17 + 12 * b));
    CHECK(compute[b].tag.block == b);
  }
  const auto h2d = spans_of(spans, StreamId::kH2D);
  REQUIRE(h2d.size() == 4);
  const double h2d_begin[] = {0, 5, 17, 29};
  for (int b = 0; b < 4; ++b) {
    CHECK(h2d[b].begin_us == us(h2d_begin[b]));
    CHECK(h2d[b].end_us - h2d[b].begin_us == us(5));
    CHECK(h2d[b].tag.bytes == 2000);
  }
}

TEST_CASE("sim: a PCIe-bound window gives about the sum of the H2D copies", "[gpu][sim_device]") {
  CostModel m = toy_model();
  m.h2d_gbps = 0.1;
  // H = 1 + 2000/100 = 21 µs; C = 12; D = 17. H > C: the H2D lane never idles
  // (each unit is free again before the copy ahead of it ends):
  //   h2d0 [0,21] h2d1 [21,42] h2d2 [42,63] h2d3 [63,84]  (c0 [21,33] frees unit 0 long before 42)
  //   c1 [42,54]  c2 [63,75]  c3 [84,96]  d2h [96,113]
  // step = 4H + C + D = 84 + 12 + 17 = 113 µs (sum of H2D = 84, plus the last compute and the D2H).
  SimDevice dev(m, with_spans());
  auto calls = std::make_shared<int>(0);
  test::RingConfig cfg;
  cfg.mode = test::RingMode::kForward;
  cfg.units = 2;
  cfg.blocks = 4;
  cfg.elems = 1000;
  test::run_ring(dev, cfg, priced_compute(5e6, calls));
  CHECK(*calls == 0);
  CHECK(dev.virtual_time_us() == us(113));
  CHECK(dev.stream_time_us(StreamId::kH2D) == us(84));
  std::vector<OpSpan> spans;
  dev.drain_spans(spans);
  const auto compute = spans_of(spans, StreamId::kCompute);
  REQUIRE(compute.size() == 4);
  CHECK(compute[3].begin_us == us(84));  // the last compute waits for the last copy
}

// A two-step training schedule in miniature, the way the engine will drive a
// simulation: K = 2 units, 4 blocks of P = 1000 parameters; per block an H2D of
// its bf16 parameters, one compute (forward + backward), a D2H of its fp32
// gradients, then CPU AdamW on a host lane, priced from the CostModel. The
// next step's H2D of a block waits for that block's update (a host event).
struct StepTimes {
  double device_us = 0;     // SimDevice::virtual_time_us() after the step
  double optimizer_us = 0;  // the optimizer lane's clock after the step
};

std::vector<StepTimes> simulate_training(SimDevice& dev, int steps, std::vector<SimInterval>* updates = nullptr) {
  constexpr int kBlocks = 4;
  constexpr size_t kParams = 1000;
  const CostModel& model = dev.model();
  std::vector<uint16_t> host_params(kBlocks * kParams);
  std::vector<float> host_grads(kBlocks * kParams);
  CacheUnitPool pool(dev, 2, kParams);
  std::vector<std::unique_ptr<Event>> h2d_done, compute_done, d2h_done, update_done;
  for (int u = 0; u < 2; ++u) {
    h2d_done.push_back(dev.make_event());
    compute_done.push_back(dev.make_event());
  }
  for (int b = 0; b < kBlocks; ++b) {
    d2h_done.push_back(dev.make_event());
    update_done.push_back(dev.make_event());  // never recorded before the first update: waits are no-ops
  }
  SimHostLane optimizer;
  std::vector<StepTimes> out;
  for (int step = 0; step < steps; ++step) {
    std::vector<const CacheUnit*> held(kBlocks, nullptr);
    auto prefetch = [&](int b) {
      const CacheUnit& u = pool.acquire(StreamId::kH2D);
      held[b] = &u;
      dev.wait(StreamId::kH2D, *update_done[b]);  // the bf16 copy is written by the update
      dev.copy_h2d(StreamId::kH2D, u.params_bf16, &host_params[b * kParams], kParams * 2, OpTag{"h2d params", b});
      dev.record(*h2d_done[u.index], StreamId::kH2D);
    };
    prefetch(0);
    for (int b = 0; b < kBlocks; ++b) {
      if (b + 1 < kBlocks) prefetch(b + 1);
      const CacheUnit& u = *held[b];
      dev.wait(StreamId::kCompute, *h2d_done[u.index]);
      dev.launch(StreamId::kCompute, OpTag{"forward+backward", b, 4e6}, [](const LaunchContext&) {});
      dev.record(*compute_done[u.index], StreamId::kCompute);
      dev.wait(StreamId::kD2H, *compute_done[u.index]);
      dev.copy_d2h(StreamId::kD2H, &host_grads[b * kParams], u.grads_fp32, kParams * 4, OpTag{"d2h grads", b});
      dev.record(*d2h_done[b], StreamId::kD2H);
      pool.release(u, {StreamId::kCompute, StreamId::kD2H});
      // The host lane: AdamW starts when the gradients have landed and the lane is free.
      const SimInterval t = optimizer.run(dev.event_time_us(*d2h_done[b]), model.adam_us(kParams));
      dev.record_at(*update_done[b], t.end_us);
      if (updates != nullptr) updates->push_back(t);
    }
    out.push_back({dev.virtual_time_us(), optimizer.clock_us});
  }
  return out;
}

TEST_CASE("sim: an optimizer-bound step, with the host lane priced from the CostModel", "[gpu][sim_device]") {
  CostModel m;
  m.peak_tflops = 1;  // x mfu 1 = 1e6 FLOP/µs: compute 4e6 FLOP = 4 µs
  m.mfu = 1;
  m.h2d_gbps = 1;     // 1000 bytes/µs: H2D 2000 bytes = 2 µs, D2H 4000 bytes = 4 µs
  m.d2h_gbps = 1;
  m.set_adam_params_per_s(2e7);  // 1000 parameters = 50 µs
  m.device_memory_bytes = size_t{1} << 20;
  SimDevice dev(m, with_spans());
  std::vector<SimInterval> updates;
  const auto times = simulate_training(dev, 2, &updates);
  // Step 0 (no update to wait for):
  //   h2d0 [0,2]   h2d1 [2,4]   c0 [2,6]   d2h0 [6,10]   adam0 [10,60]
  //   h2d2 waits d2h0 (unit 0): [10,12]   c1 [6,10]   d2h1 [10,14]   adam1 [60,110]
  //   h2d3 waits d2h1 (unit 1): [14,16]   c2 [12,16]  d2h2 [16,20]   adam2 [110,160]
  //   c3 [16,20]  d2h3 [20,24]  adam3 [160,210]
  // Step 1: each H2D waits for its block's update:
  //   h2d0 [60,62]  h2d1 [110,112]  c0 [62,66]  d2h0 [66,70]  adam0 [210,260]
  //   h2d2 [160,162]  c1 [112,116]  d2h1 [116,120]  adam1 [260,310]
  //   h2d3 [210,212]  c2 [162,166]  d2h2 [166,170]  adam2 [310,360]
  //   c3 [212,216]  d2h3 [216,220]  adam3 [360,410]
  // The optimizer lane never idles after 10 µs: step 1 takes 4 x 50 = 200 µs.
  REQUIRE(times.size() == 2);
  CHECK(times[0].device_us == us(24));
  CHECK(times[0].optimizer_us == us(210));
  CHECK(times[1].device_us == us(220));
  CHECK(times[1].optimizer_us == us(410));
  const double step1 = std::max(times[1].device_us, times[1].optimizer_us) -
                       std::max(times[0].device_us, times[0].optimizer_us);
  CHECK(step1 == us(4 * m.adam_us(1000)));
  REQUIRE(updates.size() == 8);
  CHECK(updates[0].begin_us == us(10));  // waited for d2h0's event time
  CHECK(updates[4].begin_us == us(210)); // waited for the lane, not for d2h0 (70)

  std::vector<OpSpan> spans;
  dev.drain_spans(spans);
  const auto h2d = spans_of(spans, StreamId::kH2D);
  REQUIRE(h2d.size() == 8);
  const double step1_h2d_begin[] = {60, 110, 160, 210};  // = the end of each block's update
  for (int b = 0; b < 4; ++b) {
    CHECK(h2d[4 + b].tag.block == b);
    CHECK(h2d[4 + b].begin_us == us(step1_h2d_begin[b]));
  }
}

TEST_CASE("sim: launch never calls the closure and copies touch no memory", "[gpu][sim_device]") {
  SimDevice dev(toy_model());
  bool called = false;
  dev.launch(StreamId::kCompute, OpTag{"never", 0, 1e6}, [&called](const LaunchContext&) {
    called = true;
    throw Error("a SimDevice ran a closure");
  });
  DeviceBuffer buf = dev.allocate(4096, "buf");
  std::vector<uint8_t> host(4096, 0x5A);
  dev.copy_h2d(StreamId::kH2D, buf.data(), host.data(), host.size());
  dev.copy_d2h(StreamId::kD2H, host.data(), buf.data(), host.size());  // the device memory cannot even be read
  CHECK_NOTHROW(dev.synchronize());
  CHECK_FALSE(called);
  CHECK(std::all_of(host.begin(), host.end(), [](uint8_t v) { return v == 0x5A; }));
  CHECK_THROWS_WITH(dev.launch(StreamId::kCompute, OpTag{"empty"}, LaunchFn{}), Catch::Contains("empty closure"));
  CHECK_THROWS_WITH(dev.launch(StreamId::kCompute, OpTag{"bad", 3, -1}, [](const LaunchContext&) {}),
                    Catch::Contains("flops = -1"));
}

TEST_CASE("sim: events stamp virtual time and waits on unrecorded events are no-ops", "[gpu][sim_device]") {
  SimDevice dev(toy_model());
  auto never = dev.make_event();
  CHECK(never->query());
  never->synchronize();
  CHECK(dev.event_time_us(*never) == 0);
  dev.launch(StreamId::kCompute, OpTag{"c", 0, 5e6}, [](const LaunchContext&) {});  // [0, 12]
  dev.wait(StreamId::kCompute, *never);
  CHECK(dev.stream_time_us(StreamId::kCompute) == us(12));
  dev.wait(StreamId::kH2D, *never);
  CHECK(dev.stream_time_us(StreamId::kH2D) == 0);

  // record stamps the stream's clock; a wait raises another stream to it.
  auto done = dev.make_event();
  dev.record(*done, StreamId::kCompute);
  dev.launch(StreamId::kCompute, OpTag{"later", 1, 5e6}, [](const LaunchContext&) {});  // not part of `done`
  CHECK(dev.event_time_us(*done) == us(12));
  CHECK(done->query());  // no "now" in virtual time
  dev.wait(StreamId::kD2H, *done);
  CHECK(dev.stream_time_us(StreamId::kD2H) == us(12));
  CHECK(dev.virtual_time_us() == us(24));

  // Host events: work finished on a host lane at a virtual time.
  auto host = dev.make_host_event(100);
  dev.wait(StreamId::kH2D, *host);
  CHECK(dev.stream_time_us(StreamId::kH2D) == us(100));
  dev.record_at(*done, 30);  // re-recording moves the stamp
  CHECK(dev.event_time_us(*done) == us(30));
  CHECK_THROWS_WITH(dev.record_at(*done, -1), Catch::Contains("not a finite virtual time"));

  // reset_clock: everything back to 0, and older records are forgotten.
  dev.reset_clock();
  CHECK(dev.virtual_time_us() == 0);
  CHECK(dev.event_time_us(*host) == 0);
  dev.wait(StreamId::kH2D, *host);
  CHECK(dev.stream_time_us(StreamId::kH2D) == 0);

  // Another SimDevice's event (a pool's devices share one virtual time):
  // waited for like its own; recorded only by its own device.
  SimDevice other(toy_model());
  auto foreign = other.make_event();
  dev.wait(StreamId::kCompute, *foreign);  // never recorded: a no-op
  CHECK(dev.stream_time_us(StreamId::kCompute) == 0);
  other.record_at(*foreign, 500);
  CHECK(dev.event_time_us(*foreign) == 500);
  dev.wait(StreamId::kCompute, *foreign);
  CHECK(dev.stream_time_us(StreamId::kCompute) == 500);
  CHECK_THROWS_WITH(dev.record(*foreign, StreamId::kCompute), Catch::Contains("made by another device"));
}

TEST_CASE("sim: device memory is fake but budgeted like CpuDevice", "[gpu][sim_device]") {
  DeviceOptions o;
  o.budget_bytes = 4096;
  SimDevice dev(toy_model(), o);
  CHECK(dev.budget_bytes() == 4096);
  DeviceBuffer a = dev.allocate(1000, "a");  // rounded to 1024
  CHECK(a.bytes() == 1024);
  CHECK(reinterpret_cast<uintptr_t>(a.data()) % SimDevice::kAlignBytes == 0);
  DeviceBuffer b = dev.allocate(3072, "b");
  CHECK(a.data() != b.data());
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
  DeviceBuffer c = dev.allocate(3072, "c");
  CHECK(dev.allocated_bytes() == 4096);

  // The default budget is the model's device memory; a huge one costs no RAM.
  SimDevice big(CostModel::preset("h200"));
  CHECK(big.budget_bytes() == size_t{139} << 30);
  DeviceBuffer huge = big.allocate(size_t{100} << 30, "100 GiB of cache units");
  CHECK(big.allocated_bytes() == size_t{100} << 30);
}

TEST_CASE("sim: copies refuse swapped host/device pointers, as CpuDevice does", "[gpu][sim_device]") {
  SimDevice dev(toy_model());
  DeviceBuffer buf = dev.allocate(1 << 12, "buf");
  std::vector<uint8_t> host(1 << 12);
  CHECK_THROWS_WITH(dev.copy_h2d(StreamId::kH2D, host.data(), host.data(), 16),
                    Catch::Contains("not inside one device allocation"));
  CHECK_THROWS_WITH(dev.copy_h2d(StreamId::kH2D, buf.data(), buf.data() + 64, 16),
                    Catch::Contains("is device memory, expected host memory"));
  CHECK_THROWS_WITH(dev.copy_d2h(StreamId::kD2H, host.data(), buf.data() + 4000, 200),
                    Catch::Contains("not inside one device allocation"));
  CHECK(dev.virtual_time_us() == 0);  // refused copies cost nothing
}

TEST_CASE("sim: a copy of rows is priced as one copy of its bytes", "[gpu][sim_device]") {
  SimDevice dev(toy_model(), with_spans());
  DeviceBuffer buf = dev.allocate(8000, "buf");
  std::vector<uint8_t> host(20000);
  // 10 rows of 300 bytes, 2000 apart: 1 + 3000/500 = 7 µs, not 10 x (1 + 300/500).
  dev.copy_h2d_rows(StreamId::kH2D, buf.data(), 300, host.data(), 2000, 300, 10, OpTag{"rows", 1});
  std::vector<OpSpan> spans;
  dev.drain_spans(spans);
  REQUIRE(spans.size() == 1);
  CHECK(spans[0].kind == OpKind::kCopyH2D);
  CHECK(spans[0].tag.bytes == 3000);
  CHECK(spans[0].end_us == us(7));
  CHECK_THROWS_WITH(dev.copy_h2d_rows(StreamId::kH2D, buf.data(), 800, host.data(), 1000, 300, 11),
                    Catch::Contains("copy_h2d_rows") && Catch::Contains("not inside one device allocation"));
  CHECK_THROWS_WITH(dev.copy_h2d_rows(StreamId::kH2D, buf.data(), 300, host.data(), 200, 300, 2),
                    Catch::Contains("rows of 300 bytes do not fit"));
}

TEST_CASE("sim: spans carry the model's times and PCIe is full duplex unless shared", "[gpu][sim_device]") {
  CostModel m = toy_model();
  SimDevice dev(m, with_spans());
  DeviceBuffer buf = dev.allocate(8000, "buf");
  std::vector<uint8_t> host(8000);
  dev.copy_h2d(StreamId::kH2D, buf.data(), host.data(), 3000, OpTag{"up", 1});  // 1 + 3000/500 = 7 µs: [0, 7]
  // An H2D on another stream shares the H2D direction of the link: 1 + 500/500 = 2 µs, [7, 9].
  dev.copy_h2d(StreamId::kCompute, buf.data(), host.data(), 500, OpTag{"up on compute", 2});
  dev.copy_d2h(StreamId::kD2H, host.data(), buf.data(), 8000, OpTag{"down", 3});  // 1 + 8000/1000 = 9 µs: [0, 9]
  dev.launch(StreamId::kCompute, OpTag{"fwd", 4, 1e7}, [](const LaunchContext&) {});  // 2 + 1e7/5e5 = 22 µs: [9, 31]
  std::vector<OpSpan> spans;
  dev.drain_spans(spans);
  REQUIRE(spans.size() == 4);
  CHECK(spans[0].kind == OpKind::kCopyH2D);
  CHECK(spans[0].tag.bytes == 3000);
  CHECK(spans[0].begin_us == 0);
  CHECK(spans[0].end_us == us(m.h2d_us(3000)));
  CHECK(spans[0].end_us == us(7));
  CHECK(spans[1].stream == StreamId::kCompute);
  CHECK(spans[1].kind == OpKind::kCopyH2D);
  CHECK(spans[1].begin_us == us(7));  // waited for the link, not for its (idle) stream
  CHECK(spans[1].end_us == us(9));
  CHECK(spans[2].kind == OpKind::kCopyD2H);
  CHECK(spans[2].begin_us == 0);  // full duplex: alongside the H2D copies
  CHECK(spans[2].end_us == us(9));
  CHECK(spans[3].kind == OpKind::kCompute);
  CHECK(spans[3].tag.flops == 1e7);
  CHECK(spans[3].tag.block == 4);
  CHECK(spans[3].begin_us == us(9));
  CHECK(spans[3].end_us == us(31));
  spans.clear();
  dev.drain_spans(spans);
  CHECK(spans.empty());

  m.shared_bus = true;
  SimDevice half(m, with_spans());
  DeviceBuffer hbuf = half.allocate(8000, "buf");
  half.copy_h2d(StreamId::kH2D, hbuf.data(), host.data(), 3000);
  half.copy_d2h(StreamId::kD2H, host.data(), hbuf.data(), 8000);
  half.drain_spans(spans);
  REQUIRE(spans.size() == 2);
  CHECK(spans[1].begin_us == us(7));  // one bus: the D2H waits for the H2D
  CHECK(half.virtual_time_us() == us(16));

  SimDevice quiet(m);  // without record_spans: the clocks run, no spans kept
  DeviceBuffer qbuf = quiet.allocate(8000, "buf");
  quiet.copy_h2d(StreamId::kH2D, qbuf.data(), host.data(), 3000);
  spans.clear();
  quiet.drain_spans(spans);
  CHECK(spans.empty());
  CHECK(quiet.virtual_time_us() == us(7));
}

TEST_CASE("cost model: presets, overrides and their errors", "[gpu][sim_device]") {
  CHECK(CostModel::preset_names() == std::vector<std::string>{"rtx3090", "rtx4090", "rtx5090", "a100-40gb",
                                                                "a100-80gb", "l40s", "h100", "h200"});
  // The vendors' dense BF16 tensor rates (gpu/device/sim_device.cpp cites each), memory and PCIe generation.
  for (auto [name, tflops, gib, gbps] : {std::tuple{"rtx3090", 71.0, 24, 25.0}, std::tuple{"rtx5090", 209.5, 32, 50.0},
                                         std::tuple{"a100-40gb", 312.0, 40, 25.0}, std::tuple{"a100-80gb", 312.0, 80, 25.0},
                                         std::tuple{"l40s", 362.05, 48, 25.0}, std::tuple{"h100", 989.0, 80, 50.0}}) {
    INFO(name);
    const CostModel m = CostModel::preset(name);
    CHECK(m.name == name);
    CHECK(m.peak_tflops == Approx(tflops));
    CHECK(m.device_memory_bytes == size_t((gib - 0.5) * double(size_t{1} << 30)));
    CHECK(m.h2d_gbps == gbps);
  }
  const CostModel r = CostModel::preset("rtx4090");
  CHECK(r.h2d_gbps == 25);
  CHECK(r.peak_tflops == Approx(165.2));
  // Its 16 cores outrun 70 GB/s in both formats: fp32 at 28 bytes per
  // parameter, q8 at 12.125 (2.3 times the parameters per second).
  CHECK(r.adam_params_per_s(StateFormat::kFp32) == Approx(2.5e9));
  CHECK(r.adam_params_per_s(StateFormat::kQ8) == Approx(70e9 / 12.125));
  CHECK(r.host_memory_gbps() == 70);
  // On 2 cores the q8 kernel's compute bounds it, not memory.
  const CostModel two = CostModel::parse("rtx4090,cpu_cores=2");
  CHECK(two.adam_params_per_s(StateFormat::kQ8) == Approx(2 * two.cpu_q8_core_params_per_s));
  CHECK(two.adam_us(1'000'000, StateFormat::kQ8) == Approx(1e6 / (2 * two.cpu_q8_core_params_per_s) * 1e6));
  CHECK_THAT(r.describe(), Catch::Contains("16 cores, memory 70 GB/s"));
  CHECK_THROWS_WITH(CostModel::parse("rtx4090,cpu_cores=2.5"), Catch::Contains("cpu_cores=2.5 must be a whole number"));
  CHECK_FALSE(r.shared_bus);
  const CostModel h = CostModel::preset("h200");
  CHECK(h.h2d_gbps == 50);
  CHECK(h.peak_tflops == 989);
  CHECK(h.adam_params_per_s(StateFormat::kFp32) == Approx(1e10));  // 280 GB/s / 28 bytes
  // 1 GB at 50 GB/s = 20 ms, plus the 10 µs copy setup.
  CHECK(h.h2d_us(1'000'000'000) == Approx(20'010));
  // 1e12 FLOP at 989 x 0.4 TFLOP/s, plus 10 µs.
  CHECK(h.compute_us(1e12) == Approx(1e6 / (989 * 0.4) + 10));
  for (const std::string& name : CostModel::preset_names()) CHECK_NOTHROW(CostModel::preset(name).validate());

  CHECK_THROWS_WITH(CostModel::preset("a100"),
                    Catch::Contains("no preset \"a100\"") && Catch::Contains("\"rtx4090\", \"rtx5090\""));

  const CostModel o = CostModel::parse("h200, h2d_gbps=12 ,mfu=0.35,shared_bus=true,cpu_mem_gbps=56");
  CHECK(o.h2d_gbps == 12);
  CHECK(o.d2h_gbps == 50);
  CHECK(o.mfu == 0.35);
  CHECK(o.shared_bus);
  CHECK(o.adam_params_per_s(StateFormat::kFp32) == Approx(2e9));
  CHECK(CostModel::parse("h200,cpu_adam_params_per_s=3e9").adam_params_per_s(StateFormat::kFp32) == Approx(3e9));
  CHECK(o.name == "h200,h2d_gbps=12,mfu=0.35,shared_bus=true,cpu_mem_gbps=56");
  CHECK_THAT(o.describe(), Catch::Contains("one shared bus") && Catch::Contains("h2d 12 GB/s"));

  CHECK_THROWS_WITH(CostModel::parse("h200,pcie_gbps=12"),
                    Catch::Contains("unknown key \"pcie_gbps\"") && Catch::Contains("h2d_gbps"));
  CHECK_THROWS_WITH(CostModel::parse("h200,h2d_gbps=fast"), Catch::Contains("h2d_gbps=fast is not a number"));
  CHECK_THROWS_WITH(CostModel::parse("h200,h2d_gbps=0"), Catch::Contains("h2d_gbps=0 must be > 0"));
  CHECK_THROWS_WITH(CostModel::parse("h200,mfu=1.5"), Catch::Contains("mfu=1.5 must be in (0, 1]"));
  CHECK_THROWS_WITH(CostModel::parse("h200,shared_bus=maybe"), Catch::Contains("not a boolean"));
  CHECK_THROWS_WITH(CostModel::parse("h200,h2d_gbps"), Catch::Contains("not key=value"));
  CHECK_THROWS_WITH(CostModel::parse(""), Catch::Contains("expected <preset>"));

  CostModel bad = toy_model();
  bad.d2h_gbps = -1;
  CHECK_THROWS_WITH(SimDevice(bad), Catch::Contains("d2h_gbps = -1"));
}

TEST_CASE("sim: \"sim:<preset>[,key=value...]\" builds a SimDevice", "[gpu][sim_device]") {
  DeviceOptions o;
  auto dev = make_sim_device("sim:rtx4090,h2d_gbps=12,memory_gib=8", o);
  CHECK(dev->kind() == DeviceKind::kSim);
  CHECK(dev->name() == "sim:rtx4090,h2d_gbps=12,memory_gib=8");
  CHECK(dev->budget_bytes() == size_t{8} << 30);
  auto& sim = dynamic_cast<SimDevice&>(*dev);
  CHECK(sim.model().h2d_gbps == 12);
  o.budget_bytes = 1 << 20;  // an explicit budget wins over the model's memory
  CHECK(make_sim_device("sim:h200", o)->budget_bytes() == size_t{1} << 20);
  CHECK_THROWS_WITH(make_sim_device("sim", o), Catch::Contains("expected sim:<preset>"));
  CHECK_THROWS_WITH(make_sim_device("sim:tpu", o), Catch::Contains("no preset \"tpu\""));
}
