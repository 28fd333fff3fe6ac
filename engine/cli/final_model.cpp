#include "engine/cli/final_model.h"

#include <cstdio>
#include <filesystem>
#include <fmt/format.h>
#include <optional>

#include "engine/checkpoint/series.h"
#include "engine/config/config_fields.h"
#include "engine/model/hf_folder.h"
#include "engine/model/peft_adapter.h"
#include "engine/plan/plan.h"  // format_bytes
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

std::string FinalModel::merged_dir() const { return (std::filesystem::path(out) / "merged").string(); }

void check_room_for_final_model(const FinalModel& what, const ModelSpec& spec) {
  const ModelSpec base = spec.with_lora("", "--out");
  uint64_t bytes = spec.lora.enabled() ? PeftAdapterWriter::bytes(spec, what.adapter_dtype()) : 0;
  if (!spec.lora.enabled() || what.merge) bytes += uint64_t(base.param_count()) * dtype_size(what.dtype);
  const uint64_t need = bytes + bytes / 100 + (1ull << 20), avail = CheckpointSeries::free_bytes(what.out);
  STRIDER_CHECK(need <= avail, "--out {}: the final {} needs about {} ({}) but its file system has {} free; "
                "free space there, or give --out on a larger disk", what.out,
                !spec.lora.enabled() ? "model" : what.merge ? "adapter and merged model" : "adapter",
                format_bytes(need), dtype_name(what.dtype), format_bytes(avail));
}

FinalSaveResult save_final_model(Engine& engine, const ModelSpec& base, const std::string& config_json,
                                 const FinalModel& what, bool writes) {
  const ModelSpec& spec = engine.spec();
  const bool lora = spec.lora.enabled();
  FinalSaveResult r;
  std::optional<HfCheckpointWriter> model;      // the model, or with LoRA the merged one
  std::optional<PeftAdapterWriter> adapter;     // with LoRA
  bool any = false;
  auto writing = [&](auto&& fn) {
    if (!any || !r.error.empty()) return;
    try {
      fn();
    } catch (const Error& e) {
      r.error = e.what();
    }
  };
  if (writes) {
    any = true;
    writing([&] {
      if (lora) adapter.emplace(what.out, spec, PeftAdapterOptions{what.adapter_dtype(), what.base_model});
      if (!lora || what.merge)
        model.emplace(lora ? what.merged_dir() : what.out, base, config_json, HfWriteOptions{.dtype = what.dtype});
    });
  }
  // Full training reads the weights as the file holds them (a bf16 compute
  // copy exactly); LoRA the fp32 masters, which the adapter and the merge need.
  const DType read_dtype = lora ? DType::kF32 : what.dtype;
  // The merge's frozen base as the checkpoint holds it, where the engine holds it in the compute dtype; a
  // base held in int8 or NF4 merges as dequantized, the base its adapters were trained over (docs/lora.md).
  std::optional<HfCheckpointReader> source;
  if (lora && model && !what.source_dir.empty() && engine.config().base_format == BaseFormat::kCompute)
    writing([&] { source.emplace(what.source_dir, base); });
  std::vector<float> merged, loaded;
  for (int64_t b = 0; b < spec.num_blocks(); ++b) {
    const ParamLayout l = spec.layout(b);
    std::vector<float> w(l.total_elems());
    engine.model_weights(b, read_dtype, w);
    writing([&] {
      if (adapter) adapter->write_block(b, w);
      if (!model) return;
      if (!lora) return model->write_block(b, w);
      if (source) {  // the frozen tensors from the checkpoint; what trained (modules_to_save) from the engine
        const ParamLayout from = base.layout(b);
        loaded.assign(from.total_elems(), 0.0f);
        source->read_block(b, loaded);
        for (const TensorSlot& t : l.slots())
          if (const TensorSlot* f = from.find(t.name); f != nullptr && !t.trainable)
            std::copy_n(loaded.begin() + ptrdiff_t(f->offset_elems), t.numel, w.begin() + ptrdiff_t(t.offset_elems));
      }
      merged.resize(base.layout(b).total_elems());
      merge_lora_block(spec, b, w, merged);
      model->write_block(b, merged);
    });
  }
  writing([&] {
    if (adapter) adapter->finish();
    if (model) model->finish();
  });
  return r;
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
