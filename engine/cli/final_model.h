// The model `strider finetune` leaves under --out, decided and checked before
// the first step: its dtype, the room it needs, and (after the weights) the
// files of the source checkpoint a folder that loads as is needs beside them.
// Also the settings that are legal but almost surely not meant, said then.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/model_spec.h"
#include "host/dtype.h"

namespace strider::cli {

// --save-dtype "bf16" or "fp32" as asked; "auto": the source checkpoint's
// (`source`: F32, BF16 or F16; fp16, which the writer does not produce, is
// kept exactly in fp32). bf16 is what the model computes with (the compute
// copy); fp32 is the trained master.
DType final_model_dtype(const std::string& save_dtype, DType source);

// Throws, naming --out, the bytes and the free space, unless its file system
// holds `spec`'s weights in `dtype` (with 1% and 1 MiB to spare).
void check_room_for_final_model(const std::string& out, const ModelSpec& spec, DType dtype);

// Copies the tokenizer, its chat template and the generation config that
// `model_dir` holds into `out` (each file that is there; a copy that fails is
// a warning on stderr); returns the names copied.
std::vector<std::string> copy_model_companions(const std::string& model_dir, const std::string& out);

// Warnings on stderr: a warm-up not below the run's steps (the learning rate
// never leaves it), and, for a pretrained model, a learning rate far above
// what fine-tuning takes.
void warn_unlikely_settings(int64_t warmup, int64_t steps, double lr, bool pretrained);

}  // namespace strider::cli
