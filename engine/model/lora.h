// LoRA adapters over a frozen base (PEFT's LoraConfig, arXiv 2106.09685).
//
// Each targeted linear layer y = x W^T (+ b) of a decoder layer gains
// scale * (x A^T) B^T, with A [r, in] and B [out, r] trained and W frozen;
// scale = alpha / r, or alpha / sqrt(r) with rslora (PEFT's use_rslora).
// Every other tensor of the model is frozen, except the modules `train`
// names (PEFT's modules_to_save: the embedding, the LM head), which train in
// full. The adapters are tensors of their layer's block, after its base
// tensors, under the names PEFT saves them by
// ("model.layers.3.self_attn.q_proj.lora_A.weight"), so a layer's trained
// elements are one stretch at its end (ModelSpec::layout).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace strider {

struct LoraSpec {
  int64_t r = 0;                     // the adapters' rank; 0: no adapters, every tensor trains
  double alpha = 0;                  // lora_alpha
  bool rslora = false;               // scale alpha / sqrt(r) instead of alpha / r
  std::vector<std::string> targets;  // the decoder layers' linear modules, in kLinearModules' order
  std::vector<std::string> train;    // modules trained in full: "embed_tokens", "lm_head"

  bool enabled() const { return r > 0; }
  double scale() const;
  bool targets_module(std::string_view module) const;
  bool trains(std::string_view module) const;

  // "r=16,alpha=32,targets=all-linear" or "targets=q_proj+v_proj", with
  // optional "rslora=1" and "train=lm_head+embed_tokens"; empty: none.
  // Throws an Error naming `source` and the field on anything else.
  static LoraSpec parse(std::string_view text, std::string_view source);
  // The canonical text parse() reads back (targets listed, "" when none).
  std::string text() const;
  bool operator==(const LoraSpec&) const = default;
};

// The decoder layer's linear modules LoRA can target, in layer order.
inline constexpr std::string_view kLinearModules[] = {"q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"};
// The modules `train` may name.
inline constexpr std::string_view kFullModules[] = {"embed_tokens", "lm_head"};

}  // namespace strider
