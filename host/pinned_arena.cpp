#include "host/pinned_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "host/error.h"

namespace strider {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

std::string memlock_limit_text() {
  rlimit lim{};
  if (getrlimit(RLIMIT_MEMLOCK, &lim) != 0) return "unknown";
  if (lim.rlim_cur == RLIM_INFINITY) return "unlimited";
  return fmt::format("{} KiB", lim.rlim_cur / 1024);
}

}  // namespace

PinnedArena::PinnedArena(size_t capacity_bytes, ArenaOptions options)
    : name_(std::move(options.name)) {
  STRIDER_CHECK(capacity_bytes > 0, "{}: capacity must be > 0 bytes", name_);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const bool shared = !options.shared_file.empty();
  if (shared) {
    options.huge_pages = false;
    options.reserve_only = false;
  }
  page_ = page;
  capacity_ = round_up(capacity_bytes, options.huge_pages ? kHugePage : page);
  back_ = capacity_;
  if (shared) {
    map_shared(options.shared_file);
  } else {
    map_private(options);
  }
  if (options.reserve_only) return;
  if (options.lock != LockPolicy::kNone) {
    // mlock also faults every page in, so a locked arena is prefaulted.
    if (mlock(base_, capacity_) == 0) {
      locked_ = true;
    } else if (options.lock == LockPolicy::kRequire) {
      int err = errno;
      munmap(base_, capacity_);
      base_ = nullptr;
      throw Error(fmt::format(
          "{}: mlock of {} bytes ({:.2f} GiB) refused: {}; the memlock limit (ulimit -l) "
          "is {}. Raise it (e.g. 'ulimit -l unlimited' or limits.conf memlock), or run "
          "with the lock policy 'prefer'.",
          name_, capacity_, capacity_ / double(1ull << 30), errno_text(err),
          memlock_limit_text()));
    }
  }
  if (!locked_ && options.prefault) {
    // Touch one byte per page so page faults happen here, not inside a step
    // (a shared mapping by reading: other processes' bytes stay).
    const size_t stride = huge_ ? kHugePage : page;
    for (size_t off = 0; off < capacity_; off += stride) {
      auto* at = reinterpret_cast<volatile std::byte*>(base_) + off;
      if (shared) (void)*at;
      else *at = std::byte{0};
    }
  }
}

void PinnedArena::map_shared(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  STRIDER_CHECK(fd >= 0, "{}: cannot open the shared memory file {}: {}", name_, path, errno_text(errno));
  struct stat st {};
  const bool ok_stat = ::fstat(fd, &st) == 0;
  const int stat_err = errno;
  if (!ok_stat || (st.st_size != 0 && size_t(st.st_size) != capacity_)) {
    ::close(fd);
    throw Error(ok_stat ? fmt::format("{}: the shared memory file {} holds {} bytes, not the {} this run maps: "
                                      "another run's; remove it, or give this run another",
                                      name_, path, st.st_size, capacity_)
                        : fmt::format("{}: cannot stat {}: {}", name_, path, errno_text(stat_err)));
  }
  // Backing store now: a tmpfs that is too small refuses here.
  if (const int err = ::posix_fallocate(fd, 0, off_t(capacity_)); err != 0) {
    ::close(fd);
    throw Error(fmt::format("{}: cannot give the shared memory file {} {} bytes ({:.2f} GiB): {}; its file "
                            "system (df {}) is too small: enlarge it (a tmpfs: mount -o remount,size=...)",
                            name_, path, capacity_, capacity_ / double(1ull << 30), errno_text(err), path));
  }
  void* p = mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file
  STRIDER_CHECK(p != MAP_FAILED, "{}: cannot map the shared memory file {} ({} bytes): {}", name_, path, capacity_,
                errno_text(err));
  base_ = static_cast<std::byte*>(p);
}

void PinnedArena::map_private(const ArenaOptions& options) {

  // MAP_NORESERVE is deliberately absent: we want the OS to refuse now, with a
  // message, rather than kill the process with SIGBUS/OOM halfway through a step.
  const int flags = MAP_PRIVATE | MAP_ANONYMOUS | (options.reserve_only ? MAP_NORESERVE : 0);
  void* p = mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    throw Error(fmt::format(
        "{}: cannot map {} bytes ({:.2f} GiB) of host memory: {}. Lower the host RAM "
        "limit or move optimizer state to NVMe.",
        name_, capacity_, capacity_ / double(1ull << 30), errno_text(err)));
  }
  base_ = static_cast<std::byte*>(p);

  // Huge pages cut TLB misses in the optimizer's streaming passes; the kernel
  // may decline (THP "never"), which is fine.
  if (options.huge_pages) huge_ = madvise(base_, capacity_, MADV_HUGEPAGE) == 0;
}

PinnedArena::~PinnedArena() {
  for (auto it = registrars_.rbegin(); it != registrars_.rend(); ++it)
    it->registrar->unregister_memory(base_, it->bytes);
  if (base_ != nullptr) {
    if (locked_) munlock(base_, capacity_);
    munmap(base_, capacity_);
  }
}

std::span<std::byte> PinnedArena::carve(size_t bytes, size_t align, std::string_view what, ArenaUse use) {
  STRIDER_CHECK(align != 0 && (align & (align - 1)) == 0,
                "{}: alignment {} for '{}' is not a power of two", name_, align, what);
  const auto refuse = [&] {
    return Error(fmt::format(
        "{}: cannot carve {} bytes for '{}': {} of {} bytes are used, {} free. "
        "The arena is sized at start-up; size it with ParamStore::bytes_needed.",
        name_, bytes, what, used_bytes(), capacity_, free_bytes()));
  };
  if (use == ArenaUse::kHostOnly) {
    if (bytes > back_ - front_) throw refuse();
    const size_t start = (back_ - bytes) / align * align;
    if (start < front_) throw refuse();
    back_ = start;
    return {base_ + start, bytes};
  }
  STRIDER_CHECK(!copied_registered_,
                "{}: '{}' is carved for copies after the copied part was registered; carve every copied buffer "
                "before attaching a registrar to it", name_, what);
  const size_t start = round_up(front_, align);
  if (start > back_ || bytes > back_ - start) throw refuse();
  front_ = start + bytes;
  return {base_ + start, bytes};
}

void PinnedArena::attach(std::shared_ptr<MemoryRegistrar> r, ArenaPart part) {
  STRIDER_CHECK(r != nullptr, "{}: attach(nullptr)", name_);
  const size_t bytes = part == ArenaPart::kWhole ? capacity_ : std::min(round_up(front_, page_), capacity_);
  if (part == ArenaPart::kCopied) copied_registered_ = true;
  if (bytes == 0) return;  // nothing is copied: nothing to register
  try {
    r->register_memory(base_, bytes);  // throws before we keep it
  } catch (const Error& e) {
    throw Error(fmt::format(
        "{}: {} refused {} bytes ({:.2f} GiB) of host memory: {}. The memlock limit (ulimit -l) is {}; raise it "
        "('ulimit -l unlimited', or memlock in /etc/security/limits.conf; in a container, its memlock ulimit), "
        "or lower the host memory the run pins (a smaller batch or sequence, no host checkpoints, fewer kept "
        "activations)",
        name_, r->name(), bytes, bytes / double(1ull << 30), e.what(), memlock_limit_text()));
  }
  registrars_.push_back({std::move(r), bytes});
}

bool PinnedArena::contains(const void* p, size_t bytes) const {
  auto* b = static_cast<const std::byte*>(p);
  return b >= base_ && bytes <= capacity_ && b - base_ <= static_cast<ptrdiff_t>(capacity_ - bytes);
}

}  // namespace strider
