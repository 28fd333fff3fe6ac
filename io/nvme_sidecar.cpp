// NvmeStore's sidecar: the extent table and each extent's checksum, as JSON in
// "<first file>.strider-meta.json". Replaced atomically (write a temporary,
// fsync, rename, fsync the directory) so a crash leaves the old table or the
// new one, never a mix; data is fsynced before the table that vouches for it.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "host/error.h"
#include "io/checksum.h"
#include "io/nvme_request.h"
#include "io/nvme_store.h"

namespace strider {
namespace {

constexpr const char* kFormat = "strider-nvme-meta";
// Version 2: "xxh3" is extent_checksum64 (XXH3 of the per-piece XXH3s, pieces
// of "piece_bytes"). Version 1 held one XXH3 over the whole extent.
constexpr int kVersion = 2;

void write_all(int fd, const std::string& text, const std::string& path) {
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = n < 0 ? errno : EIO;
      throw Error(fmt::format("NvmeStore::sync: writing {} failed: {}", path, errno_text(err)));
    }
    done += static_cast<size_t>(n);
  }
}

}  // namespace

void NvmeStore::write_sidecar() {
  nlohmann::json j;
  j["format"] = kFormat;
  j["version"] = kVersion;
  j["piece_bytes"] = kChecksumPieceBytes;
  j["files"] = paths_;
  auto& list = j["extents"] = nlohmann::json::array();
  {
    std::lock_guard lock(meta_mutex_);
    for (const Extent& e : extents_) {
      const Slot& s = slots_[e.index];
      list.push_back({{"block", e.block},
                      {"kind", extent_kind_name(e.kind)},
                      {"bytes", e.bytes},
                      {"file", e.file},
                      {"offset", e.offset},
                      {"valid", s.state == Slot::kValid},
                      {"xxh3", fmt::format("{:016x}", s.checksum)}});
    }
  }
  const std::string path = sidecar_path();
  const std::string tmp = path + ".tmp";
  const std::string text = j.dump(1);
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    int err = errno;
    throw Error(fmt::format("NvmeStore::sync: cannot create {}: {}", tmp, errno_text(err)));
  }
  try {
    write_all(fd, text, tmp);
    if (fsync(fd) != 0) {
      int err = errno;
      throw Error(fmt::format("NvmeStore::sync: fsync of {} failed: {}", tmp, errno_text(err)));
    }
  } catch (...) {
    close(fd);
    unlink(tmp.c_str());
    throw;
  }
  close(fd);
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    unlink(tmp.c_str());
    throw Error(fmt::format("NvmeStore::sync: rename {} -> {} failed: {}", tmp, path,
                            errno_text(err)));
  }
  // The rename itself must survive a crash: fsync the directory.
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
}

void NvmeStore::load_sidecar() {
  const std::string path = sidecar_path();
  std::ifstream in(path);
  STRIDER_CHECK(in.good(), "NvmeStore: open_existing needs {}, which cannot be read; without "
                "it the files' checksums are unknown (sync() writes it)", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("NvmeStore: {} is not valid JSON ({}); it may be damaged", path,
                            e.what()));
  }
  try {
    STRIDER_CHECK(j.at("format") == kFormat, "NvmeStore: {} is not a {} file", path, kFormat);
    STRIDER_CHECK(j.at("version") != 1,
                  "NvmeStore: {} is a version 1 {} file, whose checksums (one XXH3 over each "
                  "whole extent) this version no longer reads; restore the state from a "
                  "checkpoint or rewrite it with a fresh store", path, kFormat);
    STRIDER_CHECK(j.at("version") == kVersion && j.at("piece_bytes") == kChecksumPieceBytes,
                  "NvmeStore: {} is version {} with checksum pieces of {} bytes; this store "
                  "reads version {} with pieces of {} bytes", path, j.at("version").dump(),
                  j.value("piece_bytes", nlohmann::json()).dump(), kVersion,
                  kChecksumPieceBytes);
    const auto& list = j.at("extents");
    STRIDER_CHECK(list.size() == extents_.size(),
                  "NvmeStore: {} lists {} extents, this store has {}; open_existing needs the "
                  "same extents in the same order", path, list.size(), extents_.size());
    for (const Extent& e : extents_) {
      const auto& x = list[e.index];
      const bool same = x.at("block").get<int64_t>() == e.block &&
                        x.at("kind").get<std::string>() == extent_kind_name(e.kind) &&
                        x.at("bytes").get<size_t>() == e.bytes &&
                        x.at("file").get<uint32_t>() == e.file &&
                        x.at("offset").get<uint64_t>() == e.offset;
      STRIDER_CHECK(same, "NvmeStore: {} extent #{} is {}, but this store lays out {}; "
                    "open_existing needs the same extents, files and order", path, e.index,
                    x.dump(), where(e));
      Slot& s = slots_[e.index];
      s.state = x.at("valid").get<bool>() ? Slot::kValid : Slot::kEmpty;
      s.checksum = std::stoull(x.at("xxh3").get<std::string>(), nullptr, 16);
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("NvmeStore: {} is missing a field or has a wrong type: {}", path,
                            e.what()));
  } catch (const std::logic_error& e) {  // std::stoull on a bad checksum
    throw Error(fmt::format("NvmeStore: {} has a malformed checksum: {}", path, e.what()));
  }
}

}  // namespace strider
