// ComputeOptions: the dtype, LM-head chunk and token tile the blocks compute
// with, and the compute dtypes by name. Part of the configuration
// (EngineConfig::compute); engine/run/block_runner.h computes with them.
#pragma once

#include <ATen/ATen.h>

#include <string_view>

#include "host/dtype.h"

namespace strider {

struct ComputeOptions {
  // Parameters and activations: bf16; fp16 (with dynamic loss scaling,
  // EngineConfig::loss_scaling); or fp32 for exactness tests.
  at::ScalarType dtype = at::kBFloat16;
  int64_t vocab_chunk = 8192;            // LM-head chunk (vocabulary rows per pass)
  int64_t token_tile = 0;                // tokens per tile in the LM head (and layers' MLP); 0: all at once
  // fp16 GEMMs accumulate in fp16 (cuBLAS's, torch's
  // allow_fp16_accumulation): twice the rate on a GeForce GPU, at fp16's
  // precision inside each sum. CUDA only (Device::set_fp16_accumulate); needs dtype fp16.
  bool fp16_accumulate = false;
};

// The compute dtypes by the names the configuration, the CLI and Python use:
// "bf16", "fp16", "fp32". parse_compute_dtype throws naming `where` and the
// text for anything else.
std::string_view compute_dtype_name(at::ScalarType dtype);
at::ScalarType parse_compute_dtype(std::string_view text, std::string_view where);
// The host's spelling of a compute dtype (host/dtype.h): kBF16, kF16, kF32.
DType host_dtype(at::ScalarType dtype);

}  // namespace strider
