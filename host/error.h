// strider::Error and the checked-call macros every folder uses.
//
// Inside the library we fail by throwing (a Python process hosts us, so never
// exit() or abort()). A message says what failed, the value that made it fail,
// and what to do. The macros keep the failing statement's text, file and line.
#pragma once

#include <cerrno>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace strider {

// The one exception type the library throws for bad input, refused resources
// and failed calls. Python sees it as RuntimeError (ValueError where the shim
// maps it so).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// "strerror(err) (errno err)" without the thread-safety trap of strerror().
std::string errno_text(int err);

// Throws Error("<what> failed at file:line: <detail>").
[[noreturn]] void throw_call_error(std::string_view what, const char* file, int line,
                                   std::string_view detail);

}  // namespace strider

// Throws strider::Error with a formatted message when `cond` is false.
#define STRIDER_CHECK(cond, ...)                                \
  do {                                                          \
    if (!(cond)) throw ::strider::Error(fmt::format(__VA_ARGS__)); \
  } while (0)

// For POSIX calls that return -1 and set errno. Evaluates to the call's result.
#define STRIDER_SYSCALL(call)                                                       \
  ([&]() {                                                                          \
    auto strider_rc_ = (call);                                                      \
    if (strider_rc_ == -1) {                                                        \
      int strider_err_ = errno;                                                     \
      ::strider::throw_call_error(#call, __FILE__, __LINE__,                        \
                                  ::strider::errno_text(strider_err_));             \
    }                                                                               \
    return strider_rc_;                                                             \
  }())
