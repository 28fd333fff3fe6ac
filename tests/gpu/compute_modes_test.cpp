// Every device runs its launched closures in the same stated ATen modes
// (gpu/blocks/compute_modes.h): grad off, inference mode off, autocast off, whatever
// the calling thread's modes. CudaDevice runs closures on the caller's thread,
// so without the scope it would inherit torch.autocast or inference_mode
// where the CPU device's stream threads would not.
#include "tests/catch_torch.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>

#include "gpu/device/cuda_device.h"
#include "gpu/device/device.h"

using namespace strider;

namespace {

struct Modes {
  bool grad = true, inference = true, autocast_cpu = true, autocast_cuda = true;
};

// The modes a closure launched on `dev` saw, launched from a thread with
// grad, inference mode and autocast (CPU and CUDA) all on.
Modes seen_from_a_caller_in_every_mode(Device& dev) {
  Modes seen;
  c10::InferenceMode inference(true);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::autocast::set_autocast_enabled(at::kCUDA, true);
  dev.launch(StreamId::kCompute, OpTag{"modes"}, [&](const LaunchContext&) {
    seen = {at::GradMode::is_enabled(), c10::InferenceMode::is_enabled(),
            at::autocast::is_autocast_enabled(at::kCPU), at::autocast::is_autocast_enabled(at::kCUDA)};
  });
  dev.synchronize();
  // The caller's own modes are its again.
  CHECK(c10::InferenceMode::is_enabled());
  CHECK(at::autocast::is_autocast_enabled(at::kCPU));
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::set_autocast_enabled(at::kCUDA, false);
  return seen;
}

void check_stated(const Modes& m) {
  CHECK_FALSE(m.grad);
  CHECK_FALSE(m.inference);
  CHECK_FALSE(m.autocast_cpu);
  CHECK_FALSE(m.autocast_cuda);
}

}  // namespace

TEST_CASE("the CPU device's closures run in the stated ATen modes", "[gpu][compute_modes]") {
  auto dev = make_device({.spec = "cpu"});
  check_stated(seen_from_a_caller_in_every_mode(*dev));
}

TEST_CASE("cuda: the CUDA device's closures run in the stated ATen modes, not the caller's", "[cuda][gpu][compute_modes]") {
  const CudaProbe probe = probe_cuda();
  if (probe.device_count == 0) {
    WARN("skipped: no GPU (" << probe.reason << ")");
    return;
  }
  auto dev = make_device({.spec = "cuda:0"});
  check_stated(seen_from_a_caller_in_every_mode(*dev));
}
