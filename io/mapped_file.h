// MappedFile: a whole file mapped read-only, the zero-copy base of the
// safetensors reader. (Token files are read with pread instead: a run reads
// them for hours, and a mapped file truncated meanwhile SIGBUSes its reader.)
//
// Views handed out by the readers are pointers into this mapping, so the
// MappedFile must outlive them (the readers own theirs and say so).
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

namespace strider {

// Refuses, naming `path` and what it should be (`what`: "a model config is a
// JSON file"), anything there but a regular file, without opening it: an
// input that is a FIFO would block open() until a writer came. A missing path
// passes (the open that follows says so).
void check_regular_input(const std::string& path, std::string_view what);

class MappedFile {
 public:
  MappedFile() = default;
  // Opens and maps `path` read-only (MAP_PRIVATE). An empty file maps to an
  // empty span. Throws Error naming the path on any failure.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;

  std::span<const std::byte> bytes() const { return {data_, size_bytes_}; }
  // Gives back the resident pages under `range` (a part of bytes()): a read
  // touches file pages into this process's RSS, where they stay until unmapped;
  // this drops them (madvise MADV_DONTNEED; the page cache keeps the data, and
  // a later read maps it again, unchanged: nothing was written). Whole pages,
  // widened outward. Returns false if `range` is not inside the mapping.
  bool release_pages(std::span<const std::byte> range) const noexcept;
  size_t size_bytes() const { return size_bytes_; }
  const std::string& path() const { return path_; }

 private:
  void release() noexcept;

  std::string path_;
  const std::byte* data_ = nullptr;
  size_t size_bytes_ = 0;
};

}  // namespace strider
