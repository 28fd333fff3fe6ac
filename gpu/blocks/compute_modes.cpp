#include "gpu/blocks/compute_modes.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>

#include "gpu/device/device.h"

namespace strider {
namespace {

// Autocast off for one device type while alive; the thread's setting after.
class AutocastOff {
 public:
  explicit AutocastOff(at::DeviceType type) : type_(type), was_(at::autocast::is_autocast_enabled(type)) {
    at::autocast::set_autocast_enabled(type_, false);
  }
  ~AutocastOff() { at::autocast::set_autocast_enabled(type_, was_); }
  AutocastOff(const AutocastOff&) = delete;
  AutocastOff& operator=(const AutocastOff&) = delete;

 private:
  at::DeviceType type_;
  bool was_;
};

}  // namespace

void run_in_compute_modes(const std::function<void()>& body) {
  c10::InferenceMode not_inference(false);
  at::NoGradGuard no_grad;
  AutocastOff cpu(at::kCPU), cuda(at::kCUDA);
  body();
}

void install_compute_modes() { set_launch_scope(&run_in_compute_modes); }

}  // namespace strider
