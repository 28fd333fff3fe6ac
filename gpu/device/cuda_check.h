// STRIDER_CUDA_CHECK / STRIDER_CUBLAS_CHECK: checked CUDA calls that throw
// strider::Error keeping the statement's text, file, line and the error's name.
// Only files compiled with the CUDA toolkit include this.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "host/error.h"

#define STRIDER_CUDA_CHECK(call)                                                              \
  do {                                                                                        \
    cudaError_t strider_cuda_rc_ = (call);                                                    \
    if (strider_cuda_rc_ != cudaSuccess) {                                                    \
      ::strider::throw_call_error(#call, __FILE__, __LINE__,                                  \
                                  fmt::format("{} ({})", cudaGetErrorName(strider_cuda_rc_),  \
                                              cudaGetErrorString(strider_cuda_rc_)));         \
    }                                                                                         \
  } while (0)

#define STRIDER_CUBLAS_CHECK(call)                                                            \
  do {                                                                                        \
    cublasStatus_t strider_cublas_rc_ = (call);                                               \
    if (strider_cublas_rc_ != CUBLAS_STATUS_SUCCESS) {                                        \
      ::strider::throw_call_error(#call, __FILE__, __LINE__,                                  \
                                  fmt::format("{} ({})", cublasGetStatusName(strider_cublas_rc_), \
                                              cublasGetStatusString(strider_cublas_rc_)));    \
    }                                                                                         \
  } while (0)
