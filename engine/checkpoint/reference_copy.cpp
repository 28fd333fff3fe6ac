// The reference copy in a training checkpoint (EngineConfig::keep_reference):
// the starting weights full fine-tuning's reference model runs with, kept
// beside the state so that a resumed run's reference is the run's start,
// never the trained weights. reference.safetensors holds every tensor by its
// model name in the compute dtype, the bytes the engine streams (a
// safetensors.torch.load_file gives the starting model's state dict), with a
// checksum per block in trainer_state.json ("reference").
#include <cstring>

#include <fmt/ranges.h>

#include "engine/checkpoint/parts.h"
#include "engine/checkpoint/reference_copy.h"
#include "engine/checkpoint/train_checkpoint.h"
#include "host/error.h"
#include "io/checksum.h"
#include "io/safetensors.h"

namespace strider::train_checkpoint_parts {

namespace {

DType reference_dtype(const Engine& engine) {
  const at::ScalarType t = engine.config().compute.dtype;
  return t == at::kFloat ? DType::kF32 : t == at::kHalf ? DType::kF16 : DType::kBF16;
}

}  // namespace

nlohmann::json save_reference_copy(const fs::path& dir, Engine& engine) {
  if (!engine.keeps_reference()) return nullptr;
  const ModelSpec& spec = engine.spec();
  const DType dtype = reference_dtype(engine);
  std::vector<TensorSpec> specs;
  for (int64_t b = 0; b < spec.num_blocks(); ++b) {
    const ParamLayout l = spec.layout(b);  // by value: a range over a temporary's slots() would dangle
    for (const TensorSlot& s : l.slots()) specs.push_back({s.name, dtype, s.shape});
  }
  SafetensorsWriteOptions opt;
  opt.base_name = kReferenceBase;
  opt.max_shard_bytes = 0;
  opt.metadata = {{"format", "pt"}, {"strider_reference", "the starting weights (keep_reference)"}};
  SafetensorsWriter file(dir.string(), std::move(specs), opt);
  nlohmann::json sums = nlohmann::json::object();
  size_t index = 0;
  const size_t bytes = dtype_size(dtype);
  for (int64_t b = 0; b < spec.num_blocks(); ++b) {
    const ParamLayout l = spec.layout(b);
    const std::span<const std::byte> copy = engine.reference_copy(b);
    Checksum64Stream cs;
    for (const TensorSlot& s : l.slots()) {
      const auto t = copy.subspan(s.offset_elems * bytes, s.numel * bytes);
      file.write(index++, t);
      cs.update(t);
    }
    sums[l.block_name()] = hex64(cs.digest());
  }
  file.finish();
  return {{"files", file.file_names()}, {"dtype", dtype_name(dtype)}, {"checksums", sums}};
}

ReferenceRead::ReferenceRead() = default;
ReferenceRead::~ReferenceRead() = default;
ReferenceRead::ReferenceRead(ReferenceRead&&) noexcept = default;

ReferenceRead check_reference_copy(const fs::path& dir, const nlohmann::json& trainer_state, const Engine& engine,
                                   bool verify_checksums) {
  ReferenceRead out;
  if (!engine.keeps_reference()) return out;  // a reference the checkpoint holds is not needed
  const std::string ts_file = (dir / kTrainerState).string();
  const nlohmann::json rec = trainer_state.value("reference", nlohmann::json());
  if (!rec.is_object())
    throw CheckpointMismatch(
        fmt::format("{}: the checkpoint holds no reference copy (the run that saved it did not keep_reference), "
                    "and the engine keeps one: the starting weights are not in it, and a reference taken from its "
                    "trained weights would be another model; resume without keep_reference, or from a checkpoint "
                    "of a run that kept it",
                    ts_file),
        false);
  const ModelSpec& spec = engine.spec();
  const DType dtype = reference_dtype(engine);
  const fs::path file = dir / (std::string(kReferenceBase) + ".safetensors");
  STRIDER_CHECK(fs::exists(file), "{}: missing, but {} records a reference copy; the checkpoint is incomplete",
                file.string(), ts_file);
  out.file = std::make_unique<SafetensorsCheckpoint>(file.string());
  const nlohmann::json sums = rec.value("checksums", nlohmann::json::object());
  std::vector<std::string> problems;
  out.views.resize(size_t(spec.num_blocks()));
  for (int64_t b = 0; b < spec.num_blocks(); ++b) {
    const ParamLayout l = spec.layout(b);
    Checksum64Stream cs;
    for (const TensorSlot& s : l.slots()) {
      const auto v = out.file->find(s.name);
      if (!v) {
        problems.push_back(fmt::format("tensor '{}' is missing", s.name));
        continue;
      }
      if (v->dtype != dtype || !std::equal(v->shape.begin(), v->shape.end(), s.shape.begin(), s.shape.end())) {
        problems.push_back(fmt::format("tensor '{}' is {} [{}], expected {} [{}] (the compute dtype)", s.name,
                                       dtype_name(v->dtype), fmt::join(v->shape, ", "), dtype_name(dtype),
                                       fmt::join(s.shape, ", ")));
        continue;
      }
      cs.update(v->bytes);
      out.views[size_t(b)].push_back(*v);
    }
    if (!verify_checksums || !problems.empty()) continue;
    const std::string want = sums.value(l.block_name(), std::string("missing")), got = hex64(cs.digest());
    STRIDER_CHECK(got == want, "{}: the reference copy of block '{}' has checksum {}, but {} recorded {}; the file is "
                  "corrupt: use another checkpoint", file.string(), l.block_name(), got, ts_file, want);
  }
  if (problems.size() > 12) {
    const size_t more = problems.size() - 12;
    problems.resize(12);
    problems.push_back(fmt::format("... and {} more", more));
  }
  STRIDER_CHECK(problems.empty(), "{}: does not hold the reference copy of {}: {}", file.string(), spec.summary(),
                join(problems, "; "));
  return out;
}

void load_reference_copy(const ReferenceRead& read, Engine& engine) {
  if (!read.file) return;
  const ModelSpec& spec = engine.spec();
  const size_t bytes = dtype_size(reference_dtype(engine));
  for (int64_t b = 0; b < spec.num_blocks(); ++b) {
    const ParamLayout l = spec.layout(b);
    const std::span<std::byte> copy = engine.reference_copy(b);
    size_t i = 0;
    for (const TensorSlot& s : l.slots()) {
      const TensorView& v = read.views[size_t(b)][i++];
      std::memcpy(copy.data() + s.offset_elems * bytes, v.bytes.data(), v.bytes.size());
    }
  }
}

}  // namespace strider::train_checkpoint_parts
