#include "io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <utility>

#include "host/error.h"

namespace strider {

void check_regular_input(const std::string& path, std::string_view what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return;
  STRIDER_CHECK(S_ISREG(st.st_mode), "{}: not a regular file ({}); {}", path,
                S_ISFIFO(st.st_mode) ? "a FIFO" : S_ISDIR(st.st_mode) ? "a directory" : "a device or socket", what);
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  // O_NONBLOCK: a FIFO opens at once and is refused below, instead of blocking until a writer appears
  // (a mapping of a regular file ignores the flag).
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  STRIDER_CHECK(fd >= 0, "{}: cannot open for reading: {}; check the path and permissions",
                path, errno_text(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw Error(fmt::format("{}: fstat failed: {}", path, errno_text(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(fmt::format("{}: not a regular file; pass a file (or a checkpoint directory "
                            "where a directory is accepted)", path));
  }
  size_bytes_ = static_cast<size_t>(st.st_size);
  if (size_bytes_ > 0) {
    void* p = ::mmap(nullptr, size_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    ::close(fd);  // the mapping keeps the file alive
    STRIDER_CHECK(p != MAP_FAILED, "{}: mmap of {} bytes failed: {}", path, size_bytes_,
                  errno_text(err));
    data_ = static_cast<const std::byte*>(p);
  } else {
    ::close(fd);
  }
}

MappedFile::~MappedFile() { release(); }

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

bool MappedFile::release_pages(std::span<const std::byte> range) const noexcept {
  if (range.empty() || data_ == nullptr || range.data() < data_ ||
      range.data() + range.size() > data_ + size_bytes_)
    return false;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(range.data()) / page * page;
  const auto end = (reinterpret_cast<uintptr_t>(range.data() + range.size()) + page - 1) / page * page;
  return ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED) == 0;
}

void MappedFile::release() noexcept {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_bytes_);
  data_ = nullptr;
  size_bytes_ = 0;
}

}  // namespace strider
