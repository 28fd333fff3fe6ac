// A batch's attention mask (transformers' attention_mask, right padding only):
// its checks and what the load-balancing loss counts from it. The engine
// (EngineCore::count_router_rows) and the resident reference
// (ResidentModel::forward_backward) both take it from here, so the two count
// the same rows by construction (docs/moe.md, "How the engine runs them").
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace strider {

// Refuses a mask that is not 0/1 [batch, seq] (n = batch x seq values, row
// major), has a 0 before a 1 in a row (left padding: attention is causal
// without a padding mask), or a label other than -100 on padding; each error
// names the position.
void check_attention_mask(std::span<const int64_t> attention, std::span<const int64_t> labels, int64_t seq);

// The load-balancing loss's router rows of each micro-batch (the batch's
// values cut into `micro_batches` equal runs): its input tokens (all of them
// without a mask) times the model's sparse layers.
struct RouterRows {
  std::vector<double> rows;   // per micro-batch
  std::vector<char> padded;   // per micro-batch: some token of it is padding
  // Micro-batches with an input token: one of padding only has no such loss
  // (transformers' 0/0), so the mean over micro-batches is over these.
  double with_inputs = 0;
};
// `attention` empty: no mask (every token an input), n values.
RouterRows count_router_rows(std::span<const int64_t> attention, size_t n, int64_t micro_batches,
                             int64_t sparse_layers);

}  // namespace strider
