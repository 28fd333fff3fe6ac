// Catch2 for test files that also see torch headers. c10's logging defines its
// own CHECK (abort on failure, no counting), which silently replaces Catch's
// when torch comes second, or Catch's when it comes first. This header pulls
// c10's logging in first, drops its CHECK, then includes Catch2, so CHECK is
// always Catch's. Use it instead of <catch2/catch.hpp> wherever torch is near.
#pragma once

#include <c10/util/Logging.h>
#undef CHECK
#include <catch2/catch.hpp>
