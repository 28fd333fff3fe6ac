// Sum of squares of fp32 gradients, for global-norm clipping and the reported
// gradient norm. Deterministic: fixed chunks, each summed in double over eight
// fixed lanes, chunk results added in order, so the bits do not depend on the
// thread count or on which thread ran which chunk (the engine's "offload
// changes nothing" invariant extends to the clipping factor).
#pragma once

#include <span>

namespace strider {

double sum_squares(std::span<const float> x);

}  // namespace strider
