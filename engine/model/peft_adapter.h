// A trained LoRA adapter as PEFT saves one (engine/model/lora.h), and the merged
// model beside it.
//
// PeftAdapterWriter streams blocks into a folder that
// peft.PeftModel.from_pretrained(base_model, dir) loads:
//   adapter_model.safetensors  the trained tensors under PEFT's saved names:
//                              "base_model.model.<name>" for the adapters
//                              ("...q_proj.lora_A.weight") and for the
//                              modules trained in full (modules_to_save:
//                              "base_model.model.lm_head.weight")
//   adapter_config.json        peft_type LORA, task_type CAUSAL_LM, r,
//                              lora_alpha, use_rslora, target_modules,
//                              modules_to_save, base_model_name_or_path;
//                              written last
// Nothing appears under a final name before finish().
//
// merge_lora_block folds a layer's adapters into its base weights, W +
// scale B A, as PEFT's merge_and_unload does: the block of the model without
// adapters, which HfCheckpointWriter writes as a plain transformers model.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/model/model_spec.h"
#include "host/dtype.h"
#include "host/param_layout.h"
#include "io/safetensors.h"

namespace strider {

struct PeftAdapterOptions {
  DType dtype = DType::kF32;   // of every tensor written: kF32 (the trained masters) or kBF16
  std::string base_model;      // base_model_name_or_path: where PEFT finds the base (a folder or a Hub id)
};

// PEFT's saved name of the trained tensor `name` (a checkpoint name of `spec`'s layouts).
std::string peft_saved_name(const std::string& name);

class PeftAdapterWriter {
 public:
  // `spec` must have adapters (spec.lora.enabled()). Creates `dir` if needed.
  PeftAdapterWriter(std::string dir, const ModelSpec& spec, PeftAdapterOptions options = {});

  // Writes block `block`'s trained tensors (its layout's trainable slots)
  // from its flat fp32 buffer (the layout's total_elems()); each block
  // exactly once, in any order.
  void write_block(int64_t block, std::span<const float> weights);
  // Makes the tensors durable and publishes them, then adapter_config.json.
  // Throws naming a block never written.
  void finish();

  std::vector<std::string> file_names() const;  // adapter_model.safetensors, adapter_config.json
  // The trained tensors' bytes in options.dtype: what the folder needs on disk.
  static uint64_t bytes(const ModelSpec& spec, DType dtype);

 private:
  std::string dir_;
  PeftAdapterOptions options_;
  std::string config_text_;
  std::vector<ParamLayout> layouts_;
  std::vector<bool> written_;
  std::optional<SafetensorsWriter> writer_;
  bool finished_ = false;
};

// The block `block` of the model without adapters: `with_adapters` is the
// block of `spec` (which has them); `out` (base.layout(block).total_elems(),
// base = spec.with_lora("")) gets its base tensors with each targeted
// weight W replaced by W + scale * B A, in fp32.
void merge_lora_block(const ModelSpec& spec, int64_t block, std::span<const float> with_adapters,
                      std::span<float> out);

}  // namespace strider
