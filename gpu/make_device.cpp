// make_device: picks the CUDA device when one is usable, else the CPU device;
// "cpu", "cuda" and "cuda:N" override the choice; "sim:<preset>[,key=value...]"
// builds a cost-model SimDevice.
#include <charconv>
#include <set>

#include "gpu/device/cpu_device.h"
#include "gpu/device/cuda_device.h"
#include "gpu/device/device.h"
#include "gpu/device/sim_device.h"
#include "host/error.h"

#if STRIDER_HAVE_TORCH
#include "gpu/blocks/compute_modes.h"  // install_compute_modes: every device's launches in the same ATen modes
#include "gpu/memory/aten_memory.h"    // install_aten_cpu_counter: the CPU device's working-memory meter
#endif

namespace strider {
namespace {

std::unique_ptr<Device> make_cpu_device(const DeviceOptions& options) {
#if STRIDER_HAVE_TORCH
  // The CPU device measures (and limits) each op's working memory by counting
  // ATen's CPU allocations; without torch no ATen runs, so there is nothing to count.
  install_aten_cpu_counter();
#endif
  return std::make_unique<CpuDevice>(options);
}

}  // namespace

DeviceChoice choose_device(const std::string& spec) {
  if (spec == "cpu") return {DeviceKind::kCpu, 0, "cpu: asked for"};
  if (spec == "sim" || spec.rfind("sim:", 0) == 0)
    return {DeviceKind::kSim, 0, fmt::format("{}: asked for (cost model, no work runs)", spec)};
  if (spec == "auto" || spec.empty()) {
    const CudaProbe probe = probe_cuda();
    if (probe.device_count > 0)
      return {DeviceKind::kCuda, 0, fmt::format("cuda:0: {} CUDA device(s) found", probe.device_count)};
    return {DeviceKind::kCpu, 0, fmt::format("cpu: {}", probe.reason)};
  }
  if (spec == "cuda" || spec.rfind("cuda:", 0) == 0) {
    int ordinal = 0;
    if (spec.size() > 5) {
      const char* first = spec.data() + 5;
      const char* last = spec.data() + spec.size();
      auto [ptr, ec] = std::from_chars(first, last, ordinal);
      STRIDER_CHECK(ec == std::errc() && ptr == last && ordinal >= 0,
                    "device \"{}\": expected cuda:N with N a device index", spec);
    }
    return {DeviceKind::kCuda, ordinal, fmt::format("cuda:{}: asked for", ordinal)};
  }
  throw Error(fmt::format("device \"{}\" is not one of \"auto\", \"cpu\", \"cuda\", \"cuda:N\", "
                          "\"sim:<preset>[,key=value...]\"",
                          spec));
}

std::unique_ptr<Device> make_device(const DeviceOptions& options, std::string* why) {
#if STRIDER_HAVE_TORCH
  install_compute_modes();
#endif
  DeviceChoice c = choose_device(options.spec);
  if (why != nullptr) *why = std::move(c.why);
  switch (c.kind) {
    case DeviceKind::kCpu: return make_cpu_device(options);
    case DeviceKind::kSim: return make_sim_device(options.spec, options);
    case DeviceKind::kCuda: return make_cuda_device(c.ordinal, options);
  }
  throw Error(fmt::format("device \"{}\": no such kind", options.spec));
}

std::vector<std::string> pool_specs(const std::string& spec, const std::string& devices) {
  std::vector<std::string> specs;
  int count = 0;
  auto [ptr, ec] = std::from_chars(devices.data(), devices.data() + devices.size(), count);
  if (devices.empty()) {
    specs.push_back(spec);
  } else if (ec == std::errc() && ptr == devices.data() + devices.size()) {
    STRIDER_CHECK(count >= 1 && count <= 64, "--devices {}: a pool has 1 to 64 devices", devices);
    const DeviceChoice c = choose_device(spec);
    for (int i = 0; i < count; ++i)
      specs.push_back(count == 1 ? spec : c.kind == DeviceKind::kCuda ? fmt::format("cuda:{}", c.ordinal + i) : spec);
  } else {
    for (size_t at = 0; at <= devices.size();) {
      const size_t end = std::min(devices.find(',', at), devices.size());
      specs.push_back(devices.substr(at, end - at));
      STRIDER_CHECK(!specs.back().empty(), "--devices {}: an empty entry; give a count (2) or a list (cuda:0,cuda:2)",
                    devices);
      at = end + 1;
    }
    STRIDER_CHECK(specs.size() <= 64, "--devices {}: a pool has 1 to 64 devices", devices);
  }
  return specs;
}

std::vector<std::unique_ptr<Device>> make_devices(const DeviceOptions& options, const std::string& devices) {
  const std::vector<std::string> specs = pool_specs(options.spec, devices);
  std::vector<std::unique_ptr<Device>> out;
  std::set<int> gpus;
  for (size_t i = 0; i < specs.size(); ++i) {
    const DeviceChoice c = choose_device(specs[i]);
    // A GPU named twice is two devices sharing its memory (the GPU check's
    // pool on one card): each needs a budget the two fit in, not "auto".
    STRIDER_CHECK(c.kind != DeviceKind::kCuda || gpus.insert(c.ordinal).second || options.budget_bytes > 0,
                  "--devices {}: cuda:{} is named twice, so its devices share its memory; give --device-budget "
                  "(each device's) instead of auto", devices, c.ordinal);
    DeviceOptions o = options;
    o.spec = specs[i];
    if (specs.size() > 1) {
      o.pool_index = int(i);
      o.chaos.seed = options.chaos.seed + i;  // each device its own delays
    }
    out.push_back(make_device(o));
    STRIDER_CHECK(out.back()->kind() == out.front()->kind(), "--devices {}: {} and {} are of different kinds; a pool's "
                  "devices are all CPU or all CUDA", devices, out.front()->name(), out.back()->name());
  }
  // A simulated pool shares one host: its memory bus carries every device's copies.
  if (out.size() > 1 && out.front()->kind() == DeviceKind::kSim) {
    auto host = std::make_shared<SimHostMemory>(static_cast<SimDevice&>(*out.front()).model().host_memory_gbps());
    for (auto& d : out) static_cast<SimDevice&>(*d).share_host_memory(host);
  }
  return out;
}

}  // namespace strider
