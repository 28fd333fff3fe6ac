#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "host/error.h"
#include "io/mapped_file.h"

namespace strider {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

uint64_t load_le64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint64_t>(p[i]);
  return v;
}

void store_le64(std::byte* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

// numel * dtype size, or nullopt on overflow of uint64.
std::optional<uint64_t> byte_size(DType dtype, std::span<const int64_t> shape) {
  uint64_t n = 1;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return std::nullopt;
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(n, static_cast<uint64_t>(dtype_size(dtype)), &bytes)) return std::nullopt;
  return bytes;
}

std::string shape_text(std::span<const int64_t> shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

SafetensorsEntry parse_entry(const std::string& name, const json& v, std::string_view label,
                             uint64_t data_bytes) {
  STRIDER_CHECK(v.is_object(), "{}: tensor '{}': header entry is {}, expected an object with "
                "dtype, shape, data_offsets", label, name, v.type_name());
  SafetensorsEntry e;
  e.name = name;
  auto dt = v.find("dtype");
  STRIDER_CHECK(dt != v.end() && dt->is_string(), "{}: tensor '{}': field 'dtype' missing or not "
                "a string", label, name);
  auto parsed = dtype_from_name(dt->get_ref<const std::string&>());
  STRIDER_CHECK(parsed.has_value(), "{}: tensor '{}': field 'dtype' is '{}', not a dtype we know "
                "(F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 I16 I8 U64 U32 U16 U8 BOOL)", label,
                name, dt->get_ref<const std::string&>());
  e.dtype = *parsed;

  auto sh = v.find("shape");
  STRIDER_CHECK(sh != v.end() && sh->is_array(), "{}: tensor '{}': field 'shape' missing or not "
                "an array", label, name);
  for (size_t i = 0; i < sh->size(); ++i) {
    const json& d = (*sh)[i];
    STRIDER_CHECK(!d.is_number_integer() || d.is_number_unsigned(),
                  "{}: tensor '{}': field 'shape' dim {} is negative ({})", label, name, i, d.dump());
    STRIDER_CHECK(d.is_number_unsigned() &&
                      d.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX),
                  "{}: tensor '{}': field 'shape' dim {} is {}, not an integer in [0, 2^63)",
                  label, name, i, d.dump());
    e.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }

  auto off = v.find("data_offsets");
  STRIDER_CHECK(off != v.end() && off->is_array() && off->size() == 2 &&
                    (*off)[0].is_number_unsigned() && (*off)[1].is_number_unsigned(),
                "{}: tensor '{}': field 'data_offsets' must be [begin, end] of non-negative "
                "integers, got {}", label, name, off == v.end() ? "nothing" : off->dump());
  e.begin_bytes = (*off)[0].get<uint64_t>();
  e.end_bytes = (*off)[1].get<uint64_t>();
  STRIDER_CHECK(e.begin_bytes <= e.end_bytes, "{}: tensor '{}': field 'data_offsets' [{}, {}] "
                "ends before it begins", label, name, e.begin_bytes, e.end_bytes);
  STRIDER_CHECK(e.end_bytes <= data_bytes, "{}: tensor '{}': field 'data_offsets' [{}, {}] runs "
                "past the data area of {} bytes; the file is truncated or its header is wrong",
                label, name, e.begin_bytes, e.end_bytes, data_bytes);

  auto expected = byte_size(e.dtype, e.shape);
  STRIDER_CHECK(expected.has_value(), "{}: tensor '{}': field 'shape' {} times {} bytes overflows "
                "64 bits", label, name, shape_text(e.shape), dtype_size(e.dtype));
  STRIDER_CHECK(*expected == e.size_bytes(), "{}: tensor '{}': dtype {} and shape {} need {} "
                "bytes but field 'data_offsets' [{}, {}] spans {}", label, name,
                dtype_name(e.dtype), shape_text(e.shape), *expected, e.begin_bytes, e.end_bytes,
                e.size_bytes());
  return e;
}

}  // namespace

SafetensorsHeader parse_safetensors_header(std::span<const std::byte> file, std::string_view label) {
  STRIDER_CHECK(file.size() >= 8, "{}: {} bytes is too small for a safetensors file (the 8-byte "
                "header length is missing)", label, file.size());
  SafetensorsHeader h;
  h.header_bytes = load_le64(file.data());
  STRIDER_CHECK(h.header_bytes <= kMaxSafetensorsHeaderBytes, "{}: header length {} exceeds the "
                "limit of {} bytes; not a safetensors file or a corrupt one", label,
                h.header_bytes, kMaxSafetensorsHeaderBytes);
  STRIDER_CHECK(h.header_bytes <= file.size() - 8, "{}: header length {} runs past the end of "
                "the file ({} bytes); the file is truncated", label, h.header_bytes, file.size());
  h.data_offset_bytes = 8 + h.header_bytes;
  h.data_bytes = file.size() - h.data_offset_bytes;

  const char* text = reinterpret_cast<const char*>(file.data() + 8);
  STRIDER_CHECK(h.header_bytes > 0 && text[0] == '{', "{}: header does not start with '{{' "
                "(header length {}); not a safetensors file", label, h.header_bytes);
  json root;
  try {
    root = json::parse(text, text + h.header_bytes);
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: header ({} bytes) is not valid JSON: {}", label, h.header_bytes,
                            e.what()));
  }
  STRIDER_CHECK(root.is_object(), "{}: header is JSON {} but must be an object", label,
                root.type_name());

  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      STRIDER_CHECK(value.is_object(), "{}: field '__metadata__' is {}, must be an object of "
                    "strings", label, value.type_name());
      for (const auto& [mk, mv] : value.items()) {
        STRIDER_CHECK(mv.is_string(), "{}: field '__metadata__' key '{}' is {}, must be a string",
                      label, mk, mv.type_name());
        h.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    h.entries.push_back(parse_entry(key, value, label, h.data_bytes));
  }

  // The format requires the tensors to tile the data area: sort by offset,
  // then each begins where the previous ended and the last ends at the end.
  std::sort(h.entries.begin(), h.entries.end(), [](const auto& a, const auto& b) {
    return a.begin_bytes != b.begin_bytes ? a.begin_bytes < b.begin_bytes : a.end_bytes < b.end_bytes;
  });
  uint64_t cursor = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const auto& e : h.entries) {
    if (e.begin_bytes < cursor)
      throw Error(fmt::format("{}: tensor '{}': data_offsets [{}, {}] overlap tensor '{}' [{}, {}]",
                              label, e.name, e.begin_bytes, e.end_bytes, prev->name,
                              prev->begin_bytes, prev->end_bytes));
    STRIDER_CHECK(e.begin_bytes == cursor, "{}: tensor '{}': data_offsets begin at {} but the "
                  "previous tensor ends at {}; safetensors requires no gaps between tensors",
                  label, e.name, e.begin_bytes, cursor);
    cursor = e.end_bytes;
    prev = &e;
  }
  STRIDER_CHECK(cursor == h.data_bytes, "{}: tensors end at data offset {} but the data area is "
                "{} bytes; the file has trailing bytes or the header is wrong", label, cursor,
                h.data_bytes);
  return h;
}

uint64_t TensorView::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

// ---- SafetensorsFile ----------------------------------------------------

SafetensorsFile::SafetensorsFile(const std::string& path)
    : map_(path), header_(parse_safetensors_header(map_.bytes(), path)) {
  for (size_t i = 0; i < header_.entries.size(); ++i)
    by_name_.emplace(header_.entries[i].name, i);
}

TensorView SafetensorsFile::tensor(size_t i) const {
  const auto& e = header_.entries.at(i);
  return TensorView{e.name, e.dtype, e.shape,
                    map_.bytes().subspan(header_.data_offset_bytes + e.begin_bytes, e.size_bytes()),
                    map_.path()};
}

std::optional<TensorView> SafetensorsFile::find(std::string_view name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return std::nullopt;
  return tensor(it->second);
}

TensorView SafetensorsFile::get(std::string_view name) const {
  auto t = find(name);
  STRIDER_CHECK(t.has_value(), "{}: no tensor named '{}' ({} tensors in the file)", path(), name,
                size());
  return *t;
}

// ---- SafetensorsCheckpoint ----------------------------------------------

SafetensorsCheckpoint::SafetensorsCheckpoint(const std::string& path) : label_(path) {
  fs::path p(path);
  fs::path index_path;
  if (fs::is_directory(p)) {
    if (fs::exists(p / "model.safetensors.index.json")) {
      index_path = p / "model.safetensors.index.json";
    } else {
      STRIDER_CHECK(fs::exists(p / "model.safetensors"), "{}: directory holds neither "
                    "model.safetensors.index.json nor model.safetensors", path);
      p = p / "model.safetensors";
    }
  } else if (p.string().ends_with(".json")) {
    index_path = p;
  }

  if (index_path.empty()) {
    files_.push_back(std::make_unique<SafetensorsFile>(p.string()));
  } else {
    check_regular_input(index_path.string(), "a safetensors index is a JSON file");
    std::ifstream in(index_path);
    STRIDER_CHECK(in.good(), "{}: cannot open the index: {}", index_path.string(), errno_text(errno));
    json index;
    try {
      index = json::parse(in);
    } catch (const json::exception& e) {
      throw Error(fmt::format("{}: index is not valid JSON: {}", index_path.string(), e.what()));
    }
    STRIDER_CHECK(index.is_object() && index.contains("weight_map") &&
                      index["weight_map"].is_object(),
                  "{}: field 'weight_map' missing or not an object", index_path.string());
    if (index.contains("metadata")) index_metadata_json_ = index["metadata"].dump();
    // Shards in order of first appearance in the (sorted) weight map, which is
    // also the order of the numbered shard names that transformers writes.
    std::vector<std::string> shard_names;
    std::unordered_map<std::string, size_t> shard_of_file;
    std::vector<std::pair<std::string, std::string>> wanted;  // tensor, file
    for (const auto& [tensor, file] : index["weight_map"].items()) {
      STRIDER_CHECK(file.is_string(), "{}: field 'weight_map' entry '{}' is {}, must be a file "
                    "name", index_path.string(), tensor, file.type_name());
      const auto& name = file.get_ref<const std::string&>();
      STRIDER_CHECK(!name.empty() && fs::path(name).filename() == fs::path(name),
                    "{}: field 'weight_map' entry '{}' names '{}', which is not a plain file name "
                    "in the checkpoint directory", index_path.string(), tensor, name);
      if (shard_of_file.emplace(name, shard_names.size()).second) shard_names.push_back(name);
      wanted.emplace_back(tensor, name);
    }
    std::sort(shard_names.begin(), shard_names.end());
    for (size_t i = 0; i < shard_names.size(); ++i) shard_of_file[shard_names[i]] = i;
    fs::path dir = index_path.parent_path();
    for (const auto& name : shard_names)
      files_.push_back(std::make_unique<SafetensorsFile>((dir / name).string()));
    for (const auto& [tensor, file] : wanted) {
      const auto& shard = *files_[shard_of_file.at(file)];
      STRIDER_CHECK(shard.find(tensor).has_value(), "{}: tensor '{}' is listed in the index but "
                    "missing from its shard {}", index_path.string(), tensor, shard.path());
    }
    label_ = index_path.string();
  }

  for (size_t f = 0; f < files_.size(); ++f) {
    for (size_t i = 0; i < files_[f]->size(); ++i) {
      const std::string& name = files_[f]->header().entries[i].name;
      auto [it, fresh] = where_.emplace(name, std::make_pair(f, i));
      STRIDER_CHECK(fresh, "{}: tensor '{}' is in both {} and {}", label_, name,
                    files_[it->second.first]->path(), files_[f]->path());
      names_.push_back(name);
    }
  }
}

std::optional<TensorView> SafetensorsCheckpoint::find(std::string_view name) const {
  auto it = where_.find(std::string(name));
  if (it == where_.end()) return std::nullopt;
  return files_[it->second.first]->tensor(it->second.second);
}

TensorView SafetensorsCheckpoint::get(std::string_view name) const {
  auto t = find(name);
  STRIDER_CHECK(t.has_value(), "{}: no tensor named '{}' ({} tensors in {} file(s))", label_,
                name, names_.size(), files_.size());
  return *t;
}

// ---- SafetensorsWriter ----------------------------------------------------

namespace {

// The header of one shard, padded with spaces to a multiple of 8 bytes (as the
// Python package does) so the data area starts 8-byte aligned.
std::string shard_header(const std::vector<const TensorSpec*>& specs,
                         const std::vector<uint64_t>& sizes,
                         const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    h[specs[i]->name] = {{"dtype", std::string(dtype_name(specs[i]->dtype))},
                         {"shape", specs[i]->shape},
                         {"data_offsets", {offset, offset + sizes[i]}}};
    offset += sizes[i];
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

}  // namespace

SafetensorsWriter::SafetensorsWriter(std::string dir, std::vector<TensorSpec> tensors,
                                     SafetensorsWriteOptions options)
    : dir_(std::move(dir)), options_(std::move(options)) {
  STRIDER_CHECK(fs::is_directory(dir_), "{}: output directory does not exist; create it first", dir_);
  STRIDER_CHECK(!options_.base_name.empty(), "SafetensorsWriter: base_name is empty");
  // Plan: greedy shards in caller order.
  size_t shard = 0;
  uint64_t shard_bytes = 0;
  for (auto& spec : tensors) {
    STRIDER_CHECK(!spec.name.empty() && spec.name != "__metadata__",
                  "{}: tensor name '{}' is reserved or empty", dir_, spec.name);
    auto size = byte_size(spec.dtype, spec.shape);
    STRIDER_CHECK(size.has_value(), "{}: tensor '{}': shape {} has a negative dim or {} bytes per "
                  "element overflows 64 bits", dir_, spec.name, shape_text(spec.shape),
                  dtype_size(spec.dtype));
    STRIDER_CHECK(by_name_.emplace(spec.name, tensors_.size()).second,
                  "{}: tensor '{}' given twice", dir_, spec.name);
    if (options_.max_shard_bytes > 0 && shard_bytes > 0 &&
        shard_bytes + *size > options_.max_shard_bytes) {
      ++shard;
      shard_bytes = 0;
    }
    tensors_.push_back(Planned{std::move(spec), *size, shard, 0, 0});
    shard_bytes += *size;
    total_bytes_ += *size;
  }
  size_t num_shards = tensors_.empty() ? 1 : shard + 1;
  for (size_t s = 0; s < num_shards; ++s)
    shard_names_.push_back(num_shards == 1
                               ? options_.base_name + ".safetensors"
                               : fmt::format("{}-{:05d}-of-{:05d}.safetensors", options_.base_name,
                                             s + 1, num_shards));

  // Write each shard's header now; data goes in place as it arrives.
  for (size_t s = 0; s < num_shards; ++s) {
    std::vector<const TensorSpec*> specs;
    std::vector<uint64_t> sizes;
    std::vector<size_t> members;
    for (size_t i = 0; i < tensors_.size(); ++i)
      if (tensors_[i].shard == s) {
        specs.push_back(&tensors_[i].spec);
        sizes.push_back(tensors_[i].size_bytes);
        members.push_back(i);
      }
    std::string header = shard_header(specs, sizes, options_.metadata);
    AtomicFile file((fs::path(dir_) / shard_names_[s]).string());
    std::byte len[8];
    store_le64(len, header.size());
    file.write(len);
    file.write(std::as_bytes(std::span(header)));
    uint64_t offset = file.size_bytes();
    for (size_t i : members) {
      tensors_[i].file_offset_bytes = offset;
      offset += tensors_[i].size_bytes;
    }
    file.reserve(offset);  // the full size now: a full disk fails here, not at the end
    shards_.push_back(std::move(file));
  }
}

void SafetensorsWriter::write(std::string_view name, std::span<const std::byte> bytes,
                              uint64_t offset_bytes) {
  auto it = by_name_.find(std::string(name));
  STRIDER_CHECK(it != by_name_.end(), "{}: write of tensor '{}', which was not declared", dir_, name);
  write(it->second, bytes, offset_bytes);
}

void SafetensorsWriter::write(size_t index, std::span<const std::byte> bytes, uint64_t offset_bytes) {
  STRIDER_CHECK(!finished_, "{}: write after finish()", dir_);
  STRIDER_CHECK(index < tensors_.size(), "{}: tensor index {} out of range ({} tensors)", dir_,
                index, tensors_.size());
  Planned& t = tensors_[index];
  STRIDER_CHECK(offset_bytes <= t.size_bytes && bytes.size() <= t.size_bytes - offset_bytes,
                "{}: tensor '{}' ({} {}) is {} bytes; a write of {} bytes at offset {} runs past "
                "it", dir_, t.spec.name, dtype_name(t.spec.dtype), shape_text(t.spec.shape),
                t.size_bytes, bytes.size(), offset_bytes);
  shards_[t.shard].pwrite(t.file_offset_bytes + offset_bytes, bytes);
  t.written_bytes += bytes.size();
}

void SafetensorsWriter::finish() {
  STRIDER_CHECK(!finished_, "{}: finish() called twice", dir_);
  for (const auto& t : tensors_)
    STRIDER_CHECK(t.written_bytes == t.size_bytes, "{}: tensor '{}' got {} of its {} bytes before "
                  "finish(); nothing was written", dir_, t.spec.name, t.written_bytes, t.size_bytes);
  // Everything durable under temp names first, then the renames, the index
  // last: whoever reads the index finds every shard it names complete.
  for (auto& s : shards_) s.sync();
  for (auto& s : shards_) s.commit();
  if (shards_.size() > 1) {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total_bytes_}};
    nlohmann::json weight_map = nlohmann::json::object();  // sorted, as transformers writes it
    for (const auto& t : tensors_) weight_map[t.spec.name] = shard_names_[t.shard];
    index["weight_map"] = weight_map;
    std::string text = index.dump(2) + "\n";
    write_file_atomic((fs::path(dir_) / (options_.base_name + ".safetensors.index.json")).string(),
                      std::as_bytes(std::span(text)));
  }
  finished_ = true;
}

std::vector<std::string> SafetensorsWriter::file_names() const {
  std::vector<std::string> names = shard_names_;
  if (shard_names_.size() > 1) names.push_back(options_.base_name + ".safetensors.index.json");
  return names;
}

void write_safetensors(const std::string& dir, std::span<const TensorData> tensors,
                       const SafetensorsWriteOptions& options) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& t : tensors) specs.push_back(TensorSpec{t.name, t.dtype, t.shape});
  SafetensorsWriter writer(dir, std::move(specs), options);
  for (size_t i = 0; i < tensors.size(); ++i) writer.write(i, tensors[i].bytes);
  writer.finish();
}

}  // namespace strider
