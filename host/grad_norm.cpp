#include "host/grad_norm.h"

#include <oneapi/tbb/parallel_for.h>

#include <vector>

#include "host/bf16.h"

namespace strider {
namespace {

constexpr size_t kChunk = size_t{1} << 16;

inline double value(const float* x, size_t i) { return double(x[i]); }
inline double value(const uint16_t* x, size_t i) { return double(bf16_to_float(x[i])); }

template <class T>
double chunk_sum(const T* x, size_t n) {
  double acc[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += value(x, i + j) * value(x, i + j);
  for (int j = 0; i < n; ++i, ++j) acc[j] += value(x, i) * value(x, i);
  double s = 0;
  for (double a : acc) s += a;
  return s;
}

template <class T>
double sum_squares_of(std::span<const T> x) {
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

}  // namespace

double sum_squares(std::span<const float> x) { return sum_squares_of(x); }
double sum_squares_bf16(std::span<const uint16_t> x) { return sum_squares_of(x); }

}  // namespace strider
