// The model `strider finetune` leaves under --out, decided and checked before
// the first step: its dtype, the room it needs, and (after the weights) the
// files of the source checkpoint a folder that loads as is needs beside them.
// Also the settings that are legal but almost surely not meant, said then.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/model/model_spec.h"
#include "engine/run/engine.h"
#include "host/dtype.h"

namespace strider::cli {

// --save-dtype "bf16" or "fp32" as asked; "auto": the source checkpoint's
// (`source`: F32, BF16 or F16; fp16, which the writer does not produce, is
// kept exactly in fp32). bf16 is what the model computes with (the compute
// copy); fp32 is the trained master.
DType final_model_dtype(const std::string& save_dtype, DType source);

// What the final save writes under --out. Full training: the model
// (config.json, model.safetensors). LoRA (the engine's spec has adapters):
// the PEFT adapter folder (engine/model/peft_adapter.h; fp32 unless --save-dtype
// bf16 asked for bf16: adapters are small and their masters are fp32, so a
// bf16 base's `auto` does not round them), and with `merge` the merged model
// in `dtype` under --out/merged.
struct FinalModel {
  std::string out;
  DType dtype = DType::kBF16;  // final_model_dtype
  bool merge = false;
  std::string base_model;      // the adapter's base_model_name_or_path
  bool adapter_bf16 = false;   // --save-dtype bf16 given
  // The checkpoint the run loaded (empty: the built-in model): --merge adds
  // the adapters to its frozen base as it holds it, not to the engine's copy
  // in the compute dtype, as PEFT merges over the base it loaded (a base held
  // in int8 or NF4 merges as dequantized).
  std::string source_dir;
  DType adapter_dtype() const { return adapter_bf16 ? DType::kBF16 : DType::kF32; }
  std::string merged_dir() const;  // --out/merged
};

// Throws, naming --out, the bytes and the free space, unless its file system
// holds what `what` writes for `spec` (the engine's: with adapters, if any)
// with 1% and 1 MiB to spare.
void check_room_for_final_model(const FinalModel& what, const ModelSpec& spec);

// The final save. Every rank calls it: each reads the weights (a sharded
// state gathers them from every rank), rank 0 (`writes`) writes. `base`:
// the model without adapters (config.json's); `config_json` its text.
// A write that fails (a full disk) stops writing but not the gathering; its
// error is returned ("" on success and on the ranks that do not write).
struct FinalSaveResult {
  std::string error;
};
FinalSaveResult save_final_model(Engine& engine, const ModelSpec& base, const std::string& config_json,
                                 const FinalModel& what, bool writes);

// Copies the tokenizer, its chat template and the generation config that
// `model_dir` holds into `out` (each file that is there; a copy that fails is
// a warning on stderr); returns the names copied.
std::vector<std::string> copy_model_companions(const std::string& model_dir, const std::string& out);

// Warnings on stderr: a warm-up not below the run's steps (the learning rate
// never leaves it), and, for a pretrained model, a learning rate far above
// what fine-tuning takes.
void warn_unlikely_settings(int64_t warmup, int64_t steps, double lr, bool pretrained);

}  // namespace strider::cli
