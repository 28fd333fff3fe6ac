// The binding's one way of turning strider's errors into Python's: runs
// `fn`, rethrowing our exceptions as c10 errors, which Python maps to
// ValueError (c10::ValueError) or RuntimeError (c10::Error).
#pragma once

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>
#include <string>

#include "host/error.h"

namespace strider {

template <typename Fn>
auto translated(const char* what, bool value_error, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::Error&) {
    throw;
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK_VALUE(false, what, ": ", e.what());
  } catch (const Error& e) {
    if (value_error) TORCH_CHECK_VALUE(false, e.what());
    TORCH_CHECK(false, e.what());
  }
}

inline nlohmann::json parse_json(const std::string& text, const char* what) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK_VALUE(false, what, " is not valid JSON: ", e.what());
  }
}

}  // namespace strider
