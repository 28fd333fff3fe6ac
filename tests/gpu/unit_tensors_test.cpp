// ATen views of cache units: no copy (same memory), the layout's shapes, and
// ATen compute launched on a device stream writing into a unit.
#include "tests/catch_torch.h"

#include <ATen/ATen.h>

#include "gpu/blocks/unit_tensors.h"
#include "gpu/device/cache_unit_pool.h"
#include "gpu/device/cpu_device.h"
#include "gpu/device/cuda_device.h"
#include "host/error.h"
#include "host/param_layout.h"

#if STRIDER_TEST_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>  // getCurrentCUDAStream: which stream ATen enqueues on
#endif

using namespace strider;

namespace {

ParamLayout small_block() {
  ParamLayout layout("model.layers.0");
  layout.add("mlp.up_proj.weight", {22, 7});
  layout.add("input_layernorm.weight", {7});
  return layout;
}

// Fills the block's weight, runs y = W x on the compute stream into the
// gradient view, and returns y (on the CPU). Same code for both devices.
at::Tensor matvec_in_unit(Device& dev, const CacheUnit& unit, const ParamLayout& layout) {
  const TensorSlot& w_slot = layout.at("mlp.up_proj.weight");
  at::Tensor w = unit_param(dev, unit, w_slot);
  at::Tensor y = unit_grad(dev, unit, layout.at("input_layernorm.weight")).narrow(0, 0, 7);
  dev.launch(StreamId::kCompute, OpTag{"matvec"}, [w, y](const LaunchContext&) {
    at::Tensor w32 = at::arange(22 * 7, w.options().dtype(at::kFloat)).reshape({22, 7}).div_(64);
    w.copy_(w32);
    at::Tensor x = at::ones({22}, y.options());
    y.copy_(at::matmul(x, w.to(at::kFloat)));
  });
  dev.synchronize();
  return y.cpu();
}

at::Tensor matvec_reference() {
  at::Tensor w = at::arange(22 * 7, at::kFloat).reshape({22, 7}).div_(64).to(at::kBFloat16).to(at::kFloat);
  return at::matmul(at::ones({22}), w);
}

}  // namespace

TEST_CASE("unit views share the unit's memory with the layout's shapes", "[gpu][unit_tensors]") {
  const ParamLayout layout = small_block();
  CpuDevice dev;
  CacheUnitPool pool(dev, 2, layout);
  const CacheUnit& u = pool.unit(1);
  const TensorSlot& slot = layout.at("input_layernorm.weight");
  at::Tensor p = unit_param(dev, u, slot);
  at::Tensor g = unit_grad(dev, u, slot);
  CHECK(p.scalar_type() == at::kBFloat16);
  CHECK(g.scalar_type() == at::kFloat);
  CHECK(p.sizes() == at::IntArrayRef{7});
  CHECK(p.data_ptr() == static_cast<std::byte*>(u.params_bf16) + slot.offset_elems * 2);
  CHECK(g.data_ptr() == reinterpret_cast<std::byte*>(u.grads_fp32 + slot.offset_elems));
  g.fill_(3.5f);
  CHECK(u.grads_fp32[slot.offset_elems + 6] == 3.5f);
  CHECK(unit_params_flat(dev, u).numel() == static_cast<int64_t>(layout.total_elems()));
  CHECK(unit_grads_flat(dev, u).device().is_cpu());

  TensorSlot too_far = slot;
  too_far.offset_elems = layout.total_elems();
  CHECK_THROWS_WITH(unit_param(dev, u, too_far), Catch::Contains("does not fit a cache unit"));
}

TEST_CASE("ATen compute launched on the CPU device writes into the unit", "[gpu][unit_tensors]") {
  const ParamLayout layout = small_block();
  CpuDevice dev;
  CacheUnitPool pool(dev, 1, layout);
  CHECK(at::equal(matvec_in_unit(dev, pool.unit(0), layout), matvec_reference()));
}

TEST_CASE("cuda: unit views are CUDA tensors and ATen runs on our stream", "[cuda][gpu][unit_tensors]") {
  const CudaProbe probe = probe_cuda();
  if (probe.device_count == 0) {
    WARN("skipped: no GPU (" << probe.reason << ")");
    return;
  }
  DeviceOptions o;
  o.spec = "cuda:0";
  auto dev = make_device(o);
  const ParamLayout layout = small_block();
  CacheUnitPool pool(*dev, 1, layout);
  CHECK(unit_params_flat(*dev, pool.unit(0)).device().is_cuda());
  CHECK(at::allclose(matvec_in_unit(*dev, pool.unit(0), layout), matvec_reference()));
#if STRIDER_TEST_TORCH_CUDA
  void* before = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(dev->ordinal())).stream();
  for (StreamId s : {StreamId::kCompute, StreamId::kD2H}) {
    void* native = nullptr;
    void* current = nullptr;
    dev->launch(s, OpTag{"which stream"}, [&](const LaunchContext& ctx) {
      native = ctx.native_stream;
      current = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(ctx.ordinal)).stream();
    });
    CHECK(native != nullptr);
    CHECK(current == native);  // ATen enqueues on our stream while the closure runs
  }
  void* after = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(dev->ordinal())).stream();
  CHECK(after == before);  // ...and only then: the previous current stream is back
#else
  WARN("built without torch's CUDA half: ATen's current stream is not set by launch()");
#endif
}
