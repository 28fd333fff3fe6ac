#include "engine/model/builtin.h"

#include <array>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "io/token_data.h"

namespace strider {

nlohmann::json builtin_model_config() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_size", 256},
          {"intermediate_size", 688},
          {"num_hidden_layers", 6},
          {"num_attention_heads", 8},
          {"num_key_value_heads", 4},
          {"vocab_size", 2048},
          {"max_position_embeddings", 512},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 10000.0},
          {"hidden_act", "silu"},
          {"tie_word_embeddings", false},
          {"bos_token_id", 1},
          {"eos_token_id", 2}};
}

void write_builtin_dataset(const std::string& path, uint64_t tokens, uint64_t language_seed,
                           uint64_t sample_seed) {
  constexpr uint32_t kVocab = 2048, kWords = 256, kSuccessors = 3;
  std::mt19937_64 rng(language_seed);
  std::vector<std::vector<uint32_t>> words(kWords);
  for (auto& w : words) {
    w.resize(2 + rng() % 4);
    for (auto& t : w) t = 3 + uint32_t(rng() % (kVocab - 3));  // 0..2: pad, bos, eos
  }
  std::vector<std::array<uint32_t, kSuccessors>> next(kWords);
  for (auto& n : next)
    for (auto& s : n) s = uint32_t(rng() % kWords);

  rng.seed(sample_seed ^ 0x9E3779B97F4A7C15ull);
  TokenFileWriter out(path, {.token_bytes = 2, .with_mask = false, .with_docs = true, .vocab_size = kVocab});
  std::vector<uint32_t> doc;
  uint64_t written = 0;
  while (written < tokens) {
    doc.assign(1, 1u);  // bos
    const uint64_t len = 200 + rng() % 800;
    uint32_t w = uint32_t(rng() % kWords);
    while (doc.size() < len) {
      doc.insert(doc.end(), words[w].begin(), words[w].end());
      w = next[w][rng() % kSuccessors];
    }
    doc.push_back(2);  // eos
    if (written + doc.size() > tokens) doc.resize(tokens - written);
    out.append_document(doc);
    written += doc.size();
  }
  out.finish();
}

}  // namespace strider
