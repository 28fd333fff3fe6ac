// AtomicFile: write a file so that its final name holds either the old content
// or the complete new content, never a half-written file, even if the process
// or the machine dies mid-write.
//
// The recipe: write a temp file in the same directory (same file system, so
// rename is atomic), fsync it, rename it over the final name, fsync the
// directory so the rename itself is durable. An AtomicFile destroyed before
// commit() removes its temp file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace strider {

class AtomicFile {
 public:
  // Creates "<dir>/.<name>.tmp-XXXXXX" next to `final_path`. Throws Error.
  explicit AtomicFile(std::string final_path);
  ~AtomicFile();  // unlinks the temp file unless committed; never throws
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  AtomicFile(AtomicFile&& other) noexcept;
  AtomicFile& operator=(AtomicFile&& other) = delete;

  // Appends at the current end; short writes and EINTR are retried.
  void write(std::span<const std::byte> bytes);
  // Writes at `offset_bytes` without moving the append position.
  void pwrite(uint64_t offset_bytes, std::span<const std::byte> bytes);
  // Sets the size (zero-filled when growing); lets a writer reserve a header.
  void truncate(uint64_t size_bytes);
  // Sets the size and allocates the blocks (fallocate), so a full disk fails
  // now, before any data is written; file systems without fallocate get a
  // plain truncate.
  void reserve(uint64_t size_bytes);
  // fsync + close of the temp file. Idempotent. Lets a caller make several
  // files durable before publishing any of them.
  void sync();
  // sync(), rename over the final name, fsync the directory.
  void commit();

  const std::string& final_path() const { return final_path_; }
  const std::string& temp_path() const { return temp_path_; }
  uint64_t size_bytes() const { return append_offset_; }

 private:
  std::string final_path_;
  std::string temp_path_;
  int fd_ = -1;
  uint64_t append_offset_ = 0;
  bool committed_ = false;
};

// fsync of a directory, so that a rename or create in it survives a crash.
void fsync_directory(const std::string& dir);

// The whole recipe for one small file held in memory (an index, a config).
void write_file_atomic(const std::string& path, std::span<const std::byte> bytes);

}  // namespace strider
