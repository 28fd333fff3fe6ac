// bf16 rounding on the values where rounding is decided (ties, carries into the
// exponent, Inf, NaN, denormals). The same values are checked against torch's
// own cast in test_host_vs_torch.cpp.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>

#include "host/bf16.h"

using namespace strider;

namespace {
float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
}  // namespace

TEST_CASE("bf16 rounds to nearest, ties to even", "[host][bf16]") {
  CHECK(float_to_bf16(1.0f) == 0x3f80);
  CHECK(float_to_bf16(from_bits(0x3f808000)) == 0x3f80);  // tie, even below
  CHECK(float_to_bf16(from_bits(0x3f818000)) == 0x3f82);  // tie, even above
  CHECK(float_to_bf16(from_bits(0x3f808001)) == 0x3f81);  // just above the tie
  CHECK(float_to_bf16(from_bits(0x3f807fff)) == 0x3f80);  // just below
  CHECK(float_to_bf16(from_bits(0x7f7fffff)) == 0x7f80);  // max float rounds to Inf
  CHECK(float_to_bf16(-0.0f) == 0x8000);
}

TEST_CASE("bf16 keeps Inf, NaN and denormals", "[host][bf16]") {
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(float_to_bf16(inf) == 0x7f80);
  CHECK(float_to_bf16(-inf) == 0xff80);
  for (uint32_t nan_bits : {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
    uint16_t b = float_to_bf16(from_bits(nan_bits));
    CHECK(std::isnan(bf16_to_float(b)));
    CHECK((b & 0x8000) == ((nan_bits >> 16) & 0x8000));  // sign kept
  }
  CHECK(float_to_bf16(from_bits(0x00000001)) == 0x0000);  // tiny denormal rounds to 0
  CHECK(float_to_bf16(from_bits(0x00018000)) == 0x0002);  // denormal tie to even
  CHECK(float_to_bf16(from_bits(0x00010000)) == 0x0001);  // smallest bf16 denormal kept
  CHECK(bf16_to_float(0x0001) == from_bits(0x00010000));
}
