// CudaDevice: the same behaviours as on the CPU device. Every case is tagged
// [cuda] and skips (with a warning naming the reason) when no GPU is usable.
#include <catch2/catch.hpp>

#include "gpu/device/cache_unit_pool.h"
#include "gpu/device/cuda_device.h"
#include "gpu/device/device.h"
#include "host/error.h"
#include "host/pinned_arena.h"
#include "ring.h"
#include "ring_kernel.h"

using namespace strider;
using namespace strider::test;

namespace {

std::unique_ptr<Device> cuda_or_skip(DeviceOptions o = {}) {
  const CudaProbe p = probe_cuda();
  if (p.device_count == 0) {
    WARN("skipped: no GPU (" << p.reason << ")");
    return nullptr;
  }
  o.spec = "cuda:0";
  return make_device(o);
}

void cuda_compute(Device& d, const uint16_t* params, float* out, size_t n, int block) {
  d.launch(StreamId::kCompute, OpTag{"ring compute", block, 2.0 * n}, [=](const LaunchContext& ctx) {
    REQUIRE(ctx.kind == DeviceKind::kCuda);
    ring_compute_cuda(ctx.native_stream, params, out, n, block);
  });
}

}  // namespace

TEST_CASE("cuda: the ring is bit-identical to the serial loop, with no allocation after start", "[cuda][gpu]") {
  for (RingMode mode : {RingMode::kForward, RingMode::kBackward}) {
    for (size_t units : {size_t{1}, size_t{2}, size_t{3}}) {
      RingConfig cfg;
      cfg.mode = mode;
      cfg.units = units;
      cfg.blocks = 12;
      cfg.elems = (1 << 20) + 3;  // big enough that copies and kernels overlap
      DeviceOptions o;
      o.budget_bytes = units * CacheUnitPool::unit_bytes_for(cfg.elems) +
                       (mode == RingMode::kForward ? (cfg.blocks * cfg.elems * 4 + 255) / 256 * 256 : 0);
      auto dev = cuda_or_skip(o);
      if (!dev) return;
      INFO((mode == RingMode::kForward ? "forward" : "backward") << " K=" << units << " on " << dev->name());
      const RingResult r = run_ring(*dev, cfg, cuda_compute);
      REQUIRE(r.out == ring_serial(cfg));
      CHECK(r.allocations_after_start == 0);
      CHECK(dev->peak_allocated_bytes() <= dev->budget_bytes());
    }
  }
}

TEST_CASE("cuda: device memory stays under the byte budget", "[cuda][gpu]") {
  DeviceOptions o;
  o.budget_bytes = 1 << 20;
  auto dev = cuda_or_skip(o);
  if (!dev) return;
  DeviceBuffer a = dev->allocate(1000, "a");
  CHECK(a.bytes() == 1024);
  CHECK_THROWS_WITH(dev->allocate(1 << 20, "too much"), Catch::Contains("budget of 1048576 bytes"));
  CHECK(dev->allocation_count() == 1);
  CHECK(dev->peak_allocated_bytes() == 1024);
}

TEST_CASE("cuda: copies round-trip through registered pinned memory and events signal the host", "[cuda][gpu]") {
  auto dev = cuda_or_skip();
  if (!dev) return;
  auto never = dev->make_event();
  CHECK(never->query());
  ArenaOptions ao;
  ao.lock = LockPolicy::kNone;
  PinnedArena arena(size_t{8} << 20, ao);
  arena.attach(dev->host_registrar());
  auto src = arena.carve_as<uint32_t>(1 << 20, "src");
  auto dst = arena.carve_as<uint32_t>(1 << 20, "dst");
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint32_t>(i * 2654435761u);
  DeviceBuffer buf = dev->allocate(src.size_bytes(), "buf");
  auto up = dev->make_event();
  auto down = dev->make_event();
  dev->copy_h2d(StreamId::kH2D, buf.data(), src.data(), src.size_bytes());
  dev->record(*up, StreamId::kH2D);
  dev->wait(StreamId::kD2H, *up);
  dev->copy_d2h(StreamId::kD2H, dst.data(), buf.data(), dst.size_bytes());
  dev->record(*down, StreamId::kD2H);
  down->synchronize();
  CHECK(down->query());
  CHECK(std::equal(src.begin(), src.end(), dst.begin()));
}

TEST_CASE("cuda: spans time each copy and launch on its lane", "[cuda][gpu]") {
  DeviceOptions o;
  o.record_spans = true;
  auto dev = cuda_or_skip(o);
  if (!dev) return;
  RingConfig cfg;
  cfg.blocks = 4;
  const RingResult r = run_ring(*dev, cfg, cuda_compute);
  REQUIRE(r.out == ring_serial(cfg));
  std::vector<OpSpan> spans;
  dev->drain_spans(spans);
  REQUIRE(spans.size() == 3 * 4);  // per block: h2d, compute, d2h
  for (const OpSpan& s : spans) {
    CHECK(s.begin_us <= s.end_us);
    CHECK(s.tag.block >= 0);
  }
}
