// Weight gradients summed into fp32 accumulators without a rounding to the
// compute dtype: acc += alpha * a @ b, for a block's projections, LoRA
// adapters, experts and LM-head rows (gpu/blocks/blocks.cpp, moe.cpp,
// chunked_loss.cpp).
//
// With 16-bit a and b (bf16, fp16) and an fp32 acc:
//   CUDA  one cuBLAS GEMM that writes fp32 into acc with beta 1 (ATen's addmm
//         with an output dtype, which exists for CUDA only): no 16-bit
//         product, no second pass over the gradient.
//   CPU   the twin: the same sum in fp32 of the 16-bit values (each product
//         exact in fp32). bf16, where ATen's oneDNN runs bf16: a GEMM of the
//         bf16 values writing fp32 into acc (ATen's cpublas::brgemm, MKL's
//         bf16 x bf16 -> fp32 kernel on x86), over slices of the inner
//         dimension whose row-major bf16 copies hold no more than acc's
//         bytes (the step's figures: docs/measurements.md). fp16,
//         and bf16 elsewhere: fp32 addmm into acc over slices whose fp32
//         copies of a and b together hold no more than acc's bytes. Only the
//         order of the fp32 additions differs from cuBLAS's.
// fp32 inputs, or an accumulator that is not fp32: acc.add_(alpha * a @ b),
// the product first, as before.
#pragma once

#include <ATen/ATen.h>

namespace strider {

void add_weight_grad(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, double alpha = 1.0);
// The rows of the inner dimension the CPU twin converts at a time for an
// [out, in] accumulator: its fp32 slices of a and b hold at most out x in
// floats (the working-memory model's term).
int64_t weight_grad_slice_rows(int64_t out, int64_t in);

}  // namespace strider
