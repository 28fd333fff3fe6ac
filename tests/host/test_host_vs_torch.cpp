// host/ against code nobody here wrote: torch's AdamW/Adam and torch's bf16 cast.
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <ATen/ATen.h>

#include "tests/catch_torch.h"
#include <cmath>
#include <random>

#include "host/bf16.h"
#include "host/cpu_adam.h"

using namespace strider;

namespace {

// ||a - b|| / ||b|| and the worst element relative to max(|b|, floor).
struct Diff { double norm_rel = 0, max_rel = 0; };
Diff diff(const std::vector<float>& ours, const at::Tensor& ref, double floor) {
  const float* r = ref.data_ptr<float>();
  double num = 0, den = 0;
  Diff d;
  for (size_t i = 0; i < ours.size(); ++i) {
    const double e = double(ours[i]) - double(r[i]);
    num += e * e;
    den += double(r[i]) * r[i];
    d.max_rel = std::max(d.max_rel, std::abs(e) / std::max(std::abs(double(r[i])), floor));
  }
  d.norm_rel = std::sqrt(num / den);
  return d;
}

void compare_with_torch(AdamMode mode) {
  const int64_t n = 50'000;
  const int steps = 10;
  AdamHyper h{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.05, .mode = mode};
  at::manual_seed(1234);
  at::Tensor p0 = at::randn({n}, at::kFloat);
  std::vector<at::Tensor> grads;
  for (int s = 0; s < steps; ++s) grads.push_back(at::randn({n}, at::kFloat) * (0.1 * (s + 1)));

  at::Tensor param = p0.clone().set_requires_grad(true);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (mode == AdamMode::kAdamW) {
    opt = std::make_unique<torch::optim::AdamW>(
        std::vector<at::Tensor>{param},
        torch::optim::AdamWOptions(h.lr).betas({h.beta1, h.beta2}).eps(h.eps).weight_decay(h.weight_decay));
  } else {
    opt = std::make_unique<torch::optim::Adam>(
        std::vector<at::Tensor>{param},
        torch::optim::AdamOptions(h.lr).betas({h.beta1, h.beta2}).eps(h.eps).weight_decay(h.weight_decay));
  }

  std::vector<float> p(p0.data_ptr<float>(), p0.data_ptr<float>() + n), m(n, 0), v(n, 0);
  std::vector<uint16_t> out(n);
  for (int s = 1; s <= steps; ++s) {
    param.mutable_grad() = grads[s - 1].clone();
    opt->step();
    const at::Tensor& g = grads[s - 1];
    adam_update(Isa::kScalar, AdamStep::make(h, s),
                {p.data(), m.data(), v.data(), g.data_ptr<float>(), DType::kF32, out.data(), size_t(n)});
    Diff d = diff(p, param.detach(), 1e-2);
    INFO("step " << s << " norm_rel " << d.norm_rel << " max_rel " << d.max_rel);
    REQUIRE(d.norm_rel < 1e-6);
    REQUIRE(d.max_rel < 1e-5);
  }
}

}  // namespace

TEST_CASE("scalar AdamW tracks torch::optim::AdamW over 10 steps to 1e-6", "[host][adam][torch]") {
  compare_with_torch(AdamMode::kAdamW);
}

TEST_CASE("scalar Adam with L2 tracks torch::optim::Adam over 10 steps to 1e-6", "[host][adam][torch]") {
  compare_with_torch(AdamMode::kAdam);
}

TEST_CASE("bf16 rounding is bit-identical to torch's cast on edge values", "[host][bf16][torch]") {
  // Edge values by bit pattern, then a million random bit patterns (every
  // exponent, denormals, Inf, NaN) so torch's vectorised cast is exercised.
  std::vector<uint32_t> bits = {0x3f800000, 0x3f808000, 0x3f818000, 0x3f808001, 0x3f807fff,
                                0x7f7fffff, 0xff7fffff, 0x7f800000, 0xff800000, 0x00000001,
                                0x00018000, 0x00010000, 0x80018000, 0x007fffff, 0x00008000,
                                0x80000000, 0x00000000, 0x7fc00000, 0x7f800001, 0xffffffff};
  std::mt19937 rng(99);
  for (int i = 0; i < 1'000'000; ++i) bits.push_back(rng());
  at::Tensor f = at::from_blob(bits.data(), {int64_t(bits.size())}, at::kInt).view(at::kFloat);
  at::Tensor b = f.to(at::kBFloat16).view(at::kShort);
  const int16_t* tb = b.data_ptr<int16_t>();
  size_t nans = 0;
  for (size_t i = 0; i < bits.size(); ++i) {
    float x;
    std::memcpy(&x, &bits[i], 4);
    const uint16_t ours = float_to_bf16(x);
    const uint16_t theirs = static_cast<uint16_t>(tb[i]);
    if (std::isnan(x)) {
      // torch's scalar and vector paths disagree on NaN's bits (0x7fc0 vs
      // 0xffff); both are NaN, and so is ours.
      REQUIRE(std::isnan(bf16_to_float(ours)));
      REQUIRE(std::isnan(bf16_to_float(theirs)));
      ++nans;
    } else {
      INFO("float bits " << std::hex << bits[i]);
      REQUIRE(ours == theirs);
    }
  }
  CHECK(nans > 1000);  // the random patterns did reach the NaN space
}
