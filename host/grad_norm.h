// Sum of squares of fp32 gradients, for global-norm clipping and the reported
// gradient norm. Deterministic: fixed chunks, each summed in double over eight
// fixed lanes, chunk results added in order, so the bits do not depend on the
// thread count or on which thread ran which chunk (the engine's "offload
// changes nothing" invariant extends to the clipping factor).
#pragma once

#include <cstdint>
#include <span>

namespace strider {

double sum_squares(std::span<const float> x);
// The same over bf16 values (their bits), exactly as over the same values in fp32.
double sum_squares_bf16(std::span<const uint16_t> x);

}  // namespace strider
