// The sliding-window ring of the engine in miniature, run on any Device: K cache
// units, more blocks than units, H2D -> compute -> (D2H), with every ordering
// expressed as an event wait. Its result must be bit-identical to a serial
// loop; each wait can be dropped on purpose to prove the test catches it.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "gpu/device/cache_unit_pool.h"
#include "gpu/device/device.h"
#include "host/pinned_arena.h"

namespace strider::test {

enum class RingMode {
  kForward,   // compute reads the unit's params, writes an activation buffer; unit released by compute
  kBackward,  // compute writes the unit's gradients, D2H drains them; unit released by the D2H
};

// The waits of one ring, numbered for RingConfig::drop_wait.
//   0  the H2D into a reused unit waits for its release (pool)
//   1  compute waits for its block's H2D
//   2  the D2H waits for the compute it drains
inline constexpr int kRingWaits = 3;

struct RingConfig {
  RingMode mode = RingMode::kBackward;
  size_t units = 2;
  int blocks = 9;
  size_t elems = 2999;  // not a multiple of anything
  int drop_wait = -1;   // -1: keep all waits
};

// Enqueues on StreamId::kCompute: out[i] = float(params[i]) * 2 + block, for i < n.
using RingCompute = std::function<void(Device&, const uint16_t* params, float* out, size_t n, int block)>;

// Block b's bf16 parameters: finite, distinct per block and element.
inline uint16_t ring_param(int block, size_t i) {
  uint32_t h = static_cast<uint32_t>(block) * 2654435761u ^ static_cast<uint32_t>(i) * 40503u;
  h ^= h >> 13;
  const uint16_t sign = static_cast<uint16_t>((h & 1u) << 15);
  const uint16_t exponent = static_cast<uint16_t>((120 + (h >> 1) % 14) << 7);  // ~2^-7 .. 2^6
  return static_cast<uint16_t>(sign | exponent | ((h >> 5) & 0x7Fu));
}

// The scalar reference of the compute, also used by CPU-device closures.
inline float ring_value(uint16_t p, int block) {
  uint32_t bits = static_cast<uint32_t>(p) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x * 2.0f + static_cast<float>(block);  // *2 is exact: no contraction differences on a GPU
}

inline std::vector<float> ring_serial(const RingConfig& cfg) {
  std::vector<float> out(static_cast<size_t>(cfg.blocks) * cfg.elems);
  for (int b = 0; b < cfg.blocks; ++b)
    for (size_t i = 0; i < cfg.elems; ++i) out[b * cfg.elems + i] = ring_value(ring_param(b, i), b);
  return out;
}

struct RingResult {
  std::vector<float> out;
  size_t allocations_after_start = 0;  // device allocations made after the pool and buffers
  size_t pool_device_bytes = 0;
};

inline RingResult run_ring(Device& device, const RingConfig& cfg, const RingCompute& compute) {
  const size_t n = cfg.elems;
  const size_t blocks = static_cast<size_t>(cfg.blocks);
  // Pinned host memory: the source of every H2D and the target of every D2H.
  ArenaOptions ao;
  ao.lock = LockPolicy::kNone;
  ao.huge_pages = false;
  ao.name = "ring host buffers";
  PinnedArena arena(blocks * n * (2 + 4) + 4096, ao);
  if (auto r = device.host_registrar()) arena.attach(r);
  auto host_params = arena.carve_as<uint16_t>(blocks * n, "params");
  auto host_out = arena.carve_as<float>(blocks * n, "out");
  for (int b = 0; b < cfg.blocks; ++b)
    for (size_t i = 0; i < n; ++i) host_params[b * n + i] = ring_param(b, i);
  std::fill(host_out.begin(), host_out.end(), -1.0f);

  CacheUnitPoolOptions po;
  po.what = "ring units";
  const StreamId releaser = cfg.mode == RingMode::kForward ? StreamId::kCompute : StreamId::kD2H;
  if (cfg.drop_wait == 0) po.test_skip_release_wait = static_cast<int>(releaser);
  CacheUnitPool pool(device, cfg.units, n, po);
  DeviceBuffer activations;
  if (cfg.mode == RingMode::kForward) activations = device.allocate(blocks * n * sizeof(float), "activations");
  float* act = reinterpret_cast<float*>(activations.data());
  const size_t allocations_at_start = device.allocation_count();

  std::vector<std::unique_ptr<Event>> h2d_done, compute_done;
  for (size_t u = 0; u < cfg.units; ++u) {
    h2d_done.push_back(device.make_event());
    compute_done.push_back(device.make_event());
  }
  auto all_done = device.make_event();
  std::vector<const CacheUnit*> held(blocks, nullptr);

  // Prefetch: the H2D of block b is issued K-1 blocks before its compute.
  auto prefetch = [&](int b) {
    const CacheUnit& u = pool.acquire(StreamId::kH2D);
    held[b] = &u;
    device.copy_h2d(StreamId::kH2D, u.params_bf16, &host_params[b * n], n * 2, OpTag{"h2d params", b});
    device.record(*h2d_done[u.index], StreamId::kH2D);
  };
  const int ahead = static_cast<int>(cfg.units) - 1;
  for (int b = 0; b < std::min(ahead, cfg.blocks); ++b) prefetch(b);
  for (int b = 0; b < cfg.blocks; ++b) {
    if (b + ahead < cfg.blocks) prefetch(b + ahead);
    const CacheUnit& u = *held[b];
    if (cfg.drop_wait != 1) device.wait(StreamId::kCompute, *h2d_done[u.index]);
    const auto* params = static_cast<const uint16_t*>(u.params_bf16);
    if (cfg.mode == RingMode::kForward) {
      compute(device, params, act + b * n, n, b);
      pool.release(u, {StreamId::kCompute});
    } else {
      compute(device, params, u.grads_fp32, n, b);
      device.record(*compute_done[u.index], StreamId::kCompute);
      if (cfg.drop_wait != 2) device.wait(StreamId::kD2H, *compute_done[u.index]);
      device.copy_d2h(StreamId::kD2H, &host_out[b * n], u.grads_fp32, n * 4, OpTag{"d2h grads", b});
      pool.release(u, {StreamId::kD2H});
    }
  }
  if (cfg.mode == RingMode::kForward) {
    device.record(*all_done, StreamId::kCompute);
    if (cfg.drop_wait != 2) device.wait(StreamId::kD2H, *all_done);
    device.copy_d2h(StreamId::kD2H, host_out.data(), act, blocks * n * 4, OpTag{"d2h activations"});
  }
  device.synchronize();

  RingResult r;
  r.out.assign(host_out.begin(), host_out.end());
  r.allocations_after_start = device.allocation_count() - allocations_at_start;
  r.pool_device_bytes = pool.device_bytes();
  return r;
}

}  // namespace strider::test
