// make_device: automatic choice with a stated reason, and explicit overrides.
#include <catch2/catch.hpp>

#include "gpu/device/cuda_device.h"
#include "gpu/device/device.h"
#include "host/error.h"

using namespace strider;

TEST_CASE("auto picks CUDA when a GPU is usable, else the CPU, and says why", "[gpu][make_device]") {
  const CudaProbe probe = probe_cuda();
  std::string why;
  DeviceOptions o;
  auto dev = make_device(o, &why);
  INFO("make_device(auto): " << dev->name() << " -- " << why);
  if (probe.device_count > 0) {
    CHECK(dev->kind() == DeviceKind::kCuda);
  } else {
    CHECK(dev->kind() == DeviceKind::kCpu);
    CHECK(!probe.reason.empty());
    CHECK_THAT(why, Catch::Contains(probe.reason));
  }
}

TEST_CASE("the \"cpu\" spec is honoured and unknown specs and unusable CUDA are refused clearly",
          "[gpu][make_device]") {
  DeviceOptions o;
  o.spec = "cpu";
  CHECK(make_device(o)->kind() == DeviceKind::kCpu);
  o.spec = "sim:h200";
  CHECK(make_device(o)->kind() == DeviceKind::kSim);
  o.spec = "tpu";
  CHECK_THROWS_WITH(make_device(o), Catch::Contains("\"tpu\" is not one of"));
  o.spec = "cuda:x";
  CHECK_THROWS_WITH(make_device(o), Catch::Contains("expected cuda:N"));
  const CudaProbe probe = probe_cuda();
  if (probe.device_count == 0) {
    o.spec = "cuda:0";
    CHECK_THROWS_WITH(make_device(o), Catch::Contains("cuda:0 requested but"));
  } else {
    o.spec = "cuda:" + std::to_string(probe.device_count);
    CHECK_THROWS_WITH(make_device(o), Catch::Contains("CUDA device(s) exist"));
  }
}
