#include "io/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <fmt/format.h>

#include "host/error.h"

namespace strider {
namespace {

constexpr const char* kLockName = ".strider.lock";

// "pid <n> run <id>" as the holder wrote it, or "" when unreadable.
std::string read_holder(int fd) {
  char buf[256] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return "";
  std::string s(buf, size_t(n));
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0')) s.pop_back();
  return s;
}

int open_lock_file(const std::string& dir, const std::string& what, std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  STRIDER_CHECK(!ec, "{} {}: cannot create it: {}", what, dir, ec.message());
  STRIDER_CHECK(fs::is_directory(dir), "{} {} is not a directory", what, dir);
  path = (fs::path(dir) / kLockName).string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  STRIDER_CHECK(fd >= 0, "{} {}: cannot open the lock file {}: {}", what, dir, path, errno_text(errno));
  return fd;
}

}  // namespace

DirLock::DirLock(const std::string& dir, const std::string& what, const std::string& run_id) {
  fd_ = open_lock_file(dir, what, path_);
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string holder = read_holder(fd_);
    ::close(fd_);
    fd_ = -1;
    STRIDER_CHECK(err != EWOULDBLOCK, "{} {} is in use by another strider run ({}; lock file {}): give this run "
                  "its own directory, or wait for that one to end", what, dir,
                  holder.empty() ? "holder unknown" : holder, path_);
    throw Error(fmt::format("{} {}: flock on {} failed: {}", what, dir, path_, errno_text(err)));
  }
  const std::string text = fmt::format("pid {} run {}\n", ::getpid(), run_id.empty() ? "-" : run_id);
  // The content is for messages only: a failure to write it loses nothing.
  if (::ftruncate(fd_, 0) == 0) (void)!::pwrite(fd_, text.data(), text.size(), 0);
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

DirLock::DirLock(DirLock&& other) noexcept : path_(std::move(other.path_)), fd_(other.fd_) { other.fd_ = -1; }

void DirLock::check_held_by(const std::string& dir, const std::string& what, const std::string& run_id) {
  std::string path;
  const int fd = open_lock_file(dir, what, path);
  const bool free = ::flock(fd, LOCK_EX | LOCK_NB) == 0;  // if we got it, nobody holds it
  const std::string holder = read_holder(fd);
  ::close(fd);
  STRIDER_CHECK(!free, "{} {} is not locked by run {}: start the run's first process first", what, dir, run_id);
  const std::string want = "run " + run_id;
  STRIDER_CHECK(holder.size() >= want.size() && holder.compare(holder.size() - want.size(), want.size(), want) == 0,
                "{} {} is in use by another strider run ({}), not run {}", what, dir, holder, run_id);
}

}  // namespace strider
