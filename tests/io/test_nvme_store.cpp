// NvmeStore against real files, real io_uring and the real pread/pwrite pool.
// Faults the kernel will not produce on demand (short transfers, EAGAIN, EIO)
// come from the store's fault hook, which rewrites a real completion's result;
// ENOSPC comes from a real, full tmpfs when this process may mount one.
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <thread>

#include "host/error.h"
#include "host/pinned_arena.h"
#include "io/checksum.h"
#include "io/nvme_store.h"

using namespace strider;
namespace fs = std::filesystem;

namespace {

// A fresh directory under the build's temp area, removed at the end.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "strider-nvme-XXXXXX").string();
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// An aligned, zeroed buffer, like a carve from the pinned arena.
struct AlignedBuf {
  std::byte* p = nullptr;
  size_t n = 0;
  explicit AlignedBuf(size_t bytes) : n(bytes) {
    REQUIRE(posix_memalign(reinterpret_cast<void**>(&p), kNvmeAlign, bytes) == 0);
    std::memset(p, 0, bytes);
  }
  ~AlignedBuf() { free(p); }
  AlignedBuf(const AlignedBuf&) = delete;
  std::span<std::byte> span() { return {p, n}; }
};

void fill(std::span<std::byte> s, uint32_t seed) {
  std::mt19937 rng(seed);
  for (auto& b : s) b = static_cast<std::byte>(rng());
}

bool same(std::span<const std::byte> a, std::span<const std::byte> b, size_t n) {
  return std::memcmp(a.data(), b.data(), n) == 0;
}

NvmeStoreOptions options_for(NvmeBackend backend) {
  NvmeStoreOptions o;
  o.backend = backend;
  o.chunk_bytes = 64 << 10;  // several chunks per extent even in small tests
  o.queue_depth = 8;
  return o;
}

// Odd sizes: smaller than a chunk, not a multiple of 4 KiB, several chunks.
std::vector<ExtentSpec> three_blocks() {
  std::vector<ExtentSpec> v;
  const size_t sizes[] = {4096, 100'003, 300'000};
  for (int64_t b = 0; b < 3; ++b)
    for (auto k : {ExtentKind::kMaster, ExtentKind::kAdamM, ExtentKind::kAdamV})
      v.push_back({b, k, sizes[b]});
  return v;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

const char* backend_name(NvmeBackend b) { return b == NvmeBackend::kUring ? "io_uring" : "posix"; }

}  // namespace

TEST_CASE("io_uring is available in this environment", "[nvme]") {
  TempDir dir;
  NvmeStore store({dir.file("a")}, {{0, ExtentKind::kMaster, 4096}});
  INFO(store.backend_description());
  // Not a requirement of the store (kAuto falls back), but every other io_uring
  // case below would silently test the fallback twice if this changed.
  CHECK(store.using_uring());
}

TEST_CASE("extents are laid out aligned and spread over the files", "[nvme]") {
  TempDir dir;
  NvmeStore store({dir.file("a"), dir.file("b")}, three_blocks(), options_for(NvmeBackend::kPosix));
  const Extent& m = store.extent(0, ExtentKind::kMaster);
  const Extent& am = store.extent(0, ExtentKind::kAdamM);
  CHECK(m.file != am.file);  // a block's state comes from two drives
  for (const Extent& e : store.extents()) {
    CHECK(e.offset % kNvmeAlign == 0);
    CHECK(e.io_bytes % kNvmeAlign == 0);
    CHECK(e.io_bytes >= e.bytes);
    CHECK(e.io_bytes - e.bytes < kNvmeAlign);
  }
  CHECK_THROWS_WITH(store.extent(7, ExtentKind::kAdamV), Catch::Contains("no extent adam_v for block 7"));
  CHECK_THROWS_WITH(NvmeStore({dir.file("c")}, {{1, ExtentKind::kMaster, 10}, {1, ExtentKind::kMaster, 20}}),
                    Catch::Contains("listed twice"));
}

TEST_CASE("write then read round-trips every extent, many tickets at once", "[nvme]") {
  const NvmeBackend backend = GENERATE(NvmeBackend::kUring, NvmeBackend::kPosix);
  INFO(backend_name(backend));
  TempDir dir;
  NvmeStore store({dir.file("a"), dir.file("b")}, three_blocks(), options_for(backend));
  CHECK(store.using_uring() == (backend == NvmeBackend::kUring));
  std::vector<std::unique_ptr<AlignedBuf>> src, dst;
  std::vector<NvmeTicket> tickets;
  for (const Extent& e : store.extents()) {
    src.push_back(std::make_unique<AlignedBuf>(e.io_bytes));
    dst.push_back(std::make_unique<AlignedBuf>(e.io_bytes));
    fill(src.back()->span(), e.index + 1);
    tickets.push_back(store.write(e, src.back()->span()));
  }
  for (auto& t : tickets) store.wait(t);
  for (auto& t : tickets) CHECK(store.ready(t));
  tickets.clear();
  for (const Extent& e : store.extents()) tickets.push_back(store.read(e, dst[e.index]->span()));
  for (auto& t : tickets) store.wait(t);
  for (const Extent& e : store.extents())
    CHECK(same(src[e.index]->span(), dst[e.index]->span(), e.bytes));
}

TEST_CASE("submission from several threads, callbacks chain read -> write", "[nvme]") {
  const NvmeBackend backend = GENERATE(NvmeBackend::kUring, NvmeBackend::kPosix);
  INFO(backend_name(backend));
  TempDir dir;
  std::vector<ExtentSpec> specs;
  for (int64_t b = 0; b < 16; ++b) specs.push_back({b, ExtentKind::kMaster, 200'000});
  NvmeStore store({dir.file("a")}, specs, options_for(backend));
  const size_t io = store.extents()[0].io_bytes;
  std::vector<std::unique_ptr<AlignedBuf>> bufs;
  for (size_t i = 0; i < specs.size(); ++i) bufs.push_back(std::make_unique<AlignedBuf>(io));

  // Four threads write four blocks each.
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<NvmeTicket> mine;
      for (int64_t b = t * 4; b < t * 4 + 4; ++b) {
        fill(bufs[b]->span(), static_cast<uint32_t>(b) + 100);
        mine.push_back(store.write(store.extent(b, ExtentKind::kMaster), bufs[b]->span()));
      }
      for (auto& m : mine) store.wait(m);
    });
  }
  for (auto& th : threads) th.join();

  // Read each block back; its callback (completion thread) verifies, bumps
  // the data and starts the write-back, as the engine's read -> AdamW -> write.
  std::atomic<int> written{0}, read_ok{0};
  std::vector<NvmeTicket> reads;
  for (int64_t b = 0; b < 16; ++b) {
    std::memset(bufs[b]->p, 0, io);
    const Extent& e = store.extent(b, ExtentKind::kMaster);
    reads.push_back(store.read(e, bufs[b]->span(), [&, b, &e = e](std::exception_ptr err) {
      if (err) return;
      AlignedBuf expect(io);
      fill(expect.span(), static_cast<uint32_t>(b) + 100);
      if (same(expect.span(), bufs[b]->span(), e.bytes)) ++read_ok;
      bufs[b]->p[0] = std::byte{0x5a};
      store.write(e, bufs[b]->span(), [&](std::exception_ptr werr) {
        if (!werr) ++written;
      });
    }));
  }
  for (auto& r : reads) store.wait(r);
  CHECK(read_ok == 16);
  // The chained writes finish on their own; the store drains them at destruction.
  while (written < 16) std::this_thread::yield();
  AlignedBuf back(io);
  store.wait(store.read(store.extent(5, ExtentKind::kMaster), back.span()));
  CHECK(back.p[0] == std::byte{0x5a});
}

TEST_CASE("unaligned or wrong-sized buffers are rejected before any I/O", "[nvme]") {
  TempDir dir;
  NvmeStore store({dir.file("a")}, {{0, ExtentKind::kMaster, 10'000}});
  const Extent& e = store.extent(0, ExtentKind::kMaster);
  REQUIRE(e.io_bytes == 12'288);
  AlignedBuf buf(e.io_bytes + kNvmeAlign);
  CHECK_THROWS_WITH(store.write(e, {buf.p + 512, e.io_bytes}),
                    Catch::Contains("4096-byte aligned") && Catch::Contains("exactly 12288 bytes"));
  CHECK_THROWS_WITH(store.write(e, {buf.p, e.bytes}), Catch::Contains("exactly 12288 bytes"));
  CHECK_THROWS_WITH(store.read(e, buf.span()), Catch::Contains("exactly 12288 bytes"));
  // Nothing was written, so there is nothing valid to read.
  CHECK_THROWS_WITH(store.read(e, {buf.p, e.io_bytes}), Catch::Contains("never written"));
}

TEST_CASE("a byte corrupted behind the store's back is reported on read", "[nvme]") {
  const NvmeBackend backend = GENERATE(NvmeBackend::kUring, NvmeBackend::kPosix);
  INFO(backend_name(backend));
  TempDir dir;
  NvmeStore store({dir.file("a"), dir.file("b")}, three_blocks(), options_for(backend));
  const Extent& e = store.extent(2, ExtentKind::kAdamV);
  AlignedBuf buf(e.io_bytes);
  fill(buf.span(), 7);
  store.wait(store.write(e, buf.span()));

  // Flip one byte in the middle of the extent through an ordinary descriptor.
  const std::string path = store.paths()[e.file];
  int fd = open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  std::byte b{};
  const off_t at = static_cast<off_t>(e.offset + e.bytes / 2);
  REQUIRE(pread(fd, &b, 1, at) == 1);
  b ^= std::byte{0x01};
  REQUIRE(pwrite(fd, &b, 1, at) == 1);
  close(fd);

  std::exception_ptr seen;
  bool called = false;
  auto t = store.read(e, buf.span(), [&](std::exception_ptr err) {
    called = true;
    seen = err;
  });
  const std::string msg = message_of([&] { store.wait(t); });
  CHECK(called);
  CHECK(seen != nullptr);
  CHECK_THAT(msg, Catch::Contains("checksum mismatch") && Catch::Contains("adam_v of block 2") &&
                      Catch::Contains(path) &&
                      Catch::Contains("offset " + std::to_string(e.offset)));
  // Untouched extents still read fine.
  const Extent& ok = store.extent(2, ExtentKind::kMaster);
  AlignedBuf w(ok.io_bytes), r(ok.io_bytes);
  fill(w.span(), 9);
  store.wait(store.write(ok, w.span()));
  store.wait(store.read(ok, r.span()));
  CHECK(same(w.span(), r.span(), ok.bytes));
}

TEST_CASE("short transfers are resubmitted for the remainder, EAGAIN is retried", "[nvme]") {
  const NvmeBackend backend = GENERATE(NvmeBackend::kUring, NvmeBackend::kPosix);
  INFO(backend_name(backend));
  TempDir dir;
  std::atomic<int> shorts{0}, eagains{0}, retries_seen{0};
  NvmeStoreOptions o = options_for(backend);
  o.fault_hook = [&](const NvmeFaultPoint& p, int res) {
    if (p.attempt > 0) ++retries_seen;
    // First attempt of every chunk: EAGAIN. Second: short by an unaligned
    // amount (the real transfer was complete; the store must redo the tail).
    if (p.attempt == 0) {
      ++eagains;
      return -EAGAIN;
    }
    if (p.attempt == 1 && res > 5000) {
      ++shorts;
      return res / 2 - 1234;
    }
    return res;
  };
  NvmeStore store({dir.file("a")}, three_blocks(), o);
  std::vector<std::unique_ptr<AlignedBuf>> src, dst;
  for (const Extent& e : store.extents()) {
    src.push_back(std::make_unique<AlignedBuf>(e.io_bytes));
    dst.push_back(std::make_unique<AlignedBuf>(e.io_bytes));
    fill(src.back()->span(), e.index + 50);
    store.wait(store.write(e, src.back()->span()));
    store.wait(store.read(e, dst.back()->span()));
    CHECK(same(src.back()->span(), dst.back()->span(), e.bytes));
  }
  CHECK(eagains > 0);
  CHECK(shorts > 0);
  CHECK(retries_seen >= eagains);
}

TEST_CASE("a persistent short transfer or EAGAIN fails instead of spinning", "[nvme]") {
  TempDir dir;
  NvmeStoreOptions o = options_for(NvmeBackend::kUring);
  o.fault_hook = [](const NvmeFaultPoint&, int) { return -EAGAIN; };
  NvmeStore store({dir.file("a")}, {{0, ExtentKind::kMaster, 4096}}, o);
  AlignedBuf buf(4096);
  auto t = store.write(store.extent(0, ExtentKind::kMaster), buf.span());
  CHECK_THROWS_WITH(store.wait(t), Catch::Contains("after 64 attempts"));
}

TEST_CASE("EIO is surfaced from wait() naming the file and offset", "[nvme]") {
  const NvmeBackend backend = GENERATE(NvmeBackend::kUring, NvmeBackend::kPosix);
  INFO(backend_name(backend));
  TempDir dir;
  NvmeStoreOptions o = options_for(backend);
  std::atomic<uint64_t> fail_at{UINT64_MAX};
  o.fault_hook = [&](const NvmeFaultPoint& p, int res) { return p.offset == fail_at ? -EIO : res; };
  NvmeStore store({dir.file("a")}, three_blocks(), o);
  const Extent& e = store.extent(2, ExtentKind::kAdamM);
  fail_at = e.offset + 2 * o.chunk_bytes;  // the third chunk
  AlignedBuf buf(e.io_bytes);
  std::exception_ptr cb_err;
  auto t = store.write(e, buf.span(), [&](std::exception_ptr err) { cb_err = err; });
  const std::string msg = message_of([&] { store.wait(t); });
  CHECK(cb_err != nullptr);
  CHECK_THAT(msg, Catch::Contains("write of") && Catch::Contains(store.paths()[0]) &&
                      Catch::Contains("offset " + std::to_string(fail_at.load())) &&
                      Catch::Contains("Input/output error") && Catch::Contains("adam_m of block 2"));
  // The extent's content is unknown now: reading it is refused, not trusted.
  CHECK_THROWS_WITH(store.read(e, buf.span()), Catch::Contains("its last write failed"));
  fail_at = UINT64_MAX;
  store.wait(store.write(e, buf.span()));  // a good write makes it valid again
  store.wait(store.read(e, buf.span()));
}

namespace {

// A small tmpfs mounted for the test and unmounted at the end; empty path when
// this process may not mount (not root, no CAP_SYS_ADMIN).
struct SmallTmpfs {
  TempDir dir;
  bool mounted = false;
  explicit SmallTmpfs(const char* size) {
    std::string opts = std::string("size=") + size;
    mounted = mount("tmpfs", dir.path.c_str(), "tmpfs", 0, opts.c_str()) == 0;
  }
  ~SmallTmpfs() {
    if (mounted) umount2(dir.path.c_str(), MNT_DETACH);
  }
};

}  // namespace

TEST_CASE("ENOSPC from a real full filesystem names the file", "[nvme]") {
  SmallTmpfs fs_small("256k");
  if (!fs_small.mounted) {
    WARN("skipped: cannot mount a tmpfs here (" << std::strerror(errno) << "): ENOSPC case not run");
    return;
  }
  const std::string path = fs_small.dir.file("state");
  // Preallocation refuses up front, with the sizes.
  CHECK_THROWS_WITH(NvmeStore({path}, {{0, ExtentKind::kMaster, 1 << 20}}),
                    Catch::Contains("cannot preallocate 1048576 bytes") &&
                        Catch::Contains(path) && Catch::Contains("No space left"));
  // A sparse file runs out during the write: the error comes from wait().
  const NvmeBackend backend = GENERATE(NvmeBackend::kUring, NvmeBackend::kPosix);
  INFO(backend_name(backend));
  NvmeStoreOptions o = options_for(backend);
  o.preallocate = false;
  NvmeStore store({path}, {{0, ExtentKind::kMaster, 1 << 20}}, o);
  AlignedBuf buf(1 << 20);
  auto t = store.write(store.extent(0, ExtentKind::kMaster), buf.span());
  CHECK_THROWS_WITH(store.wait(t), Catch::Contains("No space left") && Catch::Contains(path) &&
                                       Catch::Contains("offset") && Catch::Contains("full"));
}

TEST_CASE("sync() persists checksums and a reopened store verifies them", "[nvme]") {
  const NvmeBackend backend = GENERATE(NvmeBackend::kUring, NvmeBackend::kPosix);
  INFO(backend_name(backend));
  TempDir dir;
  const std::vector<std::string> files{dir.file("a"), dir.file("b")};
  std::vector<std::unique_ptr<AlignedBuf>> src;
  {
    NvmeStore store(files, three_blocks(), options_for(backend));
    for (const Extent& e : store.extents()) {
      if (e.block == 1) continue;  // left unwritten
      src.push_back(std::make_unique<AlignedBuf>(e.io_bytes));
      fill(src.back()->span(), e.index + 77);
      store.wait(store.write(e, src.back()->span()));
    }
    store.sync();
    CHECK(fs::exists(store.sidecar_path()));
  }
  NvmeStoreOptions o = options_for(backend);
  o.open_existing = true;
  {
    NvmeStore store(files, three_blocks(), o);
    size_t i = 0;
    for (const Extent& e : store.extents()) {
      AlignedBuf dst(e.io_bytes);
      if (e.block == 1) {
        CHECK_THROWS_WITH(store.read(e, dst.span()), Catch::Contains("never written"));
        continue;
      }
      store.wait(store.read(e, dst.span()));
      CHECK(same(src[i++]->span(), dst.span(), e.bytes));
    }
  }
  // A different layout is refused rather than read with the wrong checksums.
  auto other = three_blocks();
  other[0].bytes -= 1000;  // same files and offsets, different extent
  CHECK_THROWS_WITH(NvmeStore(files, other, o), Catch::Contains("same extents"));
}

TEST_CASE("a pinned arena registered as fixed buffers", "[nvme]") {
  TempDir dir;
  auto store = std::make_unique<NvmeStore>(std::vector<std::string>{dir.file("a")}, three_blocks(),
                                           options_for(NvmeBackend::kUring));
  ArenaOptions ao;
  ao.lock = LockPolicy::kNone;
  ao.huge_pages = false;
  PinnedArena arena(8 << 20, ao);
  arena.attach(store->registrar());
  INFO(store->backend_description());
  // The kernel may refuse to pin (memlock); then I/O is plain and still correct.
  if (store->fixed_buffer_bytes() == 0) WARN("io_uring fixed buffers refused here; plain I/O");
  else CHECK(store->fixed_buffer_bytes() == arena.capacity_bytes());
  for (const Extent& e : store->extents()) {
    auto w = arena.carve(e.io_bytes, kNvmeAlign, "w");
    auto r = arena.carve(e.io_bytes, kNvmeAlign, "r");
    fill(w, e.index + 3);
    store->wait(store->write(e, w));
    store->wait(store->read(e, r));
    CHECK(same(w, r, e.bytes));
  }
  store.reset();  // the arena outlives the store: its unregister must be harmless
}

TEST_CASE("the destructor drains in-flight I/O", "[nvme]") {
  const NvmeBackend backend = GENERATE(NvmeBackend::kUring, NvmeBackend::kPosix);
  INFO(backend_name(backend));
  TempDir dir;
  std::atomic<int> done{0};
  std::vector<ExtentSpec> specs;
  for (int64_t b = 0; b < 32; ++b) specs.push_back({b, ExtentKind::kAdamM, 256 << 10});
  AlignedBuf buf(256 << 10);
  {
    NvmeStore store({dir.file("a")}, specs, options_for(backend));
    for (const Extent& e : store.extents()) store.write(e, buf.span(), [&](std::exception_ptr) { ++done; });
  }
  CHECK(done == 32);
}

namespace {

// In a child process: make io_uring_setup fail with `err` (seccomp), then run
// a store with kAuto. Exit code 0 = it fell back and round-tripped data.
int child_without_uring(const std::string& path, int err) {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (static_cast<unsigned>(err) & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof filter / sizeof filter[0]), filter};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return 10;
  if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) return 11;
  try {
    NvmeStore store({path}, {{0, ExtentKind::kMaster, 100'000}});
    if (store.using_uring()) return 12;
    if (store.backend_description().find("io_uring refused") == std::string::npos) return 13;
    const Extent& e = store.extent(0, ExtentKind::kMaster);
    AlignedBuf w(e.io_bytes), r(e.io_bytes);
    fill(w.span(), 1);
    store.wait(store.write(e, w.span()));
    store.wait(store.read(e, r.span()));
    if (!same(w.span(), r.span(), e.bytes)) return 14;
    // Forcing io_uring must say why it cannot.
    NvmeStoreOptions o;
    o.backend = NvmeBackend::kUring;
    try {
      NvmeStore forced({path + "2"}, {{0, ExtentKind::kMaster, 4096}}, o);
      return 15;
    } catch (const Error& ex) {
      if (std::string(ex.what()).find("io_uring is not available") == std::string::npos) return 16;
    }
  } catch (...) {
    return 17;
  }
  return 0;
}

}  // namespace

TEST_CASE("io_uring refused by the kernel (ENOSYS, EPERM) falls back to pread/pwrite", "[nvme]") {
  const int err = GENERATE(ENOSYS, EPERM);
  INFO("errno " << err);
  TempDir dir;
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) _exit(child_without_uring(dir.file("a"), err));
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("the streamed checksum equals the one-shot checksum", "[nvme]") {
  AlignedBuf buf((300'001 + 4095) & ~size_t{4095});
  fill(buf.span(), 3);
  const std::span<const std::byte> all{buf.p, 300'001};
  Checksum64Stream s;
  s.update(all.subspan(0, 1));
  s.update(all.subspan(1, 65'535));
  s.update(all.subspan(65'536));
  CHECK(s.digest() == checksum64(all));
  CHECK(checksum64(all) != checksum64(all.subspan(1)));
}

TEST_CASE("the extent checksum combines independent 1 MiB pieces", "[nvme]") {
  const size_t n = 2 * kChecksumPieceBytes + 5;
  AlignedBuf buf((n + 4095) & ~size_t{4095});
  fill(buf.span(), 4);
  const std::span<const std::byte> all{buf.p, n};
  REQUIRE(checksum_piece_count(n) == 3);
  const uint64_t pieces[] = {checksum64(all.subspan(0, kChecksumPieceBytes)),
                             checksum64(all.subspan(kChecksumPieceBytes, kChecksumPieceBytes)),
                             checksum64(all.subspan(2 * kChecksumPieceBytes))};
  CHECK(extent_checksum64(all) == combine_piece_checksums(pieces));
  CHECK(extent_checksum64(all) != extent_checksum64(all.first(n - 1)));
  // Pieces are position-bound: swapping two equal-sized pieces changes it.
  const uint64_t swapped[] = {pieces[1], pieces[0], pieces[2]};
  CHECK(combine_piece_checksums(swapped) != combine_piece_checksums(pieces));
}

TEST_CASE("multi-piece extents: any chunk size, every piece verified, sidecar v2", "[nvme]") {
  const NvmeBackend backend = GENERATE(NvmeBackend::kUring, NvmeBackend::kPosix);
  INFO(backend_name(backend));
  TempDir dir;
  // Three pieces, the last partial and not a multiple of 4 KiB.
  const std::vector<ExtentSpec> specs{{0, ExtentKind::kMaster, 2 * kChecksumPieceBytes + 300'001}};
  NvmeStoreOptions o = options_for(backend);
  o.chunk_bytes = 12 << 10;  // chunk boundaries straddle piece boundaries
  o.hash_threads = 3;
  AlignedBuf src(NvmeStore({dir.file("a")}, specs, o).extent(0, ExtentKind::kMaster).io_bytes);
  fill(src.span(), 11);
  std::string path;
  uint64_t offset = 0;
  {
    NvmeStore store({dir.file("a")}, specs, o);
    const Extent& e = store.extent(0, ExtentKind::kMaster);
    store.wait(store.write(e, src.span()));
    store.sync();
    path = store.paths()[e.file];
    offset = e.offset;
    std::ifstream in(store.sidecar_path());
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    char want[32];
    std::snprintf(want, sizeof want, "%016llx",
                  static_cast<unsigned long long>(extent_checksum64({src.p, e.bytes})));
    CHECK_THAT(text, Catch::Contains(want) && Catch::Contains("\"version\": 2") &&
                         Catch::Contains("\"piece_bytes\": 1048576"));
  }
  NvmeStoreOptions reopen = options_for(backend);
  reopen.open_existing = true;
  reopen.chunk_bytes = kChecksumPieceBytes + 4096;  // a different split on the way back
  reopen.hash_threads = 1;
  {
    NvmeStore store({dir.file("a")}, specs, reopen);
    const Extent& e = store.extent(0, ExtentKind::kMaster);
    AlignedBuf dst(e.io_bytes);
    store.wait(store.read(e, dst.span()));
    CHECK(same(src.span(), dst.span(), e.bytes));

    // Corrupt the last (partial) piece: the read must fail.
    int fd = open(path.c_str(), O_RDWR);
    REQUIRE(fd >= 0);
    std::byte b{};
    const off_t at = static_cast<off_t>(offset + e.bytes - 7);
    REQUIRE(pread(fd, &b, 1, at) == 1);
    b ^= std::byte{0x80};
    REQUIRE(pwrite(fd, &b, 1, at) == 1);
    close(fd);
    CHECK_THAT(message_of([&] { store.wait(store.read(e, dst.span())); }),
               Catch::Contains("checksum mismatch"));
  }
  // A version 1 sidecar (one hash over the whole extent) is refused, not misread.
  const std::string meta = dir.file("a") + ".strider-meta.json";
  std::string text;
  {
    std::ifstream in(meta);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const size_t v = text.find("\"version\": 2");
  REQUIRE(v != std::string::npos);
  text.replace(v, 12, "\"version\": 1");
  std::ofstream(meta, std::ios::trunc) << text;
  CHECK_THAT(message_of([&] { NvmeStore({dir.file("a")}, specs, reopen); }),
             Catch::Contains("version 1") && Catch::Contains("checkpoint"));
}
