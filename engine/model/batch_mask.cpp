#include "engine/model/batch_mask.h"

#include "host/error.h"

namespace strider {

void check_attention_mask(std::span<const int64_t> attention, std::span<const int64_t> labels, int64_t seq) {
  STRIDER_CHECK(attention.size() == labels.size(), "attention_mask has {} values, the labels {}", attention.size(),
                labels.size());
  for (size_t i = 0; i < attention.size(); ++i) {
    const size_t t = i % size_t(seq);
    STRIDER_CHECK(attention[i] == 0 || attention[i] == 1, "attention_mask at position {} is {}: 0 (padding) or 1",
                  i, attention[i]);
    STRIDER_CHECK(attention[i] == 0 || t == 0 || attention[i - 1] == 1,
                  "attention_mask: row {} has a 0 before a 1 at position {} (left padding?); attention is causal "
                  "without a padding mask, so pad on the right", i / size_t(seq), t);
    STRIDER_CHECK(attention[i] == 1 || labels[i] == -100,
                  "label {} at position {} is on padding (attention_mask 0): padding is no target, give -100",
                  labels[i], i);
  }
}

RouterRows count_router_rows(std::span<const int64_t> attention, size_t n, int64_t micro_batches,
                             int64_t sparse_layers) {
  const size_t M = size_t(micro_batches), per_mb = n / M;
  STRIDER_CHECK(micro_batches >= 1 && per_mb * M == n, "{} tokens do not split into {} micro-batches", n, M);
  STRIDER_CHECK(attention.empty() || attention.size() == n, "attention_mask has {} values, the batch {}",
                attention.size(), n);
  const double layers = double(sparse_layers);
  RouterRows r{.rows = std::vector<double>(M, double(per_mb) * layers), .padded = std::vector<char>(M, 0),
               .with_inputs = double(M)};
  if (attention.empty()) return r;
  r.with_inputs = 0;
  for (size_t m = 0; m < M; ++m) {
    size_t inputs = 0;
    for (size_t i = m * per_mb; i < (m + 1) * per_mb; ++i) inputs += size_t(attention[i]);
    r.rows[m] = double(inputs) * layers;
    r.padded[m] = inputs < per_mb;
    r.with_inputs += inputs > 0;
  }
  return r;
}

}  // namespace strider
