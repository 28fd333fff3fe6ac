// make_device: picks the CUDA device when one is usable, else the CPU device;
// "cpu", "cuda" and "cuda:N" override the choice; "sim:<preset>[,key=value...]"
// builds a cost-model SimDevice.
#include <charconv>

#include "gpu/cpu_device.h"
#include "gpu/cuda_device.h"
#include "gpu/device.h"
#include "gpu/sim_device.h"
#include "host/error.h"

namespace strider {

std::unique_ptr<Device> make_device(const DeviceOptions& options, std::string* why) {
  const std::string& spec = options.spec;
  auto say = [&](std::string s) {
    if (why != nullptr) *why = std::move(s);
  };
  if (spec == "cpu") {
    say("cpu: asked for");
    return std::make_unique<CpuDevice>(options);
  }
  if (spec == "sim" || spec.rfind("sim:", 0) == 0) {
    say(fmt::format("{}: asked for (cost model, no work runs)", spec));
    return make_sim_device(spec, options);
  }
  if (spec == "auto" || spec.empty()) {
    const CudaProbe probe = probe_cuda();
    if (probe.device_count > 0) {
      say(fmt::format("cuda:0: {} CUDA device(s) found", probe.device_count));
      return make_cuda_device(0, options);
    }
    say(fmt::format("cpu: {}", probe.reason));
    return std::make_unique<CpuDevice>(options);
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
    say(fmt::format("cuda:{}: asked for", ordinal));
    return make_cuda_device(ordinal, options);
  }
  throw Error(fmt::format("device \"{}\" is not one of \"auto\", \"cpu\", \"cuda\", \"cuda:N\", "
                          "\"sim:<preset>[,key=value...]\"",
                          spec));
}

}  // namespace strider
