// BlockDims: what a model block's compute needs to know about the model.
// Declared here, filled by engine/'s ModelSpec (gpu/ never includes engine/).
#pragma once

#include <cstdint>

namespace strider {

// RoPE frequency scaling, as Hugging Face's rope_type names it.
enum class RopeType { kDefault, kLlama3, kLinear };

struct RopeDims {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;              // kLlama3, kLinear
  double low_freq_factor = 1.0;     // kLlama3
  double high_freq_factor = 4.0;    // kLlama3
  int64_t original_max_position = 8192;  // kLlama3
};

struct BlockDims {
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate = 0;
  int64_t vocab = 0;
  double rms_eps = 1e-6;
  RopeDims rope;
  bool qkv_bias = false;    // Qwen2, Llama with attention_bias
  bool o_bias = false;      // Llama with attention_bias
  bool mlp_bias = false;    // Llama with mlp_bias
  bool qk_norm = false;     // Qwen3: RMSNorm over head_dim on q and k
  int64_t sliding_window = 0;  // Mistral; 0: none. Sequences longer are refused.
  // LoRA: a linear layer whose block holds "<proj>.lora_A.weight" and
  // "<proj>.lora_B.weight" adds lora_scale * (x A^T) B^T (engine/lora.h).
  double lora_scale = 0;
};

}  // namespace strider
