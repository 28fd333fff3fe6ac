#include "engine/model/peft_adapter.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "host/bf16.h"
#include "host/error.h"
#include "io/atomic_file.h"

namespace strider {

namespace fs = std::filesystem;

namespace {

constexpr const char* kAdapterBase = "adapter_model";
constexpr const char* kAdapterConfig = "adapter_config.json";

std::vector<ParamLayout> layouts_of(const ModelSpec& spec) {
  std::vector<ParamLayout> out;
  for (int64_t b = 0; b < spec.num_blocks(); ++b) out.push_back(spec.layout(b));
  return out;
}

}  // namespace

std::string peft_saved_name(const std::string& name) { return "base_model.model." + name; }

PeftAdapterWriter::PeftAdapterWriter(std::string dir, const ModelSpec& spec, PeftAdapterOptions options)
    : dir_(std::move(dir)), options_(std::move(options)), layouts_(layouts_of(spec)) {
  STRIDER_CHECK(spec.lora.enabled(), "{}: {} has no LoRA adapters to save", dir_, spec.summary());
  STRIDER_CHECK(options_.dtype == DType::kBF16 || options_.dtype == DType::kF32,
                "{}: cannot write an adapter in {}; use BF16 or F32", dir_, dtype_name(options_.dtype));
  const LoraSpec& l = spec.lora;
  // What LoraConfig.from_pretrained reads; the rest of its fields take their
  // defaults (no dropout, no bias, PEFT's init), which is what strider trained.
  nlohmann::ordered_json c = {{"peft_type", "LORA"},
                              {"task_type", "CAUSAL_LM"},
                              {"base_model_name_or_path", options_.base_model},
                              {"r", l.r},
                              {"lora_alpha", l.alpha},
                              {"use_rslora", l.rslora},
                              {"target_modules", l.targets},
                              {"modules_to_save", nullptr},
                              {"lora_dropout", 0.0},
                              {"bias", "none"},
                              {"fan_in_fan_out", false},
                              {"use_dora", false},
                              {"init_lora_weights", true},
                              {"inference_mode", true}};
  if (!l.train.empty()) c["modules_to_save"] = l.train;  // PEFT's names: "lm_head", "embed_tokens"
  config_text_ = c.dump(2) + "\n";
  std::vector<TensorSpec> specs;
  for (const ParamLayout& lay : layouts_)
    for (const TensorSlot& s : lay.slots())
      if (s.trainable) specs.push_back({peft_saved_name(s.name), options_.dtype, s.shape});
  written_.assign(layouts_.size(), false);
  fs::create_directories(dir_);
  SafetensorsWriteOptions wo;
  wo.base_name = kAdapterBase;
  writer_.emplace(dir_, std::move(specs), std::move(wo));
}

void PeftAdapterWriter::write_block(int64_t block, std::span<const float> weights) {
  STRIDER_CHECK(!finished_, "{}: write_block after finish()", dir_);
  STRIDER_CHECK(block >= 0 && block < int64_t(layouts_.size()), "{}: block {} out of range (the model has {} blocks)",
                dir_, block, layouts_.size());
  const ParamLayout& l = layouts_[size_t(block)];
  STRIDER_CHECK(!written_[size_t(block)], "{}: block '{}' written twice", dir_, l.block_name());
  STRIDER_CHECK(weights.size() == l.total_elems(), "{}: block '{}' needs {} floats, got {}", dir_, l.block_name(),
                l.total_elems(), weights.size());
  std::vector<uint16_t> tmp;
  for (const TensorSlot& s : l.slots()) {
    if (!s.trainable) continue;
    const auto src = weights.subspan(s.offset_elems, s.numel);
    if (options_.dtype == DType::kF32) {
      writer_->write(peft_saved_name(s.name), std::as_bytes(src));
      continue;
    }
    tmp.resize(s.numel);  // adapters are small; a trained embedding or head is one tensor's worth
    float_to_bf16(src, tmp);
    writer_->write(peft_saved_name(s.name), std::as_bytes(std::span<const uint16_t>(tmp)));
  }
  written_[size_t(block)] = true;
}

void PeftAdapterWriter::finish() {
  STRIDER_CHECK(!finished_, "{}: finish() called twice", dir_);
  for (size_t b = 0; b < written_.size(); ++b)
    STRIDER_CHECK(written_[b], "{}: block '{}' was never written; nothing was saved", dir_, layouts_[b].block_name());
  writer_->finish();
  // Last: a folder with a config and no tensors is never left behind.
  write_file_atomic((fs::path(dir_) / kAdapterConfig).string(), std::as_bytes(std::span(config_text_)));
  finished_ = true;
}

std::vector<std::string> PeftAdapterWriter::file_names() const {
  std::vector<std::string> names = writer_->file_names();
  names.push_back(kAdapterConfig);
  return names;
}

uint64_t PeftAdapterWriter::bytes(const ModelSpec& spec, DType dtype) {
  uint64_t n = 0;
  for (int64_t b = 0; b < spec.num_blocks(); ++b) {
    const ParamLayout l = spec.layout(b);
    for (const TensorSlot& s : l.slots())
      if (s.trainable) n += s.numel;
  }
  return n * dtype_size(dtype);
}

void merge_lora_block(const ModelSpec& spec, int64_t block, std::span<const float> with_adapters,
                      std::span<float> out) {
  const ParamLayout l = spec.layout(block);
  const ParamLayout base = spec.with_lora("", "merge").layout(block);
  STRIDER_CHECK(with_adapters.size() == l.total_elems() && out.size() == base.total_elems(),
                "merge_lora_block: block '{}' needs {} and {} floats, got {} and {}", l.block_name(), l.total_elems(),
                base.total_elems(), with_adapters.size(), out.size());
  std::fill(out.begin(), out.end(), 0.0f);
  for (const TensorSlot& s : base.slots()) {
    const TensorSlot* from = l.find(s.name);
    STRIDER_CHECK(from != nullptr, "merge_lora_block: '{}' is missing from the adapted block", s.name);
    std::copy_n(with_adapters.begin() + ptrdiff_t(from->offset_elems), s.numel, out.begin() + ptrdiff_t(s.offset_elems));
    const std::string stem = s.name.substr(0, s.name.size() - std::string_view(".weight").size());
    const TensorSlot* a = l.find(stem + ".lora_A.weight");
    const TensorSlot* b = l.find(stem + ".lora_B.weight");
    if (a == nullptr || b == nullptr) continue;
    // W [out, in] += scale * B [out, r] @ A [r, in], in place on `out`'s fp32 copy.
    auto f32 = [](const float* p, const std::vector<int64_t>& shape) {
      return at::from_blob(const_cast<float*>(p), shape, at::kFloat);
    };
    at::Tensor w = f32(out.data() + s.offset_elems, s.shape);
    w.addmm_(f32(with_adapters.data() + b->offset_elems, b->shape), f32(with_adapters.data() + a->offset_elems, a->shape),
             1.0, spec.lora.scale());
  }
}

}  // namespace strider
