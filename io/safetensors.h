// safetensors: read (zero-copy, by mmap) and write (streaming, atomic) the
// Hugging Face checkpoint format, one file or sharded with an index.
//
// The format: an 8-byte little-endian header length N, N bytes of JSON
//   {"__metadata__": {"k": "v"}, "name": {"dtype": "BF16", "shape": [2, 3],
//    "data_offsets": [begin, end]}, ...}
// then the data area; offsets are relative to its start (byte 8 + N). Like
// the reference implementation (Rust crate) we require the tensors to cover
// the data area exactly: no gaps, no overlaps, nothing after the last one.
// Tensor data is not necessarily aligned to its element size (offsets are
// bytes); read elements with memcpy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "host/dtype.h"
#include "io/atomic_file.h"
#include "io/mapped_file.h"

namespace strider {

// Larger headers are refused (the Rust crate's limit): a lying length must
// not make us parse gigabytes of JSON.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// One tensor's entry in a header. Offsets are relative to the data area.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t begin_bytes = 0;
  uint64_t end_bytes = 0;
  uint64_t size_bytes() const { return end_bytes - begin_bytes; }
};

// A validated header. `entries` are in data order (ascending offsets).
struct SafetensorsHeader {
  uint64_t header_bytes = 0;       // N, the JSON length
  uint64_t data_offset_bytes = 0;  // 8 + N
  uint64_t data_bytes = 0;         // file size - 8 - N
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, std::string> metadata;
};

// Parses and validates a whole file image (only the header is read; the data
// area's size is checked against the offsets). `label` names the file in
// errors. Throws Error naming the file, tensor, field and limit. Pure: this is
// the fuzzing entry point.
SafetensorsHeader parse_safetensors_header(std::span<const std::byte> file,
                                           std::string_view label);

// A tensor inside a mapped file: valid while its SafetensorsFile lives.
struct TensorView {
  std::string_view name;
  DType dtype = DType::kU8;
  std::span<const int64_t> shape;
  std::span<const std::byte> bytes;
  std::string_view file;  // the path it came from, for error messages
  uint64_t numel() const;
};

// One mapped, validated .safetensors file.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  // Views and the name index point into this object: it stays where it is.
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return map_.path(); }
  const SafetensorsHeader& header() const { return header_; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  size_t size() const { return header_.entries.size(); }
  TensorView tensor(size_t i) const;  // in data order
  std::optional<TensorView> find(std::string_view name) const;
  TensorView get(std::string_view name) const;  // throws Error naming the file
  // Drops the pages a read of `view` made resident (MappedFile::release_pages);
  // false if the view is not from this file.
  bool release_pages(const TensorView& view) const noexcept { return map_.release_pages(view.bytes); }

 private:
  MappedFile map_;
  SafetensorsHeader header_;
  std::unordered_map<std::string_view, size_t> by_name_;  // keys point into header_
};

// A checkpoint: one file, or shards listed by a model.safetensors.index.json.
// Every shard is mapped and validated on open; lookups go by name across them.
class SafetensorsCheckpoint {
 public:
  // `path`: a .safetensors file, an *.index.json, or a directory holding
  // model.safetensors.index.json (preferred) or model.safetensors.
  explicit SafetensorsCheckpoint(const std::string& path);

  size_t size() const { return names_.size(); }
  // Names in file order (shard by shard, data order within each).
  const std::vector<std::string>& names() const { return names_; }
  std::optional<TensorView> find(std::string_view name) const;
  TensorView get(std::string_view name) const;  // throws Error naming the checkpoint
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  // Drops the pages a read of `view` made resident, in whichever file holds it.
  void release_pages(const TensorView& view) const noexcept {
    for (const auto& f : files_)
      if (f->release_pages(view)) return;
  }
  // The index's "metadata" object (total_size ...) as JSON text; "" without index.
  const std::string& index_metadata_json() const { return index_metadata_json_; }

 private:
  std::string label_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, std::pair<size_t, size_t>> where_;  // file, entry
  std::string index_metadata_json_;
};

// What the writer needs to know about a tensor before any byte is written
// (the header comes first in the file and holds every offset).
struct TensorSpec {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
};

struct SafetensorsWriteOptions {
  // 0: everything in "<base>.safetensors". Otherwise tensors go, in the given
  // order, into shards "<base>-00001-of-0000K.safetensors" of at most this
  // many data bytes each (a larger tensor gets a shard of its own), plus
  // "<base>.safetensors.index.json". A plan that yields one shard is written
  // as a single file without index, as transformers does.
  uint64_t max_shard_bytes = 0;
  std::string base_name = "model";
  // __metadata__ of every file ({"format": "pt"} is what transformers writes).
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
};

// Streaming writer. Construct with every tensor's spec in the order wanted;
// then write each tensor's bytes (in any order, in one or several chunks);
// finish() makes every file durable, then renames them into place, the index
// last. Until finish() returns nothing exists under the final names; a writer
// destroyed before finish() leaves nothing behind.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string dir, std::vector<TensorSpec> tensors,
                    SafetensorsWriteOptions options = {});

  // Writes `bytes` at `offset_bytes` inside tensor `name`. Chunks of one
  // tensor must not overlap; together they must cover it exactly.
  void write(std::string_view name, std::span<const std::byte> bytes, uint64_t offset_bytes = 0);
  void write(size_t index, std::span<const std::byte> bytes, uint64_t offset_bytes = 0);
  void finish();

  // Final file names (relative to dir), data files first, index last if any.
  std::vector<std::string> file_names() const;

 private:
  struct Planned {
    TensorSpec spec;
    uint64_t size_bytes = 0;
    size_t shard = 0;
    uint64_t file_offset_bytes = 0;  // absolute, in its shard
    uint64_t written_bytes = 0;
  };
  std::string dir_;
  SafetensorsWriteOptions options_;
  std::vector<Planned> tensors_;
  std::unordered_map<std::string, size_t> by_name_;
  std::vector<std::string> shard_names_;
  std::vector<AtomicFile> shards_;
  uint64_t total_bytes_ = 0;
  bool finished_ = false;
};

// A tensor given by pointer, for the one-call writer.
struct TensorData {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;
};

// Writes all `tensors` in order into `dir` (see SafetensorsWriteOptions).
void write_safetensors(const std::string& dir, std::span<const TensorData> tensors,
                       const SafetensorsWriteOptions& options = {});

}  // namespace strider
