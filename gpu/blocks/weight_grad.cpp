#include "gpu/blocks/weight_grad.h"

#include <algorithm>

namespace strider {

int64_t weight_grad_slice_rows(int64_t out, int64_t in) { return std::max<int64_t>(1, out * in / (out + in)); }

void add_weight_grad(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, double alpha) {
  const bool half = a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf;
  if (!half || acc.scalar_type() != at::kFloat) {
    at::Tensor p = at::mm(a, b);
    acc.add_(alpha == 1.0 ? p : p.mul_(alpha));
    return;
  }
  if (acc.is_cuda()) {
    at::addmm_out(acc, acc, a, b, at::kFloat, 1.0, alpha);
    return;
  }
  const int64_t k = a.size(1), step = weight_grad_slice_rows(acc.size(0), acc.size(1));
  for (int64_t k0 = 0; k0 < k; k0 += step) {
    const int64_t kc = std::min(step, k - k0);
    at::addmm_out(acc, acc, a.narrow(1, k0, kc).to(at::kFloat), b.narrow(0, k0, kc).to(at::kFloat), 1.0, alpha);
  }
}

}  // namespace strider
