// libFuzzer entry point: the token file header and contents validation on
// arbitrary bytes. strider::Error is a correct refusal; anything else is a bug.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>

#include "host/error.h"
#include "io/token_data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data), size);
  for (uint64_t vocab : {uint64_t{0}, uint64_t{300}}) {
    try {
      strider::TokenFileLayout l = strider::parse_token_file(file, "fuzz-input", vocab);
      // A layout that parsed must lie inside the file: read the last token,
      // mask byte and doc start, as the loader will.
      if (l.file_bytes != size || l.tokens_offset_bytes + l.num_tokens * l.token_bytes > size)
        throw std::logic_error("token section outside the file");
      uint32_t last = 0;
      if (l.num_tokens > 0)
        std::memcpy(&last, data + l.tokens_offset_bytes + (l.num_tokens - 1) * l.token_bytes,
                    l.token_bytes);
      if (l.mask_offset_bytes != 0 && l.mask_offset_bytes + l.num_tokens > size)
        throw std::logic_error("mask section outside the file");
      if (l.docs_offset_bytes != 0 && l.docs_offset_bytes + 8 * l.num_docs != size)
        throw std::logic_error("docs section does not end the file");
      (void)last;
    } catch (const strider::Error&) {
    }
  }
  return 0;
}
