#include "gpu/blocks/unit_tensors.h"

#include <ATen/ops/from_blob.h>

#include "host/error.h"

namespace strider {
namespace {

at::Tensor view(const Device& device, void* base, size_t capacity_elems, at::ScalarType dtype,
                size_t offset_elems, size_t numel, at::IntArrayRef shape, std::string_view name) {
  STRIDER_CHECK(offset_elems + numel <= capacity_elems,
                "tensor '{}' [{} + {} elements] does not fit a cache unit of {} elements; size the pool "
                "from the largest block's ParamLayout",
                name, offset_elems, numel, capacity_elems);
  auto* p = static_cast<std::byte*>(base) + offset_elems * c10::elementSize(dtype);
  return at::from_blob(p, shape, at::TensorOptions().dtype(dtype).device(aten_device(device)));
}

}  // namespace

c10::Device aten_device(const Device& device) {
  STRIDER_CHECK(device.kind() != DeviceKind::kSim,
                "{}: SimDevice has no memory to compute on; ATen views of its units do not exist", device.name());
  if (device.kind() == DeviceKind::kCuda)
    return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device.ordinal()));
  return c10::Device(c10::DeviceType::CPU);
}

at::Tensor unit_params_flat(const Device& device, const CacheUnit& unit) {
  const int64_t n = static_cast<int64_t>(unit.capacity_elems);
  return view(device, unit.params_bf16, unit.capacity_elems, at::kBFloat16, 0, unit.capacity_elems, {n}, "params");
}

at::Tensor unit_grads_flat(const Device& device, const CacheUnit& unit) {
  const int64_t n = static_cast<int64_t>(unit.grad_capacity_elems);
  return view(device, unit.grads_fp32, unit.grad_capacity_elems, at::kFloat, 0, unit.grad_capacity_elems, {n}, "grads");
}

at::Tensor unit_param(const Device& device, const CacheUnit& unit, const TensorSlot& slot) {
  return view(device, unit.params_bf16, unit.capacity_elems, at::kBFloat16, slot.offset_elems, slot.numel,
              slot.shape, slot.name);
}

at::Tensor unit_grad(const Device& device, const CacheUnit& unit, const TensorSlot& slot) {
  return view(device, unit.grads_fp32, unit.grad_capacity_elems, at::kFloat, slot.offset_elems, slot.numel, slot.shape,
              slot.name);
}

}  // namespace strider
