// The plan's NVMe tier (engine/plan/plan_nvme.h): which blocks' state, and which
// layers' compute copies, go to NVMe, and what the drive then moves per step.
#include "engine/plan/plan_nvme.h"

#include <algorithm>

#include <fmt/format.h>

#include "engine/config/engine_config.h"
#include "engine/program/step_program.h"  // state_read_bytes, state_write_bytes

namespace strider {
namespace {

// The least n in [1, all] for which fits(n), given that fits(all) and that
// fits stays true as n grows: a binary search.
template <class Fits>
size_t fewest(size_t all, Fits fits) {
  size_t lo = 1, hi = all;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (fits(mid)) hi = mid;
    else lo = mid + 1;
  }
  return hi;
}

// Layers' compute copies may go to NVMe (placement.cpp refuses the rest by name).
bool can_move_compute(const ModelSpec& spec, const PlanLimits& l) {
  // A kept reference copy lives in RAM only, beside a compute copy in RAM.
  return spec.layers > 0 && !spec.lora.enabled() && l.state_shards <= 1 && !l.keep_reference;
}

uint64_t compute_copy_bytes(const ModelSpec& spec, const std::vector<int64_t>& blocks, int cbytes) {
  uint64_t n = 0;
  for (int64_t b : blocks) n += spec.layout(b).total_elems();
  return n * uint64_t(cbytes);
}

// What the drive reads and writes in a step: each NVMe piece's state read
// and written back (with its spilled gradients), its compute copy read
// before each of its two visits and written back.
std::pair<uint64_t, uint64_t> nvme_step_bytes(const Placement& pl, StateFormat format) {
  uint64_t read = 0, written = 0;
  for (int64_t q = 0; q < pl.num_pieces(); ++q) {
    const PiecePlace& at = pl.at(q);
    if (!at.on_nvme) continue;
    const size_t n = at.owned.elems();
    read += state_read_bytes(pl, format, q, n);
    written += state_write_bytes(pl, format, q, n) + (at.spills_grads ? n * pl.grad_bytes : 0);
    if (at.compute_on_nvme) read += 2 * pl.piece(q).elems() * pl.compute_bytes;
  }
  return {read, written};
}

}  // namespace

bool place_on_nvme(const ModelSpec& spec, const PlanLimits& l, PlanLimits& lim, Plan& p, EngineFootprint& f,
                   uint64_t arena_limit, const std::string& limit_text) {
  const int64_t blocks = spec.num_blocks();
  const int cbytes = l.dtype == at::kFloat ? 4 : 2;
  std::vector<size_t> elems(static_cast<size_t>(blocks));
  std::vector<int64_t> order(static_cast<size_t>(blocks));
  for (int64_t b = 0; b < blocks; ++b) {
    elems[size_t(b)] = spec.layout(b).total_elems();
    order[size_t(b)] = b;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return elems[size_t(a)] > elems[size_t(b)]; });
  // The fewest of the largest blocks whose moving makes it fit. From one
  // block on, each further one only takes its state out of RAM (the NVMe
  // staging and ring slots are already sized by the largest), so the RAM
  // needed falls with n and a binary search finds the n a scan would, in
  // log(blocks) footprints instead of blocks (a scan is quadratic in the
  // layers: minutes for a model of 10^5).
  lim.nvme_dir = l.nvme_dir;
  auto footprint_with = [&](size_t n) {
    Plan trial = p;
    trial.nvme_blocks.assign(order.begin(), order.begin() + ptrdiff_t(n));
    return footprint(spec, trial.engine_config(lim));
  };
  auto fits_with = [&](auto with, size_t n) { return with(n).host_bytes <= arena_limit; };
  f = footprint_with(order.size());  // all of them first: does anything fit?
  if (f.host_bytes <= arena_limit) {
    const size_t n = fewest(order.size(), [&](size_t k) { return fits_with(footprint_with, k); });
    f = footprint_with(n);
    p.nvme_blocks.assign(order.begin(), order.begin() + ptrdiff_t(n));
  } else if (can_move_compute(spec, l)) {
    // Every block's state on NVMe leaves too little: the layers' compute
    // copies go there too, the fewest that make it fit (each takes only
    // its copy out of RAM once the staging is sized, so again a binary
    // search). Every layer's reads are alike (its copy, once before its
    // forward and once before its backward); the last layers go first:
    // without clipping their updates come first, so their write-backs lead
    // the next step's reads the most. (Predicted on the rtx4090 preset,
    // Llama-3.1-70B on 128 GiB, batch 32 x 1024, q8 with clipping: 119
    // tokens/s so, 112 with the first layers first; fp32 87 and 88.)
    p.nvme_blocks = order;
    std::vector<int64_t> layers;
    for (int64_t b = blocks - 2; b >= 1; --b) layers.push_back(b);
    auto with_compute = [&](size_t n) {
      Plan trial = p;
      trial.nvme_compute_blocks.assign(layers.begin(), layers.begin() + ptrdiff_t(n));
      return footprint(spec, trial.engine_config(lim));
    };
    f = with_compute(layers.size());
    if (f.host_bytes <= arena_limit) {
      const size_t n = fewest(layers.size(), [&](size_t k) { return fits_with(with_compute, k); });
      f = with_compute(n);
      p.nvme_compute_blocks.assign(layers.begin(), layers.begin() + ptrdiff_t(n));
      std::sort(p.nvme_compute_blocks.begin(), p.nvme_compute_blocks.end());
    }
  }
  if (f.host_bytes > arena_limit) {
    p.reason = p.nvme_compute_blocks.empty() && !can_move_compute(spec, l)
                   ? fmt::format("needs {} of pinned host RAM even with all optimizer state on NVMe (the compute "
                                 "copy, {} gradient ring slots and the NVMe staging stay in RAM); the limit is {}",
                                 format_bytes(f.host_bytes), l.grad_ring, limit_text)
                   : fmt::format("needs {} of pinned host RAM even with all optimizer state and every layer's "
                                 "compute copy on NVMe (the embedding's and the head's compute copies, {} gradient "
                                 "ring slots, the NVMe staging and the compute copies' load staging stay in RAM); "
                                 "the limit is {}",
                                 format_bytes(f.host_bytes), l.grad_ring, limit_text);
    p.nvme_compute_blocks.clear();
    return false;
  }
  std::sort(p.nvme_blocks.begin(), p.nvme_blocks.end());
  p.why.push_back(fmt::format("optimizer state of {} of {} blocks on NVMe ({}): pinned RAM limit {}",
                              p.nvme_blocks.size(), blocks, format_bytes(f.nvme_bytes), limit_text));
  const Placement nvme_placed = place(spec, p.engine_config(lim));
  const auto [nvme_read, nvme_written] = nvme_step_bytes(nvme_placed, l.optimizer_state);
  if (!p.nvme_compute_blocks.empty())
    p.why.push_back(fmt::format("the compute copies of {} of {} layers on NVMe too, read ahead of each of their "
                                "visits ({} read twice a step, {} written once); {} of load staging in RAM",
                                p.nvme_compute_blocks.size(), spec.layers,
                                format_bytes(2 * compute_copy_bytes(spec, p.nvme_compute_blocks, cbytes)),
                                format_bytes(compute_copy_bytes(spec, p.nvme_compute_blocks, cbytes)),
                                format_bytes(kComputeLoadSlots * nvme_placed.compute_load_slot_bytes)));
  p.why.push_back(fmt::format("NVMe per step: {} read, {} written", format_bytes(nvme_read),
                              format_bytes(nvme_written)));
  p.why.push_back(fmt::format("their gradients through a ring of {} slots{}", l.grad_ring,
                              l.clip_norm > 0 || l.dtype == at::kHalf
                                  ? ", spilled to NVMe until the norm is known (clipping, loss scaling)"
                                  : ""));
  return true;
}

}  // namespace strider
