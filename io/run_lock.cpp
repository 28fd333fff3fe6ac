#include "io/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <sys/stat.h>

#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <sstream>
#include <map>
#include <mutex>

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

// "pid <n>" of the process holding a flock on `fd`'s file, from /proc/locks
// (its inode), or "" when not found.
std::string flock_holder(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return "";
  std::ifstream locks("/proc/locks");
  std::string line;
  const std::string ino = fmt::format(":{}", static_cast<unsigned long long>(st.st_ino));
  while (std::getline(locks, line)) {
    // "1: FLOCK  ADVISORY  WRITE 12345 08:01:4567 0 EOF"
    std::istringstream in(line);
    std::string n, kind, advisory, mode, pid, dev;
    if (!(in >> n >> kind >> advisory >> mode >> pid >> dev) || kind != "FLOCK") continue;
    if (dev.size() > ino.size() && dev.compare(dev.size() - ino.size(), ino.size(), ino) == 0) return "pid " + pid;
  }
  return "";
}

// The locks this process holds, by directory, and what each is for: flock
// refuses a second lock from the same process too, and "another strider run"
// would then name this run's own pid.
std::mutex held_mu;
std::map<std::string, std::string>& held() {
  static std::map<std::string, std::string> m;
  return m;
}

}  // namespace

DirLock::DirLock(const std::string& dir, const std::string& what, const std::string& run_id, Mark mark) {
  namespace fs = std::filesystem;
  if (mark == Mark::kLockFile) {
    fd_ = open_lock_file(dir, what, path_);
  } else {  // the directory itself, opened for flock: nothing is written into it
    std::error_code ec;
    fs::create_directories(dir, ec);
    STRIDER_CHECK(!ec, "{} {}: cannot create it: {}", what, dir, ec.message());
    fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    STRIDER_CHECK(fd_ >= 0, "{} {}: cannot open it: {}", what, dir, errno_text(errno));
    path_ = dir;
  }
  dir_ = fs::weakly_canonical(dir).string();
  {
    std::lock_guard lk(held_mu);
    if (const auto it = held().find(dir_); it != held().end()) {
      ::close(fd_);
      fd_ = -1;
      if (it->second == what)  // two engines of one process (strider.Engine from Python) on one directory
        throw Error(fmt::format("{} {} is in use by another engine of this process (pid {}), as its {}: give each "
                                "engine its own directory",
                                what, dir, ::getpid(), it->second));
      throw Error(fmt::format("{} {} is also this run's {}: give each its own directory", what, dir, it->second));
    }
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string holder = mark == Mark::kLockFile ? read_holder(fd_) : flock_holder(fd_);
    ::close(fd_);
    fd_ = -1;
    STRIDER_CHECK(err != EWOULDBLOCK, "{} {} is in use by another strider run ({}{}): give this run its own "
                  "directory, or wait for that one to end", what, dir, holder.empty() ? "holder unknown" : holder,
                  mark == Mark::kLockFile ? "; lock file " + path_ : std::string());
    throw Error(fmt::format("{} {}: flock on {} failed: {}", what, dir, path_, errno_text(err)));
  }
  {
    std::lock_guard lk(held_mu);
    held()[dir_] = what;
  }
  if (mark == Mark::kDirectory) return;
  const std::string text = fmt::format("pid {} run {}\n", ::getpid(), run_id.empty() ? "-" : run_id);
  // The content is for messages only: a failure to write it loses nothing.
  if (::ftruncate(fd_, 0) == 0) (void)!::pwrite(fd_, text.data(), text.size(), 0);
}

DirLock::~DirLock() {
  if (fd_ < 0) return;
  {
    std::lock_guard lk(held_mu);
    held().erase(dir_);
  }
  ::close(fd_);  // releases the flock
}

DirLock::DirLock(DirLock&& other) noexcept
    : path_(std::move(other.path_)), dir_(std::move(other.dir_)), fd_(other.fd_) {
  other.fd_ = -1;
}

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
