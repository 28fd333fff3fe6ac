#include "host/error.h"

#include <cstring>

namespace strider {

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r returns a pointer that may or may not be buf.
  const char* text = strerror_r(err, buf, sizeof buf);
  return fmt::format("{} (errno {})", text, err);
}

void throw_call_error(std::string_view what, const char* file, int line,
                      std::string_view detail) {
  throw Error(fmt::format("{} failed at {}:{}: {}", what, file, line, detail));
}

}  // namespace strider
