#include "gpu/device/device.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>

#include "host/error.h"

namespace strider {

std::string_view stream_name(StreamId s) {
  switch (s) {
    case StreamId::kCompute: return "compute";
    case StreamId::kH2D: return "h2d";
    case StreamId::kD2H: return "d2h";
  }
  return "stream?";
}

std::string_view op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::kCopyH2D: return "copy_h2d";
    case OpKind::kCopyD2H: return "copy_d2h";
    case OpKind::kCompute: return "compute";
  }
  return "op?";
}

DeviceBuffer::~DeviceBuffer() { reset(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : device_(std::exchange(o.device_, nullptr)),
      data_(std::exchange(o.data_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    device_ = std::exchange(o.device_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::reset() noexcept {
  if (device_ != nullptr && data_ != nullptr) device_->free_memory(data_, bytes_);
  device_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

namespace {
std::atomic<LaunchScope> g_launch_scope{nullptr};
}  // namespace

void check_rows(size_t dst_pitch, size_t src_pitch, size_t row_bytes, size_t rows, const char* op) {
  STRIDER_CHECK(row_bytes <= dst_pitch && row_bytes <= src_pitch,
                "{}: rows of {} bytes do not fit the pitches (destination {}, source {})", op, row_bytes, dst_pitch,
                src_pitch);
  const size_t pitch = std::max(dst_pitch, src_pitch);
  STRIDER_CHECK(rows <= 1 || pitch <= (SIZE_MAX - row_bytes) / (rows - 1), "{}: {} rows {} bytes apart overflow",
                op, rows, pitch);
}

void Device::set_fp16_accumulate(bool on) {
  STRIDER_CHECK(!on, "{}: matmul_accumulate fp16 is CUDA only: this device's GEMMs accumulate fp16 in fp32 (use "
                "--matmul-accumulate fp32 here; strider plan --predict prices fp16 accumulation)", name());
}

void set_launch_scope(LaunchScope scope) { g_launch_scope.store(scope); }
LaunchScope launch_scope() { return g_launch_scope.load(); }

}  // namespace strider
