#include "io/atomic_file.h"

#include <fcntl.h>  // open, fallocate
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <utility>

#include "host/error.h"

namespace strider {
namespace {

std::string parent_dir(const std::string& path) {
  auto parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

}  // namespace

AtomicFile::AtomicFile(std::string final_path) : final_path_(std::move(final_path)) {
  std::filesystem::path p(final_path_);
  STRIDER_CHECK(!p.filename().empty(), "AtomicFile: '{}' names no file", final_path_);
  // The rename replaces whatever has the name: only ever a regular file (or
  // nothing), never a device, a pipe, a socket or a directory.
  struct stat st {};
  STRIDER_CHECK(::lstat(final_path_.c_str(), &st) != 0 || S_ISREG(st.st_mode) || S_ISLNK(st.st_mode),
                "{} exists and is not a regular file (a device, a directory or a pipe); refusing to replace it: "
                "name a file", final_path_);
  std::string templ = (std::filesystem::path(parent_dir(final_path_)) /
                       fmt::format(".{}.tmp-XXXXXX", p.filename().string())).string();
  int fd = ::mkstemp(templ.data());
  STRIDER_CHECK(fd >= 0, "{}: cannot create a temp file '{}' next to it: {}; check that the "
                "directory exists and is writable", final_path_, templ, errno_text(errno));
  fd_ = fd;
  temp_path_ = std::move(templ);
  // mkstemp gives 0600; a checkpoint should be as readable as any file we create.
  mode_t mask = ::umask(0);
  ::umask(mask);
  ::fchmod(fd_, 0666 & ~mask);
}

AtomicFile::AtomicFile(AtomicFile&& other) noexcept
    : final_path_(std::move(other.final_path_)),
      temp_path_(std::move(other.temp_path_)),
      fd_(std::exchange(other.fd_, -1)),
      append_offset_(other.append_offset_),
      committed_(std::exchange(other.committed_, true)) {}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_path_.empty()) ::unlink(temp_path_.c_str());
}

void AtomicFile::pwrite(uint64_t offset_bytes, std::span<const std::byte> bytes) {
  STRIDER_CHECK(fd_ >= 0, "{}: write after sync/commit", final_path_);
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::pwrite(fd_, bytes.data() + done, bytes.size() - done,
                         static_cast<off_t>(offset_bytes + done));
    if (n < 0 && errno == EINTR) continue;
    STRIDER_CHECK(n > 0, "{}: write of {} bytes at offset {} failed: {}; check free disk space",
                  temp_path_, bytes.size() - done, offset_bytes + done,
                  n < 0 ? errno_text(errno) : std::string("wrote 0 bytes"));
    done += static_cast<size_t>(n);
  }
}

void AtomicFile::write(std::span<const std::byte> bytes) {
  pwrite(append_offset_, bytes);
  append_offset_ += bytes.size();
}

void AtomicFile::truncate(uint64_t size_bytes) {
  STRIDER_CHECK(fd_ >= 0, "{}: truncate after sync/commit", final_path_);
  STRIDER_CHECK(::ftruncate(fd_, static_cast<off_t>(size_bytes)) == 0,
                "{}: ftruncate to {} bytes failed: {}", temp_path_, size_bytes, errno_text(errno));
  if (append_offset_ < size_bytes) append_offset_ = size_bytes;
}

void AtomicFile::reserve(uint64_t size_bytes) {
  STRIDER_CHECK(fd_ >= 0, "{}: reserve after sync/commit", final_path_);
  if (size_bytes > 0 && ::fallocate(fd_, 0, 0, static_cast<off_t>(size_bytes)) != 0) {
    int err = errno;
    STRIDER_CHECK(err == EOPNOTSUPP || err == ENOSYS, "{}: cannot reserve {} bytes: {}; free "
                  "disk space or write elsewhere", temp_path_, size_bytes, errno_text(err));
  }
  truncate(size_bytes);
}

void AtomicFile::sync() {
  if (fd_ < 0) return;
  STRIDER_CHECK(::fsync(fd_) == 0, "{}: fsync failed: {}; the data may not be on disk",
                temp_path_, errno_text(errno));
  int fd = std::exchange(fd_, -1);
  STRIDER_CHECK(::close(fd) == 0, "{}: close failed: {}", temp_path_, errno_text(errno));
}

void AtomicFile::commit() {
  STRIDER_CHECK(!committed_, "{}: committed twice", final_path_);
  sync();
  STRIDER_CHECK(::rename(temp_path_.c_str(), final_path_.c_str()) == 0,
                "{}: rename from '{}' failed: {}", final_path_, temp_path_, errno_text(errno));
  committed_ = true;
  fsync_directory(parent_dir(final_path_));
}

void fsync_directory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  STRIDER_CHECK(fd >= 0, "{}: cannot open directory to fsync it: {}", dir, errno_text(errno));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  STRIDER_CHECK(rc == 0, "{}: directory fsync failed: {}", dir, errno_text(err));
}

void write_file_atomic(const std::string& path, std::span<const std::byte> bytes) {
  AtomicFile f(path);
  f.write(bytes);
  f.commit();
}

}  // namespace strider
