#include "engine/cli/final_model.h"

#include <cstdio>
#include <filesystem>
#include <fmt/format.h>

#include "engine/checkpoint_series.h"
#include "engine/config_fields.h"
#include "engine/plan.h"  // format_bytes
#include "host/error.h"

namespace strider::cli {
namespace {

// The files of a Hugging Face model folder besides config.json and the
// weights: the tokenizer, its chat template, the generation defaults.
constexpr const char* kModelCompanionFiles[] = {
    "tokenizer.json",     "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json",  "vocab.json",            "merges.txt",      "chat_template.jinja",
    "chat_template.json", "generation_config.json"};

// A pretrained model forgets what it knew at a learning rate far above
// fine-tuning's (1e-6 .. 1e-4).
constexpr double kFineTuneLrCeiling = 1e-3;

}  // namespace

DType final_model_dtype(const std::string& save_dtype, DType source) {
  if (save_dtype == "fp32") return DType::kF32;
  if (save_dtype == "bf16") return DType::kBF16;
  return source == DType::kBF16 ? DType::kBF16 : DType::kF32;
}

void check_room_for_final_model(const std::string& out, const ModelSpec& spec, DType dtype) {
  const uint64_t bytes = uint64_t(spec.param_count()) * dtype_size(dtype);
  const uint64_t need = bytes + bytes / 100 + (1ull << 20), avail = CheckpointSeries::free_bytes(out);
  STRIDER_CHECK(need <= avail, "--out {}: the final model needs about {} ({}) but its file system has {} free; "
                "free space there, or give --out on a larger disk", out, format_bytes(need), dtype_name(dtype),
                format_bytes(avail));
}

std::vector<std::string> copy_model_companions(const std::string& model_dir, const std::string& out) {
  namespace fs = std::filesystem;
  std::vector<std::string> copied;
  for (const char* name : kModelCompanionFiles) {
    const fs::path from = fs::path(model_dir) / name, to = fs::path(out) / name;
    std::error_code ec;
    if (!fs::is_regular_file(from, ec)) continue;
    fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
    if (ec) fmt::print(stderr, "warning: copying {} to {} failed: {}\n", from.string(), to.string(), ec.message());
    else copied.push_back(name);
  }
  return copied;
}

void warn_unlikely_settings(int64_t warmup, int64_t steps, double lr, bool pretrained) {
  if (warmup > 0 && warmup >= steps)
    fmt::print(stderr, "warning: --warmup {} is not below --steps {}: the learning rate never leaves its warm-up "
               "(step 1 runs at lr 0, the last at {:.3g}); lower --warmup\n", warmup, steps,
               lr * double(steps - 1) / double(warmup));
  if (pretrained && lr > kFineTuneLrCeiling)
    fmt::print(stderr, "warning: --lr {:.3g} is far above what fine-tuning a pretrained model takes (1e-6 .. 1e-4; "
               "the default is {:.3g}): the first steps may undo its training; lower --lr unless this is meant\n",
               lr, config_field("lr").default_value.get<double>());
}

}  // namespace strider::cli
