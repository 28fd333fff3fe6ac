// The kernel-dependent terms of the working-memory model (ModelSpec::cost),
// measured on the device that will run the model.
//
// What ATen allocates inside an op depends on the kernels it picks, and those
// depend on the machine: a bf16 GEMM on a CPU without bf16 units writes its
// output in fp32 first and casts it, one with AVX-512 BF16 (or cuBLAS) writes
// bf16 directly; silu's backward likewise. So the model keeps those terms as
// coefficients, and a run measures them on its device, at shapes of its own
// (not any layer's), before it plans. `analytic()` is what the model assumed
// before it was measured: the staging every below-fp32 op may do, an upper
// bound for the machines measured so far, kept for `strider plan --predict`
// of another machine.
#pragma once

#include "gpu/device/device.h"  // plain C++: the model (engine/model/model_spec.h) includes this
#include "host/dtype.h"

namespace strider {

struct WorkCoefficients {
  // Bytes per output element that a below-fp32 GEMM stages beyond its output.
  double gemm_staging_bytes = 4;
  // Bytes per element that silu's backward stages below fp32 beyond its output.
  double silu_back_staging_bytes = 4;

  static WorkCoefficients analytic() { return {}; }
  bool operator==(const WorkCoefficients&) const = default;
};

// Runs a GEMM ([256, 96] x [96, 320]) and silu_backward ([256, 320]) in
// `dtype` (bf16, or fp16: ATen's kernels for the two stage differently on
// some CPUs, an AMD EPYC's fp16 GEMM less than its bf16 one) on `device`'s
// compute stream and reads each op's working memory from the
// device's meter. Each coefficient is the measured staging per element,
// rounded up to the next multiple of 0.5 byte, at most the analytic value
// (a kernel that staged more would make the analytic model no bound at all).
// A device that cannot measure its ops (no meter: the op's own output is not
// seen) gets analytic(). Synchronizes the device; call before the run starts.
WorkCoefficients measure_work_coefficients(Device& device, DType dtype = DType::kBF16);

}  // namespace strider
