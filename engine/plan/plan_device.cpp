#include "engine/plan/plan_device.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "gpu/device/device.h"
#include "gpu/memory/work_calibration.h"

namespace strider {
namespace {

struct CpuRates {
  double compute_flops_per_s = 0, link_bytes_per_s = 0;
  WorkCoefficients work;
};

// A GEMM the shape of a layer's projection in the compute dtype and a 64 MiB
// memcpy, the best of three each; then the working-memory coefficients.
CpuRates measure_cpu(at::ScalarType dtype) {
  using clock = std::chrono::steady_clock;
  auto best_of_3 = [](auto&& f) {
    double best = 1e30;
    for (int i = 0; i < 3; ++i) {
      const auto t0 = clock::now();
      f();
      best = std::min(best, std::chrono::duration<double>(clock::now() - t0).count());
    }
    return best;
  };
  const int64_t n = 512, k = 1024;
  const at::Tensor a = at::randn({n, k}).to(dtype), b = at::randn({k, k}).to(dtype);
  const double gemm_s = best_of_3([&] { at::mm(a, b); });
  std::vector<std::byte> src(64 << 20, std::byte{1}), dst(src.size());
  const double copy_s = best_of_3([&] { std::memcpy(dst.data(), src.data(), src.size()); });
  CpuRates r;
  r.compute_flops_per_s = 2.0 * double(n) * double(k) * double(k) / std::max(gemm_s, 1e-9);
  r.link_bytes_per_s = double(src.size()) / std::max(copy_s, 1e-9);
  auto probe = make_device({.spec = "cpu"});
  r.work = measure_work_coefficients(*probe, dtype == at::kHalf ? DType::kF16 : DType::kBF16);
  return r;
}

const CpuRates& cpu_rates(at::ScalarType dtype) {
  static std::mutex mu;
  static std::map<at::ScalarType, CpuRates> measured;
  std::lock_guard lk(mu);
  auto it = measured.find(dtype);
  if (it == measured.end()) it = measured.emplace(dtype, measure_cpu(dtype)).first;
  return it->second;
}

}  // namespace

void set_device_rates(PlanLimits& l, const std::string& device_spec) {
  const DeviceKind kind = choose_device(device_spec).kind;
  l.device_memory_on_host = kind == DeviceKind::kCpu;
  if (device_spec.rfind("sim:", 0) == 0) {
    l.set_machine_rates(CostModel::parse(device_spec.substr(4)));
  } else if (kind == DeviceKind::kCpu) {
    const CpuRates& r = cpu_rates(l.dtype);
    l.compute_flops_per_s = r.compute_flops_per_s;
    l.link_bytes_per_s = r.link_bytes_per_s;
    l.host_memory_bytes_per_s = 2 * r.link_bytes_per_s;  // a memcpy reads and writes host memory
    l.work = r.work;
    l.work_measured = true;
  }
}

}  // namespace strider
