// bench_adam: how close CpuAdam runs to the machine's memory bandwidth, and how
// it compares with torch's fused CPU AdamW plus the bf16 cast torch needs.
//
// For each size N and thread count t, all measured in this run:
//   roof    the memory roofline for t threads: the best of two STREAM-style
//           kernels over double arrays of N elements (see roofline()) and of
//           our own access pattern with trivial arithmetic on our buffers
//   strider CpuAdam, bf16 gradient in, bf16 compute copy out: 28 B per parameter
//           (fp32 p/m/v read and written, 2 B gradient read, 2 B copy written)
//   torch   at::_fused_adamw_ (what AdamW(fused=True) calls) on fp32 p/m/v/g,
//           then p.to(bf16) into a preallocated tensor, with at::set_num_threads(t)
//   ours-f32g  CpuAdam with fp32 gradients: torch's work exactly, so the
//           headline ratio vs_torch (torch time / ours) compares like with like;
//           the bf16-gradient ratio is vs_torch_bf16grad
//   q8      CpuAdam::step_q8, the q8 optimizer-state format (host/adam_q8.h):
//           12.1 B per parameter (bf16 compute copy, 8-bit extension, m and v
//           codes read and written, their groups' scales, 2 B gradient read);
//           its roofline fraction uses the same roof. The q8 kernel is
//           compute-bound on a CPU where the fp32 kernels are memory-bound:
//           each element is decoded, updated, re-encoded and gets a hash for
//           its stochastic rounding.
//           The first line names the kernel (on AVX-512, with VBMI where
//           the CPU has it).
//   q8-loops  the same update by the kernel the hand-written one replaced
//           (Q8Build::kLoops: adam_q8_kernel.h's loops as the compiler
//           vectorizes them), the baseline of q8's speedup column x; the two
//           take turns step by step, each on its own state
//   ds      DeepSpeed's CPUAdam (DeepSpeedCPUAdam) on torch's work exactly, run
//           by bench/adam_deepspeed.py in its own process before our figures
//           (it is a Python extension DeepSpeed builds on first use), with the
//           interpreter the build's torch came from (--python) and deepspeed
//           where --deepspeed-path says; when it cannot run, the reason is
//           printed and its columns say so. vs_deepspeed is its time / ours-f32g.
// Each figure is the best of --reps runs. The last line is one JSON object.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <algorithm>
#include <cstring>
#include <chrono>
#include <cstdio>
#include <map>
#include <span>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>
#include <utility>

#include "host/adam_q8.h"
#include "host/bf16.h"
#include "host/cpu_adam.h"
#include "host/pinned_arena.h"

using namespace strider;
using Clock = std::chrono::steady_clock;

namespace {

template <class F>
double best_seconds(int reps, F&& f) {
  f();  // warm-up: page faults, thread start-up
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

// The memory roofline for `threads` threads: the best bandwidth of two
// STREAM-style kernels over double arrays of n elements, each counting the bytes
// the memory system really moves:
//   triad     a = b + s*c   32 B/elem (b, c read; a written, and read for
//                           ownership first, since the store misses the cache)
//   in-place  a = a + s*b   24 B/elem (a, b read; a written back): the access
//                           pattern of an optimizer's p/m/v updates
struct Roofline { double triad_gbps, inplace_gbps; double best() const { return std::max(triad_gbps, inplace_gbps); } };

Roofline roofline(size_t n, int threads, int reps) {
  PinnedArena arena(3 * n * sizeof(double) + 3 * 4096, {.lock = LockPolicy::kPrefer, .name = "triad"});
  double* a = arena.carve_as<double>(n, "a", 4096).data();
  double* b = arena.carve_as<double>(n, "b", 4096).data();
  double* c = arena.carve_as<double>(n, "c", 4096).data();
  tbb::task_arena ta(threads);
  const size_t grain = size_t{1} << 16, chunks = (n + grain - 1) / grain;
  auto run = [&](auto&& kernel) {
    ta.execute([&] {
      tbb::parallel_for(size_t{0}, chunks, [&](size_t k) {
        const size_t i0 = k * grain, e = std::min(n, i0 + grain);
        kernel(i0, e);
      }, tbb::static_partitioner());
    });
  };
  run([&](size_t i0, size_t e) { for (size_t i = i0; i < e; ++i) { a[i] = 0; b[i] = 1.0; c[i] = 2.0; } });
  const double t_triad = best_seconds(reps, [&] {
    run([a, b, c](size_t i0, size_t e) {
      double* __restrict pa = a; const double* __restrict pb = b; const double* __restrict pc = c;
      for (size_t i = i0; i < e; ++i) pa[i] = pb[i] + 3.0 * pc[i];
    });
  });
  const double t_inplace = best_seconds(reps, [&] {
    run([a, b](size_t i0, size_t e) {
      double* __restrict pa = a; const double* __restrict pb = b;
      for (size_t i = i0; i < e; ++i) pa[i] = pa[i] + 1e-9 * pb[i];
    });
  });
  return {32.0 * n / t_triad / 1e9, 24.0 * n / t_inplace / 1e9};
}

struct OursResult { double gbps, params_per_s, pattern_gbps; };

// Our optimizer's memory access pattern (p, m, v read and written, gradient
// read, bf16 copy written) with trivial arithmetic, vectorised for the same ISA
// as our kernel (the target attribute), so only the memory system limits it.
template <class G>
inline void pattern_loop(float* __restrict p, float* __restrict m, float* __restrict v,
                         const G* __restrict g, uint16_t* __restrict out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float gi;
    if constexpr (sizeof(G) == 2) {
      uint32_t u = uint32_t(g[i]) << 16;
      std::memcpy(&gi, &u, 4);
    } else {
      gi = g[i];
    }
    p[i] += gi;
    m[i] += gi;
    v[i] += gi;
    uint32_t bits;
    std::memcpy(&bits, &p[i], 4);
    out[i] = uint16_t(bits >> 16);
  }
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) void pattern_avx512(
    bool bf16, float* p, float* m, float* v, std::byte* g, uint16_t* out, size_t n) {
  if (bf16) pattern_loop(p, m, v, reinterpret_cast<const uint16_t*>(g), out, n);
  else pattern_loop(p, m, v, reinterpret_cast<const float*>(g), out, n);
}
__attribute__((target("avx2"))) void pattern_avx2(bool bf16, float* p, float* m, float* v,
                                                  std::byte* g, uint16_t* out, size_t n) {
  if (bf16) pattern_loop(p, m, v, reinterpret_cast<const uint16_t*>(g), out, n);
  else pattern_loop(p, m, v, reinterpret_cast<const float*>(g), out, n);
}
void pattern(Isa isa, bool bf16, float* p, float* m, float* v, std::byte* g, uint16_t* out,
             size_t n) {
  if (isa == Isa::kAvx512) pattern_avx512(bf16, p, m, v, g, out, n);
  else if (isa == Isa::kAvx2) pattern_avx2(bf16, p, m, v, g, out, n);
  else if (bf16) pattern_loop(p, m, v, reinterpret_cast<const uint16_t*>(g), out, n);
  else pattern_loop(p, m, v, reinterpret_cast<const float*>(g), out, n);
}

OursResult ours(size_t n, int threads, int reps, DType grad_dtype, Isa isa) {
  const size_t gbytes = dtype_size(grad_dtype);
  PinnedArena arena(n * (12 + gbytes + 2) + 6 * 4096, {.lock = LockPolicy::kPrefer, .name = "adam state"});
  auto p = arena.carve_as<float>(n, "p", 4096), m = arena.carve_as<float>(n, "m", 4096),
       v = arena.carve_as<float>(n, "v", 4096);
  auto g = arena.carve(n * gbytes, 4096, "grad");
  auto out = arena.carve_as<uint16_t>(n, "out", 4096);
  for (size_t i = 0; i < n; ++i) { p[i] = 0.5f; m[i] = 0; v[i] = 0; }
  if (grad_dtype == DType::kBF16) {
    auto g16 = reinterpret_cast<uint16_t*>(g.data());
    for (size_t i = 0; i < n; ++i) g16[i] = float_to_bf16(1e-3f * float(i % 1000));
  } else {
    auto g32 = reinterpret_cast<float*>(g.data());
    for (size_t i = 0; i < n; ++i) g32[i] = 1e-3f * float(i % 1000);
  }
  CpuAdam adam({.threads = threads});
  AdamHyper h;
  int64_t step = 0;
  AdamArgs args{p.data(), m.data(), v.data(), g.data(), grad_dtype, out.data(), n};
  double t = best_seconds(reps, [&] { adam.step(AdamStep::make(h, ++step), args); });
  // The same access pattern on the same buffers and threads with trivial
  // arithmetic: the ceiling any optimizer over this layout can reach.
  tbb::task_arena ta(threads);
  const size_t chunk = adam.chunk_elems(), chunks = (n + chunk - 1) / chunk;
  const bool bf16 = grad_dtype == DType::kBF16;
  double tp = best_seconds(reps, [&] {
    ta.execute([&] {
      tbb::parallel_for(size_t{0}, chunks, [&](size_t k) {
        const size_t i = k * chunk, e = std::min(n, i + chunk);
        pattern(isa, bf16, p.data() + i, m.data() + i, v.data() + i, g.data() + i * gbytes,
                out.data() + i, e - i);
      }, tbb::static_partitioner());
    });
  });
  const double bytes = 12.0 * 2 + gbytes + 2;
  return {bytes * n / t / 1e9, n / t, bytes * n / tp / 1e9};
}

// The q8 format's update over n parameters (n rounded up to whole groups),
// by the kernel CpuAdam runs (Q8Build::kSimd) and by the loops it replaced
// (kLoops), each on its own state. Their steps alternate, so a neighbour's
// load or the machine's clock falls on both alike; each keeps its best.
struct Q8Pair {
  OursResult simd, loops;
};
Q8Pair ours_q8(size_t n, int threads, int reps) {
  n = (n + kQ8GroupElems - 1) / kQ8GroupElems * kQ8GroupElems;
  const size_t groups = n / kQ8GroupElems;
  struct Run {
    Run(size_t n, size_t groups, int threads, Q8Build build)
        : arena(n * 7 + groups * 8 + 8 * 4096, {.lock = LockPolicy::kPrefer, .name = "q8 state"}),
          hi(arena.carve_as<uint16_t>(n, "hi", 4096)),
          g(arena.carve_as<uint16_t>(n, "grad", 4096)),
          ext(arena.carve_as<uint8_t>(n, "ext", 4096)),
          m(arena.carve_as<uint8_t>(n, "m", 4096)),
          v(arena.carve_as<uint8_t>(n, "v", 4096)),
          ms(arena.carve_as<float>(groups, "m scales", 4096)),
          vs(arena.carve_as<float>(groups, "v scales", 4096)),
          adam({.threads = threads, .q8_build = build}) {
      std::vector<float> half(n, 0.5f);
      q8_encode_master(half.data(), hi.data(), ext.data(), n);
      std::fill(m.begin(), m.end(), 0);
      std::fill(v.begin(), v.end(), 0);
      std::fill(ms.begin(), ms.end(), 0.0f);
      std::fill(vs.begin(), vs.end(), 0.0f);
      for (size_t i = 0; i < n; ++i) g[i] = float_to_bf16(1e-3f * float(i % 1000));
    }
    PinnedArena arena;
    std::span<uint16_t> hi, g;
    std::span<uint8_t> ext, m, v;
    std::span<float> ms, vs;
    CpuAdam adam;
    double best = 1e30;
  };
  const std::unique_ptr<Run> runs[2] = {std::make_unique<Run>(n, groups, threads, Q8Build::kSimd),
                                        std::make_unique<Run>(n, groups, threads, Q8Build::kLoops)};
  const AdamHyper h;
  for (int64_t step = 1; step <= reps + 1; ++step) {  // step 1: the warm-up
    for (const auto& r : runs) {
      const auto t0 = Clock::now();
      r->adam.step_q8(AdamStep::make(h, step),
                      Q8Args{{r->hi.data(), r->ext.data(), r->m.data(), r->ms.data(), r->v.data(), r->vs.data()},
                             r->g.data(), DType::kBF16, n, 0, q8_salt(step, 0)});
      if (step > 1) r->best = std::min(r->best, std::chrono::duration<double>(Clock::now() - t0).count());
    }
  }
  const double bytes = 2.0 * (2 + 1 + 1 + 1) + 16.0 / kQ8GroupElems + 2;
  const auto result = [&](const Run& r) { return OursResult{bytes * n / r.best / 1e9, n / r.best, 0}; };
  return {result(*runs[0]), result(*runs[1])};
}

double torch_seconds(size_t n, int threads, int reps) {
  at::set_num_threads(threads);
  const int64_t nn = static_cast<int64_t>(n);
  at::Tensor p = at::full({nn}, 0.5f), g = at::full({nn}, 1e-3f), m = at::zeros({nn}),
             v = at::zeros({nn}), step = at::zeros({}, at::kFloat);
  at::Tensor out = at::empty({nn}, at::kBFloat16);
  return best_seconds(reps, [&] {
    step.add_(1);
    at::_fused_adamw_({p}, {g}, {m}, {v}, {}, {step}, 1e-3, 0.9, 0.999, 0.01, 1e-8, false, false);
    out.copy_(p);
  });
}

// DeepSpeed's CPUAdam seconds per (params, threads), from bench/adam_deepspeed.py;
// empty with `why` set when it did not run.
struct DeepSpeedFigures {
  std::string version, why;
  std::map<std::pair<size_t, int>, double> seconds;
};

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

DeepSpeedFigures deepspeed_seconds(const std::string& python, const std::string& path,
                                   const std::vector<double>& sizes_m, const std::vector<int>& threads, int reps) {
  DeepSpeedFigures f;
  std::string cmd = shell_quote(python) + " " + shell_quote(std::string(STRIDER_BENCH_DIR) + "/adam_deepspeed.py") +
                    " --reps " + std::to_string(reps) + " --sizes";
  for (double s : sizes_m) cmd += " " + fmt::format("{}", s);
  cmd += " --threads";
  for (int t : threads) cmd += " " + std::to_string(t);
  if (!path.empty()) cmd += " --path " + shell_quote(path);
  cmd += " 2>/dev/null";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) {
    f.why = "cannot start " + python;
    return f;
  }
  std::string out, last;
  char buf[4096];
  while (fgets(buf, sizeof buf, pipe)) out += buf;
  const int rc = pclose(pipe);
  for (size_t b = 0, e; b < out.size(); b = e + 1) {
    e = out.find('\n', b);
    if (e == std::string::npos) e = out.size();
    if (e > b && out[b] == '{') last = out.substr(b, e - b);
  }
  const nlohmann::json j = nlohmann::json::parse(last, nullptr, false);
  if (rc != 0 || j.is_discarded() || !j.is_object()) {
    f.why = fmt::format("{} exited with status {} and no figures", cmd, rc);
    return f;
  }
  if (j.value("deepspeed", nlohmann::json()).is_null()) {
    f.why = j.value("error", std::string("unknown"));
    return f;
  }
  f.version = j["deepspeed"].get<std::string>();
  for (const auto& r : j["runs"]) f.seconds[{r["params"].get<size_t>(), r["threads"].get<int>()}] = r["seconds"];
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_adam: CpuAdam against the memory roofline and torch's fused AdamW"};
  std::vector<double> sizes_m{16, 256};
  std::vector<int> threads;
  int reps = 5;
  std::string python = STRIDER_BENCH_PYTHON, deepspeed_path;
  app.add_option("--sizes", sizes_m, "parameter counts in millions (default 16 256)");
  app.add_option("--threads", threads, "thread counts (default 1..all hardware threads)");
  app.add_option("--reps", reps, "timed repetitions per figure; the best is kept")->check(CLI::PositiveNumber);
  app.add_option("--python", python, "the interpreter that runs bench/adam_deepspeed.py (default: the one whose torch "
                 "this build uses)");
  app.add_option("--deepspeed-path", deepspeed_path, "a directory holding the deepspeed package, put first on its "
                 "sys.path (default: wherever that interpreter finds it)");
  CLI11_PARSE(app, argc, argv);
  if (threads.empty())
    for (int t = 1; t <= static_cast<int>(std::thread::hardware_concurrency()); ++t) threads.push_back(t);

  const DeepSpeedFigures ds = deepspeed_seconds(python, deepspeed_path, sizes_m, threads, reps);
  const Isa isa = detect_isa();
  fmt::print("bench_adam: isa {}, {} hardware threads, torch {} threads max; q8 kernel {}, baseline {}\n",
             isa_name(isa), std::thread::hardware_concurrency(), at::get_num_threads(),
             q8_kernel_name(isa, Q8Build::kSimd), q8_kernel_name(isa, Q8Build::kLoops));
  if (ds.why.empty()) fmt::print("DeepSpeed {} CPUAdam: ds columns (its process, the same fp32 work as torch)\n", ds.version);
  else fmt::print("DeepSpeed CPUAdam not run: {}\n", ds.why);
  fmt::print("{:>8} {:>3} | {:>9} | {:>9} {:>9} {:>6} | {:>9} {:>9} {:>7} | {:>9} {:>7} | {:>9} {:>6} {:>9} {:>5} | "
             "{:>9} {:>7}\n",
             "params", "thr", "roofline", "ours", "Mparam/s", "roof", "torch", "ours-f32g", "vs", "ours-bf16g", "vs",
             "q8 Mp/s", "roof", "q8-loops", "x", "ds", "vs");
  double min_roof = 1e9, min_vs = 1e9, min_vs_bf16 = 1e9, min_q8_roof = 1e9, min_vs_ds = 1e9, min_q8_x = 1e9;
  nlohmann::json rows = nlohmann::json::array();
  for (double sm : sizes_m) {
    const size_t n = static_cast<size_t>(sm * 1e6);
    const int r = n > (64u << 20) ? std::max(2, reps / 2) : reps;
    for (int t : threads) {
      const Roofline rl = roofline(n, t, r);
      const OursResult o = ours(n, t, r, DType::kBF16, isa);
      const double roof = std::max(rl.best(), o.pattern_gbps);
      const OursResult of = ours(n, t, r, DType::kF32, isa);
      const auto [q8, q8_loops] = ours_q8(n, t, r);
      const double q8_x = q8.params_per_s / q8_loops.params_per_s;
      min_q8_x = std::min(min_q8_x, q8_x);
      const double ts = torch_seconds(n, t, r);
      const double our_s = n / o.params_per_s, our_f_s = n / of.params_per_s;
      const double ratio = o.gbps / roof, vs_b = ts / our_s, vs = ts / our_f_s, q8_roof = q8.gbps / roof;
      min_roof = std::min(min_roof, ratio);
      min_vs = std::min(min_vs, vs);
      min_vs_bf16 = std::min(min_vs_bf16, vs_b);
      min_q8_roof = std::min(min_q8_roof, q8_roof);
      const auto dsi = ds.seconds.find({n, t});
      const double ds_s = dsi == ds.seconds.end() ? 0 : dsi->second, vs_ds = ds_s / our_f_s;
      if (ds_s > 0) min_vs_ds = std::min(min_vs_ds, vs_ds);
      fmt::print("{:>7.0f}M {:>3} | {:>6.2f}GB/s | {:>6.2f}GB/s {:>9.1f} {:>6.3f} | {:>7.2f}ms {:>7.2f}ms {:>6.2f}x | "
                 "{:>7.2f}ms {:>6.2f}x | {:>9.1f} {:>6.3f} {:>9.1f} {:>4.2f}x | {:>9} {:>7}\n",
                 sm, t, roof, o.gbps, o.params_per_s / 1e6, ratio, ts * 1e3, our_f_s * 1e3, vs, our_s * 1e3, vs_b,
                 q8.params_per_s / 1e6, q8_roof, q8_loops.params_per_s / 1e6, q8_x, ds_s > 0 ? fmt::format("{:.2f}ms", ds_s * 1e3) : "-",
                 ds_s > 0 ? fmt::format("{:.2f}x", vs_ds) : "-");
      rows.push_back({{"params", n}, {"threads", t}, {"triad_gbps", rl.triad_gbps}, {"inplace_gbps", rl.inplace_gbps}, {"pattern_gbps", o.pattern_gbps}, {"roofline_gbps", roof}, {"ours_gbps", o.gbps},
                      {"ours_params_per_s", o.params_per_s}, {"roofline_ratio", ratio},
                      {"torch_ms", ts * 1e3}, {"ours_bf16grad_ms", our_s * 1e3}, {"vs_torch_bf16grad", vs_b},
                      {"ours_f32grad_ms", our_f_s * 1e3}, {"vs_torch", vs},
                      {"q8_params_per_s", q8.params_per_s}, {"q8_gbps", q8.gbps}, {"q8_roofline_ratio", q8_roof},
                      {"q8_loops_params_per_s", q8_loops.params_per_s}, {"q8_speedup", q8_x}});
      if (ds_s > 0) rows.back().update({{"deepspeed_ms", ds_s * 1e3}, {"vs_deepspeed", vs_ds}});
    }
  }
  nlohmann::json out = {{"bench", "adam"}, {"isa", isa_name(isa)}, {"q8_kernel", q8_kernel_name(isa, Q8Build::kSimd)},
                        {"roofline_ratio", min_roof},
                        {"vs_torch", min_vs}, {"vs_torch_bf16grad", min_vs_bf16},
                        {"q8_roofline_ratio", min_q8_roof}, {"q8_speedup", min_q8_x}, {"runs", rows}};
  if (ds.why.empty()) out.update({{"deepspeed", ds.version}, {"vs_deepspeed", min_vs_ds}});
  else out["deepspeed_error"] = ds.why;
  fmt::print("{}\n", out.dump());
  return 0;
}
