#include "gpu/memory/work_calibration.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "gpu/blocks/unit_tensors.h"  // aten_device
#include "host/error.h"

namespace strider {
namespace {

// The working memory of `fn` (run alone on the compute stream) above what
// was live when it began, its output included.
template <class F>
uint64_t measured_peak(Device& device, const char* name, F&& fn) {
  device.synchronize();
  device.reset_work_peak();
  device.launch(StreamId::kCompute, {name}, [&](const LaunchContext&) { fn(); });
  device.synchronize();
  return device.work_peak_bytes();
}

// Staging per element beyond `out_bytes`, rounded up to half bytes, capped.
double staging_per_elem(uint64_t peak, uint64_t out_bytes, int64_t elems, double cap) {
  const double extra = double(peak > out_bytes ? peak - out_bytes : 0) / double(elems);
  return std::min(cap, std::ceil(extra * 2.0) / 2.0);
}

}  // namespace

WorkCoefficients measure_work_coefficients(Device& device, DType dtype) {
  const WorkCoefficients analytic = WorkCoefficients::analytic();
  if (device.kind() == DeviceKind::kSim) return analytic;
  // Shapes no layer of a real model has, so that a test measuring layers
  // does not check the calibration against itself.
  STRIDER_CHECK(dtype == DType::kBF16 || dtype == DType::kF16, "working-memory calibration: {} is not bf16 or fp16",
                dtype_name(dtype));
  const int64_t m = 256, k = 96, n = 320;
  const auto opts =
      at::TensorOptions().dtype(dtype == DType::kF16 ? at::kHalf : at::kBFloat16).device(aten_device(device));
  at::Tensor a, b, g, x, out;
  device.launch(StreamId::kCompute, {"calibration inputs"}, [&](const LaunchContext&) {
    a = at::ones({m, k}, opts);
    b = at::ones({k, n}, opts);
    g = at::ones({m, n}, opts);
    x = at::ones({m, n}, opts);
  });
  const uint64_t out_bytes = uint64_t(m * n) * 2;
  const uint64_t gemm = measured_peak(device, "calibration gemm", [&] { out = at::matmul(a, b); });
  out.reset();
  if (gemm < out_bytes) return analytic;  // the meter saw less than the output: it does not measure
  const uint64_t silu = measured_peak(device, "calibration silu backward", [&] { out = at::silu_backward(g, x); });
  out.reset();
  device.launch(StreamId::kCompute, {"calibration inputs freed"}, [&](const LaunchContext&) {
    a.reset();
    b.reset();
    g.reset();
    x.reset();
  });
  device.synchronize();
  device.reset_work_peak();
  WorkCoefficients c;
  c.gemm_staging_bytes = staging_per_elem(gemm, out_bytes, m * n, analytic.gemm_staging_bytes);
  c.silu_back_staging_bytes = staging_per_elem(silu, out_bytes, m * n, analytic.silu_back_staging_bytes);
  return c;
}

}  // namespace strider
