// ATen's CPU working memory, counted: a c10 CPU allocator in front of the one
// ATen uses, process-wide, so the CPU device can measure (and limit) what each
// op allocates (gpu/device/work_meter.h). The CUDA device reads the caching
// allocator's own statistics instead (cuda_device.cpp).
//
// install_aten_cpu_counter() wraps c10::GetCPUAllocator() (normally c10's
// DefaultCPUAllocator) and installs the wrapper with c10::SetCPUAllocator, once
// per process. From then on every allocation ATen makes through the CPU
// allocator is counted while it lives, from whichever thread makes it: the op's
// own, ATen's intra-op workers (at::parallel_for), autograd's; that is why the
// count is process-wide and not per thread.
//
// Counted: CPU tensors and storages (at::empty and everything built on it:
// op outputs, temporaries, autograd's saved tensors and gradients), and oneDNN
// (ideep) buffers, which ATen allocates through the same allocator.
// Not counted: memory ATen does not take from the CPU allocator: tensors over
// foreign memory (at::from_blob: strider's units and pinned buffers), pinned
// host memory (its own allocator), kernels' std::vector / new[] scratch, BLAS
// (MKL, OpenBLAS) and OpenMP internal buffers, c10::alloc_cpu called directly,
// and tensor metadata (TensorImpl, sizes). Allocations made before the
// install are not counted when they are freed either.
// It stops counting new allocations if another CPU allocator is installed
// later with a higher priority (aten_cpu_counter_installed() then says false).
#pragma once

#include <cstdint>

#include "gpu/device/work_meter.h"

namespace strider {

// Installs the counter (idempotent, thread-safe) and registers it as the
// process's WorkMeter. Never uninstalled: tensors it allocated are freed
// through it up to the process's exit. Throws strider::Error if ATen's CPU
// allocator is not the counter afterwards (one of higher priority is set).
void install_aten_cpu_counter();
// True while ATen's CPU allocator is the counter.
bool aten_cpu_counter_installed();

struct AtenCpuCounts {
  uint64_t live_bytes = 0;   // allocated through the counter and not yet freed
  uint64_t peak_bytes = 0;   // the most live at once since the install or reset_aten_cpu_peak()
  uint64_t allocations = 0;  // allocations counted since the install
};
// All zero before the install.
AtenCpuCounts aten_cpu_counts();
// The peak starts again from the live bytes now.
void reset_aten_cpu_peak();

// The counter as a WorkMeter, for measuring work outside a device (benches);
// throws strider::Error before the install.
WorkMeter& aten_cpu_meter();

}  // namespace strider
