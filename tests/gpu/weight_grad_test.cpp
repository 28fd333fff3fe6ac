// Weight gradients summed into fp32 with no rounding to the compute dtype
// (gpu/blocks/weight_grad.h): the CPU device's twin against an fp64 reference of
// the same sum, and ([cuda], skipped without a GPU) CUDA's fp32-output GEMM
// against the CPU twin.
#include "tests/catch_torch.h"

#include <ATen/ATen.h>

#include "gpu/blocks/weight_grad.h"
#include "gpu/device/cuda_device.h"

using namespace strider;

namespace {

double rel(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() /
         b.to(at::kDouble).abs().max().item<double>();
}

struct Case {
  at::Tensor acc, a, b;  // acc [out, in] fp32; a [out, k], b [k, in] in 16 bits
};
// a is a transposed view, as dy^T is at every call site.
Case make(at::ScalarType dtype, int64_t out, int64_t k, int64_t in, uint64_t seed, at::Device dev = at::kCPU) {
  at::manual_seed(seed);
  Case c;
  c.acc = at::randn({out, in}).to(dev);
  c.a = at::randn({k, out}).to(dtype).to(dev).t();
  c.b = at::randn({k, in}).to(dtype).to(dev);
  return c;
}

}  // namespace

TEST_CASE("a 16-bit GEMM's weight gradient is summed in fp32 on the CPU device", "[gpu][weight_grad]") {
  // k = 300 with [64, 48] is 12 slices of 27 rows: the slicing is exercised. bf16 runs on oneDNN's
  // bf16 -> fp32 GEMM where ATen has it (alpha 1 into acc, another alpha into a product scaled once),
  // fp16 and a CPU without it on fp32 slices: each within 1e-6 of the fp64 sum.
  REQUIRE(weight_grad_slice_rows(64, 48) == 27);
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    for (double alpha : {0.5, 1.0}) {
      INFO(c10::toString(dtype) << " alpha " << alpha);
      Case c = make(dtype, 64, 300, 48, 3);
      const at::Tensor exact = c.acc.to(at::kDouble) + alpha * at::mm(c.a.to(at::kDouble), c.b.to(at::kDouble));
      const at::Tensor rounded = c.acc + at::mm(c.a, c.b).mul_(alpha);  // the product in 16 bits first (the old way)
      at::Tensor acc = c.acc.clone();
      add_weight_grad(acc, c.a, c.b, alpha);
      CHECK(rel(acc, exact) < 1e-6);
      CHECK(rel(rounded, exact) > 100 * rel(acc, exact));
    }
  }
  // b a column slice of a wider tensor (a LoRA group's columns), acc a row slice (an LM head's rows).
  Case w = make(at::kBFloat16, 40, 70, 80, 4);
  const at::Tensor b = w.b.narrow(1, 16, 48);
  at::Tensor acc = w.acc.narrow(1, 0, 48);
  const at::Tensor exact = acc.to(at::kDouble) + at::mm(w.a.to(at::kDouble), b.to(at::kDouble));
  const at::Tensor rest = w.acc.narrow(1, 48, 32).clone();
  add_weight_grad(acc, w.a, b);
  CHECK(rel(acc, exact) < 1e-6);
  CHECK(at::equal(w.acc.narrow(1, 48, 32), rest));  // nothing written past the slice
  // An empty inner dimension adds nothing.
  at::Tensor untouched = w.acc.clone();
  add_weight_grad(untouched, w.a.narrow(1, 0, 0), w.b.narrow(0, 0, 0), 0.5);
  CHECK(at::equal(untouched, w.acc));
  // fp32 inputs: the product, then its sum, as before (bit for bit).
  Case f = make(at::kFloat, 16, 40, 24, 5);
  at::Tensor facc = f.acc.clone();
  add_weight_grad(facc, f.a, f.b);
  CHECK(at::equal(facc, f.acc + at::mm(f.a, f.b)));
}

TEST_CASE("cuda: a 16-bit GEMM's weight gradient written in fp32 agrees with the CPU twin", "[cuda][gpu][weight_grad]") {
  const CudaProbe probe = probe_cuda();
  if (probe.device_count == 0) {
    WARN("skipped: no GPU (" << probe.reason << ")");
    return;
  }
  const at::Device cuda(at::kCUDA, 0);
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    INFO(c10::toString(dtype));
    Case host = make(dtype, 256, 1000, 192, 9), dev = make(dtype, 256, 1000, 192, 9, cuda);
    add_weight_grad(host.acc, host.a, host.b, 0.25);
    add_weight_grad(dev.acc, dev.a, dev.b, 0.25);
    CHECK(rel(dev.acc.cpu(), host.acc) < 1e-5);
  }
}
