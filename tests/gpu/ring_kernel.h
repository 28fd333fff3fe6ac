// The ring's compute on a CUDA stream (ring_kernel.cu), or a throwing stub in
// builds without CUDA. out[i] = float(params[i]) * 2 + block, as ring_value().
#pragma once

#include <cstddef>
#include <cstdint>

namespace strider::test {
void ring_compute_cuda(void* stream, const uint16_t* params, float* out, size_t n, int block);
}
