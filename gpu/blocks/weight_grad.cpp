#include "gpu/blocks/weight_grad.h"

#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>

namespace strider {

int64_t weight_grad_slice_rows(int64_t out, int64_t in) { return std::max<int64_t>(1, out * in / (out + in)); }

namespace {

// Whether cpublas's bf16 x bf16 -> fp32 GEMM is MKL's (torch built with MKL, as its x86 wheels are) on
// a CPU with AVX-512 (avx512bw/vl/dq), avx_ne_convert or AMX, torch's own test for its bf16 matmuls,
// asked once: MKL runs bf16 kernels there (AMX, AVX-512 BF16) or converts to fp32 inside its SGEMM.
// Elsewhere cpublas would fall back to a scalar loop, so the fp32 slices stay.
bool mkl_bf16() {
  static const bool yes = [] {
    if (!at::hasMKL()) return false;
    const auto op = c10::Dispatcher::singleton().findSchema({"mkldnn::_is_mkldnn_bf16_supported", ""});
    return op.has_value() && op->typed<bool()>().call();
  }();
  return yes;
}

// acc (+)= a @ b over the inner dimension's [k0, k0 + kc): bf16 a and b, fp32 acc with unit column stride.
// cpublas::brgemm without its packed (VNNI) layout is cpublas's bf16 -> fp32 GEMM with beta 1 (MKL's
// cblas_gemm_bf16bf16f32): every product exact in fp32, summed in fp32, added to what acc holds. It takes
// row-major operands only, so a transposed a (dy.t()) is copied row-major a slice at a time.
void bf16_product_into(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, int64_t k0, int64_t kc,
                       bool add) {
  const at::Tensor as = a.narrow(1, k0, kc).contiguous();
  at::Tensor bs = b.narrow(0, k0, kc);
  if (bs.stride(1) != 1) bs = bs.contiguous();
  at::native::cpublas::brgemm(acc.size(0), acc.size(1), kc, as.stride(0), bs.stride(0), acc.stride(0), add,
                              as.const_data_ptr<at::BFloat16>(), bs.const_data_ptr<at::BFloat16>(),
                              acc.mutable_data_ptr<float>(), /*is_vnni=*/false);
}

}  // namespace

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
  if (k == 0) return;
  if (a.scalar_type() == at::kBFloat16 && acc.stride(1) == 1 && acc.size(0) > 0 && acc.size(1) > 0 &&
      mkl_bf16()) {
    // alpha 1 sums into acc; another alpha sums the product into a buffer of its own first (the first
    // slice writes it, the others add) and scales it once, as CUDA's addmm does (acc + alpha (a @ b)).
    // The slices' 16-bit copies (a's always, b's where its rows are strided) hold no more bytes than
    // the fp32 slices' copies below: twice the rows (another alpha adds a buffer of acc's size: a
    // LoRA adapter's B, out x rank).
    at::Tensor into = alpha == 1.0 ? acc : at::empty_like(acc, at::MemoryFormat::Contiguous);
    for (int64_t k0 = 0; k0 < k; k0 += 2 * step)
      bf16_product_into(into, a, b, k0, std::min(2 * step, k - k0), alpha == 1.0 || k0 > 0);
    if (alpha != 1.0) acc.add_(into, alpha);
    return;
  }
  for (int64_t k0 = 0; k0 < k; k0 += step) {
    const int64_t kc = std::min(step, k - k0);
    at::addmm_out(acc, acc, a.narrow(1, k0, kc).to(at::kFloat), b.narrow(0, k0, kc).to(at::kFloat), 1.0, alpha);
  }
}

}  // namespace strider
