// Checksums of NVMe extents: XXH3-64 (libxxhash), fast enough (tens of GB/s per
// core) to run on every extent written and read without becoming the bottleneck.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace strider {

// XXH3-64 of `data`, seed 0. Stable across runs and machines (it is persisted).
uint64_t checksum64(std::span<const std::byte> data);
// checksum64 of a whole file's bytes, read in 4 MiB pieces; throws naming the file.
uint64_t file_checksum64(const std::string& path);

// The checksum NvmeStore persists per extent: XXH3-64 over the little-endian
// XXH3-64s of each kChecksumPieceBytes piece of `data` (the last one may be
// shorter). Pieces hash independently, so several threads can share one
// extent. The piece size is part of the format (the sidecar records it).
inline constexpr size_t kChecksumPieceBytes = size_t{1} << 20;
size_t checksum_piece_count(size_t bytes);  // ceil(bytes / kChecksumPieceBytes)
uint64_t combine_piece_checksums(std::span<const uint64_t> piece_hashes);
uint64_t extent_checksum64(std::span<const std::byte> data);  // one-shot reference

// The same checksum fed piece by piece, so an extent can be hashed chunk by
// chunk as its I/O completes instead of in one long pass at the end.
// digest() of pieces a, b equals checksum64(a ++ b).
class Checksum64Stream {
 public:
  Checksum64Stream();
  ~Checksum64Stream();
  Checksum64Stream(Checksum64Stream&&) noexcept;
  Checksum64Stream& operator=(Checksum64Stream&&) noexcept;
  void update(std::span<const std::byte> data);
  uint64_t digest() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace strider
