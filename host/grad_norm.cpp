#include "host/grad_norm.h"

#include <oneapi/tbb/parallel_for.h>

#include <vector>

namespace strider {
namespace {

constexpr size_t kChunk = size_t{1} << 16;

double chunk_sum(const float* x, size_t n) {
  double acc[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += double(x[i + j]) * double(x[i + j]);
  for (int j = 0; i < n; ++i, ++j) acc[j] += double(x[i]) * double(x[i]);
  double s = 0;
  for (double a : acc) s += a;
  return s;
}

}  // namespace

double sum_squares(std::span<const float> x) {
  const size_t chunks = (x.size() + kChunk - 1) / kChunk;
  if (chunks <= 1) return chunk_sum(x.data(), x.size());
  std::vector<double> part(chunks);
  tbb::parallel_for(size_t{0}, chunks, [&](size_t c) {
    const size_t b = c * kChunk;
    part[c] = chunk_sum(x.data() + b, std::min(kChunk, x.size() - b));
  });
  double s = 0;
  for (double p : part) s += p;
  return s;
}

}  // namespace strider
