// The built-in default run: a small Llama-shaped model and a synthetic data set
// with structure a model can learn in a few dozen steps, so `strider finetune`
// with no arguments shows the engine sliding and the loss falling on any
// machine, with no download.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace strider {

// config.json of the built-in model (LlamaForCausalLM, ~5.8M parameters).
nlohmann::json builtin_model_config();

// Writes a token file of `tokens` ids from the built-in "language": 256 words
// of 2-5 tokens each over a 2048-token vocabulary, each word followed by one
// of three successors (a Markov chain), in documents of 200-1000 tokens.
// The language is fixed by `language_seed`, the sampled text by `sample_seed`
// (a held-out set: same language, another sample seed). The best achievable
// loss is far below ln(2048).
void write_builtin_dataset(const std::string& path, uint64_t tokens, uint64_t language_seed,
                           uint64_t sample_seed);

}  // namespace strider
