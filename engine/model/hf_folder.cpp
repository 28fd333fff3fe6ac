#include "engine/model/hf_folder.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <unordered_set>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "host/bf16.h"
#include "host/error.h"
#include "host/param_store.h"
#include "io/atomic_file.h"

namespace strider {
namespace fs = std::filesystem;

float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24 is exact in float.
    float f = static_cast<float>(mant) * 0x1p-24f;
    std::memcpy(&u, &f, sizeof u);
    u |= sign;
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);  // Inf, or NaN with its payload
  } else {
    u = sign | ((exp + (127 - 15)) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

namespace {

std::string shape_text(std::span<const int64_t> shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Tensors a checkpoint may carry that are not parameters: buffers older
// transformers versions saved (rotary inverse frequencies).
bool is_known_buffer(std::string_view name) {
  return name.ends_with(".rotary_emb.inv_freq");
}

bool convertible(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

// Converts `count` elements of `src` (dtype `t`, possibly unaligned) to fp32.
// The source is a mapped file: elements are read with memcpy, in chunks that
// stay in cache.
void convert_to_f32(DType t, const std::byte* src, size_t count, float* dst) {
  if (t == DType::kF32) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  constexpr size_t kChunkElems = 4096;
  std::array<uint16_t, kChunkElems> tmp;
  for (size_t done = 0; done < count; done += kChunkElems) {
    const size_t n = std::min(kChunkElems, count - done);
    std::memcpy(tmp.data(), src + done * 2, n * 2);
    if (t == DType::kBF16) {
      bf16_to_float(std::span<const uint16_t>(tmp.data(), n), std::span<float>(dst + done, n));
    } else {
      for (size_t i = 0; i < n; ++i) dst[done + i] = f16_to_float(tmp[i]);
    }
  }
}

// Position of a decoder-layer tensor in transformers' state_dict (module
// registration order: self_attn, mlp, then the two norms; weight before bias),
// so shards group tensors as save_pretrained does.
int state_dict_rank(std::string_view name) {
  static constexpr std::string_view kOrder[] = {
      "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
      "self_attn.k_proj.bias",   "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.qkv_proj.weight",
      "self_attn.o_proj.weight", "self_attn.o_proj.bias", "self_attn.q_norm.weight",
      "self_attn.k_norm.weight", "mlp.gate_proj.weight",  "mlp.gate_proj.bias",
      "mlp.up_proj.weight",      "mlp.up_proj.bias",      "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
      "mlp.down_proj.bias",      "input_layernorm.weight", "post_attention_layernorm.weight",
  };
  for (size_t i = 0; i < std::size(kOrder); ++i)
    if (name.ends_with(kOrder[i])) return static_cast<int>(i);
  return static_cast<int>(std::size(kOrder));  // anything else keeps its layout order, last
}

// True when two layouts hold the same tensors at the same offsets.
bool same_layout(const ParamLayout& a, const ParamLayout& b) {
  if (a.total_elems() != b.total_elems() || a.slots().size() != b.slots().size()) return false;
  for (size_t i = 0; i < a.slots().size(); ++i) {
    const TensorSlot &x = a.slots()[i], &y = b.slots()[i];
    if (x.name != y.name || x.shape != y.shape || x.offset_elems != y.offset_elems) return false;
  }
  return true;
}

std::vector<ParamLayout> layouts_of(const ModelSpec& spec) {
  std::vector<ParamLayout> out;
  out.reserve(static_cast<size_t>(spec.num_blocks()));
  for (int64_t i = 0; i < spec.num_blocks(); ++i) out.push_back(spec.layout(i));
  return out;
}

}  // namespace

std::vector<FilePart> hub_parts(const ModelSpec& spec, const TensorSlot& slot) {
  const std::string_view name = slot.name;
  static constexpr std::string_view kRouter = "mlp.gate.weight", kGateUp = "mlp.experts.gate_up_proj",
                                    kDown = "mlp.experts.down_proj";
  const bool mixtral = spec.arch == Arch::kMixtral;
  auto prefix_of = [&](std::string_view tail) { return std::string(name.substr(0, name.size() - tail.size())); };
  if (!spec.dims.moe.sparse() || !(name.ends_with(kRouter) || name.ends_with(kGateUp) || name.ends_with(kDown)))
    return {FilePart{slot.name, slot.shape, 0}};
  if (name.ends_with(kRouter))
    return {FilePart{mixtral ? prefix_of(kRouter) + "block_sparse_moe.gate.weight" : slot.name, slot.shape, 0}};
  const bool gate_up = name.ends_with(kGateUp);
  const std::string p = prefix_of(gate_up ? kGateUp : kDown) + (mixtral ? "block_sparse_moe.experts." : "mlp.experts.");
  const int64_t E = slot.shape[0], rows = slot.shape[1], cols = slot.shape[2];
  std::vector<FilePart> out;
  for (int64_t e = 0; e < E; ++e) {
    const size_t at = size_t(e * rows * cols);
    if (!gate_up) {
      out.push_back({fmt::format("{}{}.{}", p, e, mixtral ? "w2.weight" : "down_proj.weight"), {rows, cols}, at});
      continue;
    }
    const int64_t I = rows / 2;  // gate's rows, then up's
    out.push_back({fmt::format("{}{}.{}", p, e, mixtral ? "w1.weight" : "gate_proj.weight"), {I, cols}, at});
    out.push_back({fmt::format("{}{}.{}", p, e, mixtral ? "w3.weight" : "up_proj.weight"), {I, cols},
                   at + size_t(I * cols)});
  }
  return out;
}

// ---- HfCheckpointReader ----------------------------------------------------

HfCheckpointReader::HfCheckpointReader(const std::string& path, const ModelSpec& spec)
    : path_(path), checkpoint_(path), layouts_(layouts_of(spec)) {
  std::vector<std::string> problems;
  std::unordered_set<std::string> expected;  // owned: a slot's Hub parts are made here
  views_.resize(layouts_.size());
  for (size_t b = 0; b < layouts_.size(); ++b) {
    for (const TensorSlot& slot : layouts_[b].slots()) {
      // The slot as one tensor (strider's layout, transformers' in memory), else the Hub's parts.
      std::vector<FilePart> parts{FilePart{slot.name, slot.shape, 0}};
      if (!checkpoint_.find(slot.name)) parts = hub_parts(spec, slot);
      std::vector<Part> found;
      for (const FilePart& part : parts) {
        expected.insert(part.name);
        auto view = checkpoint_.find(part.name);
        if (!view) {
          problems.push_back(fmt::format("tensor '{}' (block {}, shape {}) is missing", part.name,
                                         layouts_[b].block_name(), shape_text(part.shape)));
          continue;
        }
        const bool shape_ok = std::equal(view->shape.begin(), view->shape.end(), part.shape.begin(), part.shape.end());
        if (!shape_ok)
          problems.push_back(fmt::format("tensor '{}' has shape {} in the checkpoint; the model "
                                         "needs {}", part.name, shape_text(view->shape), shape_text(part.shape)));
        if (!convertible(view->dtype))
          problems.push_back(fmt::format("tensor '{}' has dtype {}, which strider does not load "
                                         "(F32, BF16, F16)", part.name, dtype_name(view->dtype)));
        found.push_back(Part{part.offset_elems, *view});
      }
      views_[b].push_back(std::move(found));
    }
  }
  for (const std::string& name : checkpoint_.names()) {
    if (expected.contains(name)) continue;
    if ((spec.tie_embeddings && name == "lm_head.weight") || is_known_buffer(name)) {
      ignored_.push_back(name);
      continue;
    }
    problems.push_back(fmt::format("tensor '{}' is not a parameter of {}", name, spec.arch_name));
  }
  if (problems.empty()) return;

  constexpr size_t kShown = 12;
  std::string list;
  for (size_t i = 0; i < std::min(problems.size(), kShown); ++i) list += "\n  " + problems[i];
  if (problems.size() > kShown) list += fmt::format("\n  ... and {} more", problems.size() - kShown);
  throw Error(fmt::format("checkpoint {} does not match the model ({}): {} problem(s):{}\nCheck "
                          "that config.json and the weights belong to the same model.",
                          path_, spec.summary(), problems.size(), list));
}

const ParamLayout& HfCheckpointReader::layout(int64_t block) const {
  STRIDER_CHECK(block >= 0 && block < num_blocks(), "{}: block {} out of range (model has {} blocks)",
                path_, block, num_blocks());
  return layouts_[static_cast<size_t>(block)];
}

DType HfCheckpointReader::dtype() const {
  uint64_t f32 = 0, bf16 = 0, f16 = 0;
  for (const auto& block : views_)
    for (const auto& slot : block)
      for (const Part& p : slot)
        (p.view.dtype == DType::kF32 ? f32 : p.view.dtype == DType::kBF16 ? bf16 : f16) += p.view.numel();
  return f32 >= bf16 && f32 >= f16 ? DType::kF32 : bf16 >= f16 ? DType::kBF16 : DType::kF16;
}

void HfCheckpointReader::read_block(int64_t block, std::span<float> master) const {
  const ParamLayout& l = layout(block);
  STRIDER_CHECK(master.size() == l.total_elems(), "{}: block '{}' needs a buffer of {} floats, got {}",
                path_, l.block_name(), l.total_elems(), master.size());
  const auto& views = views_[static_cast<size_t>(block)];
  size_t cursor = 0;  // slots are in ascending offset order; zero the gaps between them
  for (size_t i = 0; i < l.slots().size(); ++i) {
    const TensorSlot& slot = l.slots()[i];
    std::fill(master.begin() + cursor, master.begin() + slot.offset_elems, 0.0f);
    for (const Part& p : views[i]) {  // they cover the slot
      convert_to_f32(p.view.dtype, p.view.bytes.data(), p.view.numel(), master.data() + slot.offset_elems + p.offset_elems);
      checkpoint_.release_pages(p.view);
    }
    cursor = slot.offset_elems + slot.numel;
  }
  std::fill(master.begin() + cursor, master.end(), 0.0f);
}

void HfCheckpointReader::load_into(ParamStore& store) const {
  STRIDER_CHECK(store.num_blocks() == layouts_.size(), "{}: the store has {} blocks, the model {}",
                path_, store.num_blocks(), layouts_.size());
  for (size_t b = 0; b < layouts_.size(); ++b) {
    STRIDER_CHECK(same_layout(store.layout(b), layouts_[b]), "{}: the store's layout of block '{}' "
                  "differs from the model spec's; build the store from the same ModelSpec", path_,
                  layouts_[b].block_name());
    STRIDER_CHECK(store.block(b).state_on_host, "{}: block '{}' keeps its state on NVMe; load it "
                  "with read_block() into a staging buffer instead", path_, layouts_[b].block_name());
    STRIDER_CHECK(store.block(b).state_elems() == store.block(b).elems(), "{}: the store keeps a slice of block "
                  "'{}' (sharded state); load it with read_block() and write the slice", path_,
                  layouts_[b].block_name());
  }
  std::vector<float> w;
  for (size_t b = 0; b < layouts_.size(); ++b) {
    if (store.options().format == StateFormat::kFp32) {  // straight into the master
      read_block(static_cast<int64_t>(b), store.block(b).master);
      store.refresh_compute(b);
      continue;
    }
    w.resize(layouts_[b].total_elems());
    read_block(static_cast<int64_t>(b), w);
    store.write_kind(b, StateKind::kMaster, w);  // and the compute copy, in whatever format the store keeps
  }
}

// ---- HfCheckpointWriter ----------------------------------------------------

HfCheckpointWriter::HfCheckpointWriter(std::string out_dir, const ModelSpec& spec,
                                       std::string_view config_json, HfWriteOptions options)
    : out_dir_(std::move(out_dir)), options_(options), layouts_(layouts_of(spec)) {
  STRIDER_CHECK(options_.dtype == DType::kBF16 || options_.dtype == DType::kF32,
                "{}: cannot write checkpoints in {}; use BF16 or F32", out_dir_,
                dtype_name(options_.dtype));
  // The config first: a bad one must fail before any file is created.
  auto config = nlohmann::ordered_json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  STRIDER_CHECK(!config.is_discarded() && config.is_object(),
                "{}: the config.json text to write is not a JSON object", out_dir_);
  const ModelSpec described = ModelSpec::from_json(nlohmann::json::parse(config_json),
                                                   out_dir_ + " (config to write)");
  bool same = described.num_blocks() == spec.num_blocks();
  for (int64_t i = 0; same && i < spec.num_blocks(); ++i)
    same = same_layout(described.layout(i), layouts_[static_cast<size_t>(i)]);
  STRIDER_CHECK(same, "{}: the config to write describes {}, but the weights are {}; pass the "
                "config.json of the model being saved", out_dir_, described.summary(), spec.summary());
  const char* dtype_text = options_.dtype == DType::kBF16 ? "bfloat16" : "float32";
  config["dtype"] = dtype_text;  // transformers >= 5
  if (config.contains("torch_dtype")) config["torch_dtype"] = dtype_text;  // older readers
  config_text_ = config.dump(2) + "\n";

  std::vector<std::pair<size_t, size_t>> order;  // (block, slot) in state_dict order
  for (size_t b = 0; b < layouts_.size(); ++b) {
    block_names_.push_back(layouts_[b].block_name());
    std::vector<size_t> slots(layouts_[b].slots().size());
    for (size_t i = 0; i < slots.size(); ++i) slots[i] = i;
    std::stable_sort(slots.begin(), slots.end(), [&](size_t x, size_t y) {
      return state_dict_rank(layouts_[b].slots()[x].name) < state_dict_rank(layouts_[b].slots()[y].name);
    });
    for (size_t i : slots) order.emplace_back(b, i);
  }
  std::vector<TensorSpec> specs;
  parts_.resize(layouts_.size());
  for (size_t b = 0; b < layouts_.size(); ++b)
    for (const TensorSlot& slot : layouts_[b].slots()) parts_[b].push_back(hub_parts(spec, slot));
  for (auto [b, i] : order)
    for (const FilePart& part : parts_[b][i]) specs.push_back(TensorSpec{part.name, options_.dtype, part.shape});
  written_.assign(layouts_.size(), false);
  fs::create_directories(out_dir_);
  SafetensorsWriteOptions wo;
  wo.max_shard_bytes = options_.max_shard_bytes;
  writer_.emplace(out_dir_, std::move(specs), std::move(wo));
}

void HfCheckpointWriter::write_block(int64_t block, std::span<const float> master) {
  STRIDER_CHECK(!finished_, "{}: write_block after finish()", out_dir_);
  STRIDER_CHECK(block >= 0 && block < static_cast<int64_t>(layouts_.size()),
                "{}: block {} out of range (model has {} blocks)", out_dir_, block, layouts_.size());
  const size_t b = static_cast<size_t>(block);
  const ParamLayout& l = layouts_[b];
  STRIDER_CHECK(!written_[b], "{}: block '{}' written twice", out_dir_, l.block_name());
  STRIDER_CHECK(master.size() == l.total_elems(), "{}: block '{}' needs {} floats, got {}", out_dir_,
                l.block_name(), l.total_elems(), master.size());
  constexpr size_t kChunkElems = size_t{1} << 16;
  std::vector<uint16_t> tmp;
  for (size_t i = 0; i < l.slots().size(); ++i) {
    const TensorSlot& slot = l.slots()[i];
    for (const FilePart& part : parts_[b][i]) {
      size_t numel = 1;
      for (int64_t x : part.shape) numel *= size_t(x);
      auto src = master.subspan(slot.offset_elems + part.offset_elems, numel);
      if (options_.dtype == DType::kF32) {
        writer_->write(part.name, std::as_bytes(src));
        continue;
      }
      tmp.resize(std::min(kChunkElems, numel));
      for (size_t done = 0; done < numel; done += kChunkElems) {
        const size_t n = std::min(kChunkElems, numel - done);
        float_to_bf16(src.subspan(done, n), std::span<uint16_t>(tmp.data(), n));
        writer_->write(part.name, std::as_bytes(std::span<const uint16_t>(tmp.data(), n)), done * sizeof(uint16_t));
      }
    }
  }
  written_[b] = true;
}

void HfCheckpointWriter::finish() {
  STRIDER_CHECK(!finished_, "{}: finish() called twice", out_dir_);
  for (size_t b = 0; b < written_.size(); ++b)
    STRIDER_CHECK(written_[b], "{}: block '{}' was never written; nothing was saved", out_dir_,
                  block_names_[b]);
  writer_->finish();
  // An earlier save into this directory may have left another layout (one
  // file vs. shards): the loader prefers an index, so a stale one must go.
  // Ours are in place already, so a reader sees the old or the new set.
  const auto ours = writer_->file_names();
  std::vector<fs::path> stale;
  for (const std::string& name : model_files_in(out_dir_))
    if (std::find(ours.begin(), ours.end(), name) == ours.end()) stale.push_back(fs::path(out_dir_) / name);
  // The index first: while it exists it names only complete files.
  std::sort(stale.begin(), stale.end(), [](const fs::path& a, const fs::path& b) {
    return (a.extension() == ".json") > (b.extension() == ".json");
  });
  for (const auto& p : stale) {
    std::error_code ec;
    fs::remove(p, ec);
    STRIDER_CHECK(!ec, "{}: cannot remove the stale checkpoint file {}: {}", out_dir_, p.string(),
                  ec.message());
    removed_.push_back(p.filename().string());
  }
  write_file_atomic((fs::path(out_dir_) / "config.json").string(),
                    std::as_bytes(std::span(config_text_)));
  finished_ = true;
}

std::vector<std::string> HfCheckpointWriter::file_names() const {
  auto names = writer_->file_names();
  names.push_back("config.json");
  return names;
}

std::vector<std::string> model_files_in(const std::string& dir) {
  static const std::regex kShard(R"(model-\d{5}-of-\d{5}\.safetensors)");
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name == "model.safetensors" || name == "model.safetensors.index.json" || std::regex_match(name, kShard))
      out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string resolve_model_path(const std::string& model, std::string_view what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(model, ec)) return model;
  // A Hub id: one '/', no path-like start, no empty half.
  const size_t slash = model.find('/');
  const bool hub_id = slash != std::string::npos && slash > 0 && slash + 1 < model.size() &&
                      model.find('/', slash + 1) == std::string::npos && model[0] != '.' && model[0] != '~';
  STRIDER_CHECK(hub_id, "{} {}: no such file or directory", what, model);
  fs::path cache;
  if (const char* c = std::getenv("HF_HUB_CACHE"); c != nullptr && *c != '\0') cache = c;
  else if (const char* h = std::getenv("HF_HOME"); h != nullptr && *h != '\0') cache = fs::path(h) / "hub";
  else if (const char* home = std::getenv("HOME"); home != nullptr) cache = fs::path(home) / ".cache" / "huggingface" / "hub";
  const fs::path repo = cache / ("models--" + model.substr(0, slash) + "--" + model.substr(slash + 1));
  const std::string download = fmt::format(
      "download it first (`huggingface-cli download {}`, or from Python huggingface_hub.snapshot_download(\"{}\")), "
      "or give the checkpoint's directory",
      model, model);
  STRIDER_CHECK(fs::is_directory(repo / "snapshots", ec), "{} {}: not a directory here, and not in the Hugging Face "
                "cache ({} has no snapshot of it); {}", what, model, repo.string(), download);
  fs::path snapshot;
  if (std::ifstream ref(repo / "refs" / "main"); ref) {
    std::string commit;
    ref >> commit;
    if (!commit.empty() && fs::is_directory(repo / "snapshots" / commit, ec)) snapshot = repo / "snapshots" / commit;
  }
  if (snapshot.empty()) {
    std::vector<fs::path> all;
    for (const auto& e : fs::directory_iterator(repo / "snapshots", ec))
      if (e.is_directory()) all.push_back(e.path());
    STRIDER_CHECK(all.size() == 1, "{} {}: the Hugging Face cache {} holds {} snapshots and no refs/main to choose "
                  "one; give the snapshot's directory, or {}", what, model, repo.string(), all.size(), download);
    snapshot = all.front();
  }
  STRIDER_CHECK(fs::is_regular_file(snapshot / "config.json", ec), "{} {}: the cached snapshot {} has no config.json "
                "(an incomplete download?); {}", what, model, snapshot.string(), download);
  return snapshot.string();
}

}  // namespace strider
