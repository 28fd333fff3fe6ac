// bench_nvme: sequential write and read of one file through NvmeStore at each
// (chunk size, queue depth), against fio (io_uring, direct, fixedbufs,
// registerfiles) on the same file with the same block size, depth and size, in
// the same run. The disk here is whatever --dir sits on; the store/fio ratio is
// the figure. Prints a table, then one JSON line. Never fails on speed.
//
// Method. A virtio disk's speed drifts by tens of percent from one pass to the
// next (fio against itself: up to 2.5x between passes of one configuration), so
// a single pass, or the best of a few, compares two draws of that noise.
// Instead each configuration runs --pairs store/fio pairs of passes, the two
// passes of a pair back to back, and each pair gives one paired ratio (store
// GB/s / fio GB/s): drift slower than a pair cancels in it. The order inside a
// pair alternates (store first, then fio first) so position effects (the pass
// after a write paying for its writeback) fall on both sides. Writes come in
// blocks [store, fio] [fio, store] so that the store wrote last before the read
// pairs (fio's data would fail the store's checksums); reads alternate [store,
// fio] [fio, store]. A configuration's figure is the median of its paired
// ratios; "read_vs_fio" / "write_vs_fio" are the lowest of those medians over
// the configurations. The JSON also gives each configuration's paired ratios,
// the store's and fio's min/median/max GB/s (fio's own spread is the noise floor
// to judge a ratio by) and the CPU seconds per GB each side spends (the store
// hashes every byte it writes and verifies every byte it reads; fio hashes
// nothing).
//
// Like for like. fio runs on buffers of depth x bs bytes, recycled; the
// store's caller decides its buffers. On this VM the "drive" is a copy made by
// the host, so buffer memory is not neutral, and the bench matches it:
// - Page size: the store's PinnedArena madvises transparent huge pages; fio's
//   malloc'd buffers get them too (glibc.malloc.hugetlb=1, --iomem_align=2M).
//   With fio on 4 KiB pages (256 scattered pages per 1 MiB request) the store
//   ran 1.2-1.9x fio in one session: a figure about fio's buffers, not the
//   store. --small-pages puts both sides on 4 KiB pages.
// - Footprint: by default each extent is one chunk and the bench keeps
//   depth + 2 extents in flight, so the store sees fio's request stream (one
//   request per bs, `depth` at the drive) over about fio's buffer memory.
//   At 1 MiB x depth 8 the store wrote 3.3-3.8 GB/s and read 2.3-2.4 cycling
//   10 MiB of buffers, and wrote 2.5-2.7, read 1.7 cycling 640 MiB, same
//   requests. The engine-like layout (--extent-mib 64: 64 MiB extents, 3-10
//   in flight, 24x fio's memory at 1 MiB x 8) therefore measures the caller's
//   footprint as well as the store: with it, one quick run read 0.64 and
//   wrote 0.82 of fio at 1 MiB x 8, and 0.92-1.03 at the other settings.
//
// - Resubmission: fio reaps and resubmits at once; the store's caller here
//   does the same from each ticket's completion callback. A loop that waited
//   for the oldest ticket before reusing its buffer read 0.87-0.90 of fio at
//   4-8 MiB x depth 32-64 (completions arrive out of order, so the drive's
//   queue drained behind one slow request); from the callback, 0.98-1.13.
//
// --hash-threads and --inflight-extents are for finding where time goes.
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <functional>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "host/error.h"
#include "host/pinned_arena.h"
#include "io/checksum.h"
#include "io/nvme_store.h"

using namespace strider;
namespace fs = std::filesystem;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double cpu_s(int who) {
  rusage u{};
  getrusage(who, &u);
  auto sec = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

struct Pass {
  double gbs = 0;
  double cpu_s_per_gb = 0;
};

// One pass over every extent, keeping `bufs.size()` extents in flight.
// Like fio, which resubmits as it reaps: each completion starts the next
// extent into the buffer it freed, from the store's completion callback.
// Waiting for the oldest ticket instead (a loop over slots in order) lets the
// drive's queue drain behind one slow request whenever completions arrive out
// of order, which a virtio disk's completions often do.
Pass store_pass(NvmeStore& store, std::vector<std::span<std::byte>>& bufs, bool write) {
  const std::vector<Extent>& extents = store.extents();
  std::mutex mu;
  std::condition_variable cv;
  size_t next = 0, finished = 0;
  std::exception_ptr failure;
  std::vector<NvmeTicket> tickets(extents.size());  // kept alive until the pass ends
  std::function<void(size_t, size_t)> start = [&](size_t i, size_t slot) {
    auto done = [&, slot](std::exception_ptr err) {
      size_t more = SIZE_MAX;
      {
        std::lock_guard lk(mu);
        if (err && !failure) failure = err;
        ++finished;
        if (next < extents.size() && !failure) more = next++;
      }
      cv.notify_all();
      if (more != SIZE_MAX) start(more, slot);
    };
    NvmeTicket t = write ? store.write(extents[i], bufs[slot], done) : store.read(extents[i], bufs[slot], done);
    std::lock_guard lk(mu);
    tickets[i] = std::move(t);
  };
  const double c0 = cpu_s(RUSAGE_SELF), t0 = now_s();
  size_t bytes = 0;
  for (const Extent& e : extents) bytes += e.bytes;
  {
    std::unique_lock lk(mu);
    const size_t first = std::min(bufs.size(), extents.size());
    next = first;
    lk.unlock();
    for (size_t i = 0; i < first; ++i) start(i, i);
    lk.lock();
    cv.wait(lk, [&] { return finished == next; });
    if (failure) std::rethrow_exception(failure);
  }
  for (auto& t : tickets)
    if (t.valid()) store.wait(t);
  const double gb = bytes / 1e9;
  return {gb / (now_s() - t0), (cpu_s(RUSAGE_SELF) - c0) / gb};
}

// `huge_pages`: fio's buffers on transparent huge pages like the store's arena
// (glibc's malloc madvises them with this tunable; the 2 MiB alignment lets
// the pages cover every buffer), else on 4 KiB pages.
Pass fio_pass(const std::string& fio, const std::string& file, size_t bs, unsigned depth,
              size_t size, bool write, bool huge_pages) {
  const std::string rw = write ? "write" : "read";
  const std::string cmd = fmt::format(
      "{}{} --name=nvme --filename={} --rw={} --bs={} --iodepth={} --size={} --direct=1 "
      "--ioengine=io_uring --fixedbufs --registerfiles{} --output-format=json 2>&1",
      huge_pages ? "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 " : "", fio, file, rw, bs, depth, size,
      huge_pages ? " --iomem_align=2M" : "");
  const double c0 = cpu_s(RUSAGE_CHILDREN);  // fio's CPU, counted once it is reaped
  FILE* p = popen(cmd.c_str(), "r");
  STRIDER_CHECK(p != nullptr, "cannot run: {}", cmd);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int rc = pclose(p);
  STRIDER_CHECK(rc == 0, "fio failed (status {}): {}\n{}", rc, cmd, out);
  // fio may print notes before the JSON object.
  const size_t brace = out.find('{');
  STRIDER_CHECK(brace != std::string::npos, "fio printed no JSON: {}\n{}", cmd, out);
  const auto j = nlohmann::json::parse(out.substr(brace));
  const double gbs = j.at("jobs").at(0).at(rw).at("bw_bytes").get<double>() / 1e9;
  return {gbs, (cpu_s(RUSAGE_CHILDREN) - c0) / (size / 1e9)};
}

std::vector<size_t> parse_list(const std::string& s) {
  std::vector<size_t> v;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) v.push_back(std::stoul(item));
  return v;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

// min/median/max of a series, for the table and the JSON.
nlohmann::json spread(const std::vector<double>& v) {
  return {{"min", *std::min_element(v.begin(), v.end())},
          {"median", median(v)},
          {"max", *std::max_element(v.begin(), v.end())}};
}

// The passes of one direction of one configuration.
struct Series {
  std::vector<double> store_gbs, fio_gbs, ratio, store_cpu, fio_cpu;
  void add(const Pass& s, const Pass& f) {
    store_gbs.push_back(s.gbs);
    fio_gbs.push_back(f.gbs);
    ratio.push_back(s.gbs / f.gbs);
    store_cpu.push_back(s.cpu_s_per_gb);
    fio_cpu.push_back(f.cpu_s_per_gb);
  }
  nlohmann::json json() const {
    return {{"ratio", median(ratio)},       {"paired_ratios", ratio},
            {"store_gbs", spread(store_gbs)}, {"fio_gbs", spread(fio_gbs)},
            {"store_cpu_s_per_gb", median(store_cpu)}, {"fio_cpu_s_per_gb", median(fio_cpu)}};
  }
};

double thread_cpu_s() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + t.tv_nsec * 1e-9;
}

// XXH3 speed of one core over a buffer larger than the caches, in CPU time
// (other processes' load does not count): what verifying a read costs.
double hash_gbs(std::span<const std::byte> buf) {
  uint64_t sink = 0;
  const double t0 = thread_cpu_s();
  int rounds = 0;
  do {
    sink ^= checksum64(buf);
    ++rounds;
  } while (thread_cpu_s() - t0 < 0.2);
  const double gbs = rounds * (buf.size() / 1e9) / (thread_cpu_s() - t0);
  return sink == 42 ? gbs + 1e-12 : gbs;  // keeps the hashes from being optimised away
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"NvmeStore vs fio: sequential O_DIRECT write and read"};
  double size_gib = 2.0;
  int pairs = 6;
  std::string dir = fs::temp_directory_path().string();
  std::string chunks_mib = "1,4,8", depths = "8,32,64", fio = "fio";
  size_t extent_mib = 0, inflight_opt = 0;
  unsigned hash_threads = 0;
  bool posix = false, quick = false, verbose = false, small_pages = false;
  app.add_option("--size-gib", size_gib, "file size (GiB)");
  app.add_option("--pairs", pairs, "store/fio pass pairs per configuration and direction; "
                 "the median paired ratio is the configuration's figure")->check(CLI::Range(1, 100));
  app.add_option("--dir", dir, "directory for the file (removed at the end)");
  app.add_option("--chunks-mib", chunks_mib, "chunk sizes = fio bs, MiB, comma-separated");
  app.add_option("--depths", depths, "queue depths = fio iodepth, comma-separated");
  app.add_option("--extent-mib", extent_mib,
                 "extent size (MiB), a multiple of every chunk; 0: one chunk (fio's layout)");
  app.add_option("--inflight-extents", inflight_opt,
                 "extent tickets the bench keeps in flight (0: depth x chunk / extent + 2)");
  app.add_option("--hash-threads", hash_threads, "the store's checksum threads (0: its default)");
  app.add_option("--fio", fio, "fio binary");
  app.add_flag("--small-pages", small_pages,
               "4 KiB pages for both sides' buffers (default: transparent huge pages for both)");
  app.add_flag("--posix", posix, "use the pread/pwrite fallback instead of io_uring");
  app.add_flag("--quick", quick, "chunks 1,8 MiB x depths 8,64, 2 pairs (about a minute)");
  app.add_flag("--verbose", verbose, "print every pass");
  CLI11_PARSE(app, argc, argv);
  if (quick) {
    chunks_mib = "1,8";
    depths = "8,64";
    pairs = 2;
  }

  try {
    const std::vector<size_t> chunk_list = parse_list(chunks_mib), depth_list = parse_list(depths);
    STRIDER_CHECK(!chunk_list.empty() && !depth_list.empty(), "--chunks-mib and --depths need a value");
    // Per configuration: the extent size and how many extents are in flight.
    struct Layout {
      size_t chunk_mib, depth, extent_bytes, inflight;
    };
    std::vector<Layout> layouts;
    size_t arena_bytes = 0, largest_extent = 0;
    for (size_t chunk_mib : chunk_list) {
      STRIDER_CHECK(chunk_mib > 0 && extent_mib % chunk_mib == 0,
                    "--extent-mib {} must be 0 or a multiple of chunk {} MiB", extent_mib, chunk_mib);
      for (size_t depth : depth_list) {
        STRIDER_CHECK(depth > 0, "--depths: a queue depth of 0");
        const size_t ext = (extent_mib ? extent_mib : chunk_mib) << 20;
        // The store's queue holds `depth` chunks; the bench offers two extents
        // more than that, so the queue never runs dry while the oldest extent
        // is waited for and the next one is not yet issued.
        const size_t inflight = inflight_opt ? inflight_opt
                                             : ((depth * chunk_mib << 20) + ext - 1) / ext + 2;
        layouts.push_back({chunk_mib, depth, ext, inflight});
        arena_bytes = std::max(arena_bytes, inflight * ext);
        largest_extent = std::max(largest_extent, ext);
      }
    }
    const size_t size = static_cast<size_t>(size_gib * (1ull << 30)) / largest_extent * largest_extent;
    STRIDER_CHECK(size > 0, "--size-gib {} is smaller than one extent ({} bytes)", size_gib,
                  largest_extent);
    for (const Layout& l : layouts)
      STRIDER_CHECK(size % l.extent_bytes == 0, "the file size {} is not a multiple of the {}-byte "
                    "extents of chunk {} MiB; pick chunk sizes that divide each other", size,
                    l.extent_bytes, l.chunk_mib);
    const std::string file = (fs::path(dir) / fmt::format("bench_nvme.{}.dat", getpid())).string();
    struct RemoveAtExit {  // the file is large: gone on every path out
      std::string path;
      ~RemoveAtExit() {
        std::error_code ec;
        fs::remove(path, ec);
        fs::remove(path + ".strider-meta.json", ec);
      }
    } remove_at_exit{file};

    ArenaOptions ao;
    ao.lock = LockPolicy::kPrefer;
    ao.huge_pages = !small_pages;
    PinnedArena arena(arena_bytes, ao);
    std::span<std::byte> region = arena.carve(arena_bytes, kNvmeAlign, "bench buffers");
    std::mt19937_64 rng(1);
    auto* words = reinterpret_cast<uint64_t*>(region.data());
    for (size_t k = 0; k < region.size() / 8; ++k) words[k] = rng();
    const double hash_1t_gbs = hash_gbs(region.first(std::min(region.size(), size_t{64} << 20)));

    NvmeStoreOptions base;
    base.backend = posix ? NvmeBackend::kPosix : NvmeBackend::kAuto;
    base.hash_threads = hash_threads;
    fmt::print("file {} ({:.2f} GiB), {} pairs per configuration, buffers on {} pages (store arena: "
               "{}), XXH3 on one core (64 MiB, CPU time): {:.1f} GB/s\n"
               "GB/s as median [min-max] over the passes; ratio = median of the paired ratios\n",
               file, size / double(1ull << 30), pairs, small_pages ? "4 KiB" : "huge",
               arena.huge_pages() ? "madvised huge" : "4 KiB", hash_1t_gbs);
    fmt::print("{:>6} {:>5} {:>13} | {:>19} {:>19} {:>6} | {:>19} {:>19} {:>6}\n", "chunk", "depth",
               "extents", "store wr GB/s", "fio wr GB/s", "ratio", "store rd GB/s", "fio rd GB/s",
               "ratio");

    auto cell = [](const std::vector<double>& v) {
      return fmt::format("{:.2f} [{:.2f}-{:.2f}]", median(v), *std::min_element(v.begin(), v.end()),
                         *std::max_element(v.begin(), v.end()));
    };
    nlohmann::json configs = nlohmann::json::array();
    double min_read = 1e9, min_write = 1e9, worst_fio_read = 1, worst_fio_write = 1;
    nlohmann::json min_read_at, min_write_at;
    std::vector<double> all_ratios_r, all_ratios_w;
    std::string backend;
    size_t fixed_bytes = 0;
    for (const Layout& l : layouts) {
      const size_t chunk_mib = l.chunk_mib, depth = l.depth;
      std::vector<ExtentSpec> specs;
      for (size_t i = 0; i < size / l.extent_bytes; ++i)
        specs.push_back({static_cast<int64_t>(i), ExtentKind::kMaster, l.extent_bytes});
      std::vector<std::span<std::byte>> bufs;
      for (size_t i = 0; i < l.inflight; ++i) bufs.push_back(region.subspan(i * l.extent_bytes, l.extent_bytes));
      NvmeStoreOptions o = base;
      o.chunk_bytes = chunk_mib << 20;
      o.queue_depth = static_cast<unsigned>(depth);
      // A fresh store (and file) per layout; one store for all of its passes,
      // so its checksums follow its own writes (fio's writes in between are
      // overwritten by the store write that precedes every read pair).
      NvmeStore store({file}, specs, o);
      backend = store.backend_description();
      auto reg = store.registrar();  // fixed buffers belong to one ring
      reg->register_memory(arena.data(), arena.capacity_bytes());
      fixed_bytes = store.fixed_buffer_bytes();
      auto sp = [&](bool w) { return store_pass(store, bufs, w); };
      auto fp = [&](bool w) { return fio_pass(fio, file, chunk_mib << 20, o.queue_depth, size, w, !small_pages); };
      auto log = [&](const char* what, const Pass& s, const Pass& f) {
        if (verbose)
          fmt::print("    {:>2} MiB {:>3} {:<10} store {:.3f} fio {:.3f} ratio {:.3f} "
                     "(cpu s/GB store {:.3f} fio {:.3f})\n", chunk_mib, depth, what, s.gbs,
                     f.gbs, s.gbs / f.gbs, s.cpu_s_per_gb, f.cpu_s_per_gb);
      };
      sp(true);  // untimed: lays the fresh file out, so no side pays for unwritten blocks
      Series wr, rd;
      for (int p = 0; p < pairs; p += 2) {
        // Writes: [store, fio] then [fio, store], so the store wrote last; a
        // lone final pair (odd --pairs) is [fio, store] for the same reason.
        if (p + 1 < pairs) {
          Pass s = sp(true), f = fp(true);
          log("write s,f", s, f);
          wr.add(s, f);
        }
        {
          Pass f = fp(true), s = sp(true);
          log("write f,s", s, f);
          wr.add(s, f);
        }
        {
          Pass s = sp(false), f = fp(false);
          log("read s,f", s, f);
          rd.add(s, f);
        }
        if (p + 1 < pairs) {
          Pass f = fp(false), s = sp(false);
          log("read f,s", s, f);
          rd.add(s, f);
        }
      }
      reg->unregister_memory(arena.data(), arena.capacity_bytes());
      const double rw = median(wr.ratio), rr = median(rd.ratio);
      if (rw < min_write) min_write = rw, min_write_at = {{"chunk_mib", chunk_mib}, {"depth", depth}};
      if (rr < min_read) min_read = rr, min_read_at = {{"chunk_mib", chunk_mib}, {"depth", depth}};
      auto fio_spread = [](const Series& s) {
        return *std::max_element(s.fio_gbs.begin(), s.fio_gbs.end()) /
               *std::min_element(s.fio_gbs.begin(), s.fio_gbs.end());
      };
      worst_fio_write = std::max(worst_fio_write, fio_spread(wr));
      worst_fio_read = std::max(worst_fio_read, fio_spread(rd));
      all_ratios_w.insert(all_ratios_w.end(), wr.ratio.begin(), wr.ratio.end());
      all_ratios_r.insert(all_ratios_r.end(), rd.ratio.begin(), rd.ratio.end());
      fmt::print("{:>2} MiB {:>5} {:>4} x {:>2} MiB | {:>19} {:>19} {:>6.3f} | {:>19} {:>19} {:>6.3f}\n",
                 chunk_mib, depth, l.inflight, l.extent_bytes >> 20, cell(wr.store_gbs),
                 cell(wr.fio_gbs), rw, cell(rd.store_gbs), cell(rd.fio_gbs), rr);
      std::fflush(stdout);
      configs.push_back({{"chunk_mib", chunk_mib},
                         {"depth", depth},
                         {"extent_bytes", l.extent_bytes},
                         {"inflight_extents", l.inflight},
                         {"store_buffer_bytes", l.inflight * l.extent_bytes},
                         {"fio_buffer_bytes", depth * (chunk_mib << 20)},
                         {"write", wr.json()},
                         {"read", rd.json()}});
    }
    fmt::print("store: {}\nlowest median paired ratio: write {:.3f} at {} MiB x {}, read {:.3f} at "
               "{} MiB x {}; fio's own max/min over a configuration's passes: write up to {:.2f}x, "
               "read up to {:.2f}x\n", backend, min_write, min_write_at["chunk_mib"].get<size_t>(),
               min_write_at["depth"].get<size_t>(), min_read, min_read_at["chunk_mib"].get<size_t>(),
               min_read_at["depth"].get<size_t>(), worst_fio_write, worst_fio_read);
    nlohmann::json j{{"bench", "nvme"},
                     {"method", "median of paired store/fio ratios, order alternating"},
                     {"size_bytes", size},
                     {"pairs", pairs},
                     {"extent_mib", extent_mib},
                     {"huge_pages", !small_pages},
                     {"store_arena_huge_pages", arena.huge_pages()},
                     {"backend", backend},
                     {"fixed_buffer_bytes", fixed_bytes},
                     {"xxh3_1thread_gbs", hash_1t_gbs},
                     {"configs", configs},
                     {"read_vs_fio", min_read},
                     {"write_vs_fio", min_write},
                     {"read_vs_fio_at", min_read_at},
                     {"write_vs_fio_at", min_write_at},
                     {"read_paired_ratios", spread(all_ratios_r)},
                     {"write_paired_ratios", spread(all_ratios_w)},
                     {"fio_read_max_over_min", worst_fio_read},
                     {"fio_write_max_over_min", worst_fio_write}};
    std::cout << j.dump() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "bench_nvme: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
