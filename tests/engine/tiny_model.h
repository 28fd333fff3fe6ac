// The tiny Llama and the random batches the engine tests share.
#pragma once

#include <nlohmann/json.hpp>
#include <random>
#include <vector>

namespace strider::test {

// hidden 32, GQA 4/2 heads, vocab 96 (so a 40-row vocabulary chunk does not divide it).
inline nlohmann::json tiny_config(bool tied, int64_t layers = 3) {
  return {{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 32}, {"intermediate_size", 48},
          {"num_hidden_layers", layers}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
          {"vocab_size", 96}, {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-5},
          {"tie_word_embeddings", tied}};
}

struct Batch { std::vector<int64_t> ids, labels; };

// n sequences of `seq` random ids; every 7th label is -100.
inline Batch batch(int64_t n, int64_t seq, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  Batch b;
  for (int64_t i = 0; i < n * seq; ++i) {
    b.ids.push_back(int64_t(rng() % vocab));
    b.labels.push_back(i % 7 == 0 ? -100 : int64_t(rng() % vocab));
  }
  return b;
}

}  // namespace strider::test
