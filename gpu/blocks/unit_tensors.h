// ATen views of a cache unit's memory, without copying: the blocks (issue 5)
// compute on the parameters and accumulate gradients in place.
//
// Owner: the CacheUnitPool. The tensors carry no deleter; they must not
// outlive the pool, and they see whatever block the unit holds now.
#pragma once

#include <ATen/core/Tensor.h>

#include "gpu/device/cache_unit_pool.h"
#include "gpu/device/device.h"
#include "host/param_layout.h"

namespace strider {

// kCPU for CpuDevice, kCUDA:<ordinal> for CudaDevice.
c10::Device aten_device(const Device& device);

// The unit's bf16 parameters / fp32 gradients as flat [capacity_elems] tensors.
at::Tensor unit_params_flat(const Device& device, const CacheUnit& unit);
at::Tensor unit_grads_flat(const Device& device, const CacheUnit& unit);

// One tensor of the block (slot from its ParamLayout), shaped; throws when the
// slot does not fit the unit.
at::Tensor unit_param(const Device& device, const CacheUnit& unit, const TensorSlot& slot);
at::Tensor unit_grad(const Device& device, const CacheUnit& unit, const TensorSlot& slot);

}  // namespace strider
