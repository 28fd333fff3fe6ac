// libFuzzer entry point: the safetensors header parser on arbitrary bytes.
// Any strider::Error is a correct refusal; anything else escaping (a
// json exception, std::out_of_range), a crash, or a broken promise of a
// header that parsed is a bug.
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>

#include "host/error.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data), size);
  try {
    strider::SafetensorsHeader h = strider::parse_safetensors_header(file, "fuzz-input");
    // What a valid header promises: the tensors tile the data area, which
    // lies inside the file, and each one's size matches its dtype and shape.
    uint64_t cursor = 0;
    unsigned touched = 0;
    for (const auto& e : h.entries) {
      if (e.begin_bytes != cursor || e.end_bytes < e.begin_bytes)
        throw std::logic_error("parsed header does not tile the data area");
      uint64_t numel = 1;
      for (int64_t d : e.shape) numel *= static_cast<uint64_t>(d);
      if (numel * strider::dtype_size(e.dtype) != e.size_bytes())
        throw std::logic_error("parsed tensor size disagrees with dtype and shape");
      cursor = e.end_bytes;
      if (e.size_bytes() > 0) {  // read the first and last byte, as a reader would
        touched += static_cast<unsigned>(file[h.data_offset_bytes + e.begin_bytes]);
        touched += static_cast<unsigned>(file[h.data_offset_bytes + e.end_bytes - 1]);
      }
    }
    if (cursor != h.data_bytes || h.data_offset_bytes + h.data_bytes != size)
      throw std::logic_error("parsed header does not cover the file");
    (void)touched;
  } catch (const strider::Error&) {
  }
  return 0;
}
