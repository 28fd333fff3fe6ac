// The ATen thread-local modes every launched closure runs under
// (gpu/device/device.h, LaunchScope), stated once for every device:
//   - grad mode off: a block turns it on where it builds a graph (its
//     backward's autograd over the attention core and the norms);
//   - inference mode off: a graph can then be built even when the caller is
//     inside torch.inference_mode();
//   - autocast off on the CPU and CUDA: the blocks choose their dtypes
//     themselves, and a caller inside torch.autocast must not change them.
// CudaDevice runs closures on the caller's thread, CpuDevice on its own: both
// now see these modes, so both compute the same maths.
#pragma once

#include <functional>

namespace strider {

// Runs `body` under the modes above, restoring the thread's own after.
void run_in_compute_modes(const std::function<void()>& body);
// Registers it as the launch scope (set_launch_scope); make_device calls it.
void install_compute_modes();

}  // namespace strider
