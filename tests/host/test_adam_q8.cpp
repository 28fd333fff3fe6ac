// The q8 optimizer-state format (host/state_format.h, host/adam_q8.h): its
// codec's round trips, its update against the fp32 kernel, its independence
// of chunking and threads, and its stochastic rounding's lack of bias.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <xmmintrin.h>
#include <vector>

#include "host/adam_q8.h"
#include "host/adam_q8_kernel.h"  // element_hash: the edge test picks its elements' random words
#include "host/bf16.h"
#include "host/cpu_adam.h"
#include "host/error.h"
#include "host/state_format.h"

using namespace strider;

namespace {

// q8 state over n elements plus an fp32 twin started from the same values.
struct Twin {
  size_t n;
  std::vector<uint16_t> hi, g16;
  std::vector<uint8_t> ext, m, v;
  std::vector<float> ms, vs, p32, m32, v32;
  Twin(size_t n_, uint32_t seed)
      : n(n_), hi(n), g16(n), ext(n), m(n), v(n), ms(n / kQ8GroupElems), vs(n / kQ8GroupElems), p32(n), m32(n),
        v32(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 0.02f);
    for (size_t i = 0; i < n; ++i) p32[i] = nd(rng);
    q8_encode_master(p32.data(), hi.data(), ext.data(), n);
    q8_decode_master(hi.data(), ext.data(), p32.data(), n);  // the fp32 twin starts from the same weights
  }
  void grads(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1e-3f);
    for (size_t i = 0; i < n; ++i) g16[i] = float_to_bf16((i % 53 == 0) ? 0.0f : nd(rng) * (1.0f + float(i % 7)));
  }
  Q8Args args(int64_t step, uint32_t block = 3) {
    return {{hi.data(), ext.data(), m.data(), ms.data(), v.data(), vs.data()}, g16.data(), DType::kBF16, n, 0,
            q8_salt(step, block)};
  }
  std::vector<float> master() const {
    std::vector<float> out(n);
    q8_decode_master(hi.data(), ext.data(), out.data(), n);
    return out;
  }
  bool same_bits(const Twin& o) const {
    auto eq = [](const auto& a, const auto& b) { return std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0; };
    return eq(hi, o.hi) && eq(ext, o.ext) && eq(m, o.m) && eq(v, o.v) && eq(ms, o.ms) && eq(vs, o.vs);
  }
};

// Every distinct build of the q8 kernel this CPU runs, the scalar loops
// first: each ISA's loops, the hand-written kernel, and on AVX-512 both the
// base kernel and the one with VBMI's byte permutations. What the CPU lacks is
// said (WARN) and skipped.
struct Build {
  Isa isa;
  Q8Build build;
};
std::vector<Build> q8_builds() {
  std::vector<Build> out;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!isa_supported(isa)) {
      WARN("this CPU lacks " << isa_name(isa) << ": its q8 kernels are not compared here");
      continue;
    }
    out.push_back({isa, Q8Build::kLoops});
    if (isa == Isa::kScalar) continue;  // the scalar ISA has only the loops
    out.push_back({isa, Q8Build::kSimdNoVbmi});
    if (isa != Isa::kAvx512) continue;
    if (q8_kernel_name(isa, Q8Build::kSimd) != q8_kernel_name(isa, Q8Build::kSimdNoVbmi))
      out.push_back({isa, Q8Build::kSimd});
    else
      WARN("this CPU lacks AVX-512 VBMI: the q8 kernel that uses it is not compared here");
  }
  return out;
}

}  // namespace

TEST_CASE("q8 format: bytes per element, names, and the plan's figure", "[host][q8]") {
  CHECK(state_kind_bytes(StateFormat::kFp32, StateKind::kAdamM, 100) == 400);
  CHECK(state_kind_bytes(StateFormat::kQ8, StateKind::kMaster, 256) == 256);
  CHECK(state_kind_bytes(StateFormat::kQ8, StateKind::kAdamV, 256) == 256 + 8);
  CHECK_THROWS_WITH(state_kind_bytes(StateFormat::kQ8, StateKind::kAdamV, 100), Catch::Contains("groups of 128"));
  CHECK(state_bytes_per_elem(StateFormat::kQ8) == Approx(3.0625));
  CHECK(parse_state_format("q8") == StateFormat::kQ8);
  CHECK_THROWS_WITH(parse_state_format("int4"), Catch::Contains("'int4' is not one of fp32, q8"));
}

TEST_CASE("q8 master: 16 significant bits, the compute copy its nearest bf16, exact round trips", "[host][q8]") {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const size_t n = 4096;
  std::vector<float> x(n), back(n), again(n);
  for (auto& f : x) f = nd(rng) * std::pow(10.0f, float(int(rng() % 9)) - 4.0f);
  x[0] = 0.0f;
  x[1] = -0.0f;
  std::vector<uint16_t> hi(n), hi2(n);
  std::vector<uint8_t> ext(n), ext2(n);
  q8_encode_master(x.data(), hi.data(), ext.data(), n);
  q8_decode_master(hi.data(), ext.data(), back.data(), n);
  for (size_t i = 0; i < n; ++i) {
    INFO("element " << i << " = " << x[i]);
    REQUIRE(std::fabs(back[i] - x[i]) <= std::fabs(x[i]) * 0x1p-16f);
    // The compute copy is the decoded master rounded to bf16 (ties up: ties to even where it differs).
    uint32_t b;
    std::memcpy(&b, &back[i], 4);
    if ((b & 0xFFFF) != 0x8000) REQUIRE(hi[i] == float_to_bf16(back[i]));
  }
  // A decoded master encodes to itself: a checkpoint's floats reload to the same bits.
  q8_encode_master(back.data(), hi2.data(), ext2.data(), n);
  CHECK(hi == hi2);
  CHECK(ext == ext2);
}

TEST_CASE("q8 moments: within one code step, scale kept, decode then encode gives the same codes", "[host][q8]") {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const size_t n = 128 * 40;
  std::vector<float> m(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    const float mag = std::pow(10.0f, float(int(i / 128 % 10)) - 8.0f);  // every group its own range
    m[i] = nd(rng) * mag * float(1 + i % 13);
    v[i] = m[i] * m[i] * 3.0f;
  }
  std::fill(m.begin() + 256, m.begin() + 384, 0.0f);  // an all-zero group
  std::fill(v.begin() + 256, v.begin() + 384, 0.0f);
  for (StateKind kind : {StateKind::kAdamM, StateKind::kAdamV}) {
    const std::vector<float>& x = kind == StateKind::kAdamM ? m : v;
    std::vector<uint8_t> codes(n), codes2(n);
    std::vector<float> scales(n / 128), scales2(n / 128), back(n);
    q8_encode_moment(kind, x.data(), codes.data(), scales.data(), n);
    q8_decode_moment(kind, codes.data(), scales.data(), back.data(), n);
    for (size_t i = 0; i < n; ++i) {
      INFO((kind == StateKind::kAdamM ? "m" : "v") << "[" << i << "] = " << x[i] << " decoded " << back[i]);
      const float s = scales[i / 128];
      if (kind == StateKind::kAdamM) {
        // 3 mantissa bits: half a step is 1/16 relative; below 2^-14 of the scale, half of 2^-17.
        REQUIRE(std::fabs(back[i] - x[i]) <= std::max(std::fabs(x[i]) / 16, s * 0x1p-18f) * 1.0001f);
      } else {
        // 4 mantissa bits of sqrt(v); a nonzero v never decodes to zero.
        const float r = std::sqrt(x[i]), rb = std::sqrt(back[i]);
        REQUIRE(std::fabs(rb - r) <= std::max(r / 32, s * 0x1p-19f) * 1.0001f);
        if (x[i] > 0) REQUIRE(back[i] > 0);
      }
    }
    q8_encode_moment(kind, back.data(), codes2.data(), scales2.data(), n);
    CHECK(codes == codes2);
    CHECK(scales == scales2);
  }
  std::vector<float> neg(128, 1.0f);
  neg[5] = -1.0f;
  std::vector<uint8_t> c(128);
  std::vector<float> s(1);
  CHECK_THROWS_WITH(q8_encode_moment(StateKind::kAdamV, neg.data(), c.data(), s.data(), 128),
                    Catch::Contains("v[5] = -1 is negative"));
}

TEST_CASE("q8 AdamW tracks the fp32 kernel, keeps padding zero, and is independent of chunks and threads",
          "[host][q8]") {
  const size_t n = 128 * 1024 + 128 * 3;
  Twin a(n, 1);
  const size_t pad0 = 1000;  // a stretch of padding: zero weights and zero gradients
  for (size_t i = pad0; i < pad0 + 300; ++i) a.p32[i] = 0.0f;
  q8_encode_master(a.p32.data(), a.hi.data(), a.ext.data(), n);
  Twin b = a, c = a;
  AdamHyper h{.lr = 1e-4, .weight_decay = 0.1};
  CpuAdam one(CpuAdam::Options{.threads = 1, .chunk_elems = 128});
  CpuAdam two(CpuAdam::Options{.threads = 2, .chunk_elems = size_t{1} << 16});
  for (int64_t step = 1; step <= 30; ++step) {
    a.grads(uint32_t(step));
    for (size_t i = pad0; i < pad0 + 300; ++i) a.g16[i] = 0;
    b.g16 = a.g16;
    c.g16 = a.g16;
    const AdamStep st = AdamStep::make(h, step);
    adam_q8_update(Isa::kScalar, st, a.args(step));
    one.step_q8(st, b.args(step));
    // Two calls over halves, as two pieces of a block would be updated.
    Q8Args lo = c.args(step), hi = lo;
    const size_t half = 128 * 517;
    lo.n = half;
    hi.state = {c.hi.data() + half, c.ext.data() + half, c.m.data() + half, c.ms.data() + half / 128,
                c.v.data() + half, c.vs.data() + half / 128};
    hi.grad = c.g16.data() + half;
    hi.n = n - half;
    hi.first_elem = uint32_t(half);
    two.step_q8(st, hi);
    two.step_q8(st, lo);
    // The fp32 reference on the same gradients.
    std::vector<uint16_t> out(n);
    AdamArgs fa{a.p32.data(), a.m32.data(), a.v32.data(), a.g16.data(), DType::kBF16, out.data(), n};
    adam_update(Isa::kScalar, st, fa);
  }
  CHECK(a.same_bits(b));
  CHECK(a.same_bits(c));
  const std::vector<float> q = a.master();
  double max_rel = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i >= pad0 && i < pad0 + 300) {
      REQUIRE(q[i] == 0.0f);
      REQUIRE(a.m[i] == 0);
      REQUIRE(a.v[i] == 0);
      continue;
    }
    // 30 steps of lr 1e-4 move each weight ~3e-3; q8 must land within a small fraction of that.
    max_rel = std::max(max_rel, std::fabs(double(q[i]) - a.p32[i]) / 3e-3);
  }
  INFO("largest q8 - fp32 master difference, relative to 30 steps' movement: " << max_rel);
  CHECK(max_rel < 0.25);
  // Another step's salt gives other bits (the rounding is stochastic).
  Twin d = a, e = a;
  const AdamStep st = AdamStep::make(h, 31);
  adam_q8_update(Isa::kScalar, st, d.args(31));
  adam_q8_update(Isa::kScalar, st, e.args(32));
  CHECK_FALSE(d.same_bits(e));
}

TEST_CASE("q8 AdamW: every ISA's builds give the scalar build's bits", "[host][q8]") {
  // The hand-written AVX2 and AVX-512 kernels (AVX-512 with and without VBMI)
  // and the compiler-vectorized loops they replaced, over groups that hit every code path: zero groups,
  // subnormal-range codes, Adam and AdamW, with and without decay, fp32
  // gradients that bf16 cannot represent, and a first element that is not 0.
  const size_t n = 128 * 300;
  for (DType gd : {DType::kBF16, DType::kF32}) {
    Twin ref(n, 9);
    std::vector<float> g32(n);
    for (const auto [isa, build] : q8_builds()) {
      INFO(q8_kernel_name(isa, build) << " gradients " << dtype_name(gd));
      Twin t(n, 9);
      for (int64_t step = 1; step <= 6; ++step) {
        t.grads(uint32_t(step) * 7);
        for (size_t i = 0; i < n; ++i) g32[i] = bf16_to_float(t.g16[i]) * 1.37f;  // not bf16-representable
        Q8Args a = t.args(step);
        a.first_elem = 1000 * uint32_t(step);
        if (gd == DType::kF32) {
          a.grad = g32.data();
          a.grad_dtype = DType::kF32;
        }
        const AdamHyper h{.lr = 3e-3, .weight_decay = step % 2 ? 0.1 : 0.0,
                          .mode = step % 3 ? AdamMode::kAdamW : AdamMode::kAdam};
        adam_q8_update(isa, AdamStep::make(h, step, 0.7), a, build);
      }
      if (isa == Isa::kScalar) ref = t;
      else CHECK(t.same_bits(ref));
    }
  }
}

// The hand-written kernels encode the moments of a group whose scale is a
// normal number at most 2^14 through a product scaled by 2^-112 and one
// masked multiply, and every other group as the loops do
// (host/adam_q8_simd.h). With beta1 = beta2 = 0 the new m is the gradient
// and sqrt(v) its magnitude, so each group below puts its moments on one of
// those paths, including the element whose y lies just below 2^-14 while the
// scaled product rounds up to 2^-126: its code differs from the normal
// formula's only where its random slice is 0, so the first element's index
// is chosen to make it so for both moments' edge elements.
TEST_CASE("q8 AdamW: groups on every path of the hand-written encode give the scalar build's bits", "[host][q8]") {
  constexpr size_t G = kQ8GroupElems;
  std::vector<float> g(G * 9);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& x : g) x = nd(rng) * 1e-3f;                                 // group 0: the common path
  for (size_t i = G; i < 2 * G; ++i) g[i] = nd(rng) * 1e5f;               // 1: scales above 2^14
  g[2 * G + 3] = std::nanf("");                                           // 2: NaN, both signs
  g[2 * G + 9] = -std::nanf("");
  g[3 * G + 7] = INFINITY;                                                // 3: an infinity
  for (size_t i = 4 * G; i < 5 * G; ++i) g[i] = 0.0f;                    // 4: zeros
  for (size_t i = 5 * G; i < 6 * G; ++i) g[i] = nd(rng) * 1e-40f;         // 5: subnormal
  for (size_t i = 6 * G; i < 7 * G; i += 3) g[i] = nd(rng) * 1e-9f;       // 6: codes below 2^-14 of the scale
  for (size_t i = 7 * G; i < 9 * G; ++i) g[i] = nd(rng) * 0.1f;           // 7, 8: scale 3, an element at the edge
  const float inv = 1.0f / 3.0f;
  const auto on_edge = [&](float root) {  // y = RN(root * inv) < 2^-14 <= RN(root * inv * 2^-112)
    const double z = double(root) * double(inv);
    return z >= 0x1p-14 - 0x1p-38 && z < 0x1p-14 - 0x1p-39;
  };
  float m_edge = 0, v_edge = 0;
  for (float x = 3 * 0x1p-14f; x > 2.9f * 0x1p-14f && (m_edge == 0 || v_edge == 0); x = std::nextafter(x, 0.0f)) {
    if (m_edge == 0 && on_edge(x)) m_edge = x;
    if (v_edge == 0 && on_edge(std::sqrt(x * x))) v_edge = x;
  }
  REQUIRE(m_edge != 0);
  REQUIRE(v_edge != 0);
  g[7 * G] = 3.0f;
  g[7 * G + 1] = -m_edge;
  g[8 * G] = -3.0f;
  g[8 * G + 1] = v_edge;
  const size_t n = g.size();
  const uint32_t salt = q8_salt(1, 3);  // Twin::args(1)'s
  uint32_t first = 0;
  while (((detail::element_hash(first + uint32_t(7 * G + 1), salt) >> 8) & 0xFFFu) != 0 ||
         (detail::element_hash(first + uint32_t(8 * G + 1), salt) >> 20) != 0)
    ++first;
  std::vector<Twin> runs;
  for (const auto [isa, build] : q8_builds()) {
    INFO(q8_kernel_name(isa, build));
    Twin t(n, 3);
    Q8Args a = t.args(1);
    a.first_elem = first;
    a.grad = g.data();
    a.grad_dtype = DType::kF32;
    adam_q8_update(isa, AdamStep::make(AdamHyper{.lr = 1e-3, .beta1 = 0.0, .beta2 = 0.0}, 1), a, build);
    if (!runs.empty()) CHECK(t.same_bits(runs.front()));
    runs.push_back(t);
  }
  // The groups took the paths meant: scales above 2^14, NaN, infinite, 0
  // and subnormal; an m code in the subnormal steps (group 6); the edge
  // elements coded as the loops code them, below 2^-14 of the scale.
  const Twin& r = runs.front();
  CHECK((r.ms[0] > 0 && r.ms[0] < 1));
  CHECK(r.ms[1] > 0x1p14f);
  CHECK(std::isnan(r.ms[2]));
  CHECK(std::isinf(r.ms[3]));
  CHECK(r.ms[4] == 0);
  CHECK((r.ms[5] > 0 && r.ms[5] < 0x1p-126f));
  bool small_m = false;
  for (size_t i = 6 * G; i < 7 * G; ++i) small_m = small_m || ((r.m[i] & 0x7F) > 0 && (r.m[i] & 0x7F) < 8);
  CHECK(small_m);
  CHECK(r.ms[7] == 3.0f);
  CHECK(r.vs[8] == 3.0f);
  CHECK((r.m[7 * G + 1] & 0x7F) <= 8);
  CHECK(r.v[8 * G + 1] <= 16);
}

TEST_CASE("q8 AdamW: with denormals-are-zero and flush-to-zero set, every build still agrees", "[host][q8]") {
  // torch.set_flush_denormal(True) sets both MXCSR bits in the process; the
  // hand-written kernels decode codes through fp16 subnormals, which must not
  // read as zero then. Tiny gradients put moments in the codes' subnormal steps.
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved | 0x8040);  // FTZ | DAZ
  const size_t n = 128 * 64;
  std::vector<Twin> runs;
  for (const auto [isa, build] : q8_builds()) {
    Twin t(n, 4);
    for (int64_t step = 1; step <= 4; ++step) {
      t.grads(uint32_t(step));
      for (size_t i = 0; i < n; ++i)
        if (i % 3 == 0) t.g16[i] = float_to_bf16(bf16_to_float(t.g16[i]) * 1e-6f);
      adam_q8_update(isa, AdamStep::make(AdamHyper{.lr = 1e-3}, step), t.args(step), build);
    }
    runs.push_back(t);
  }
  _mm_setcsr(saved);
  for (const Twin& t : runs) CHECK(t.same_bits(runs.front()));
  size_t small_m = 0, small_v = 0;  // codes in the subnormal steps: the case under test happened
  for (size_t i = 0; i < n; ++i) {
    small_m += (runs.front().m[i] & 0x7F) > 0 && (runs.front().m[i] & 0x7F) < 8;
    small_v += runs.front().v[i] > 0 && runs.front().v[i] < 16;
  }
  CHECK(small_m > 0);
  CHECK(small_v > 0);
}

TEST_CASE("q8 AdamW: updates far below the master's last bit still move it, without bias", "[host][q8]") {
  // lr such that each update is ~1/20 of the extension's last bit: nearest
  // rounding would never move the weights; stochastic rounding moves them by
  // the right amount on average.
  const size_t n = 128 * 64;
  Twin a(n, 5);
  for (size_t i = 0; i < n; ++i) a.p32[i] = 1.0f;
  q8_encode_master(a.p32.data(), a.hi.data(), a.ext.data(), n);
  std::vector<float> ref(n, 1.0f);
  AdamHyper h{.lr = 0x1p-16 / 20, .weight_decay = 0.0};
  for (int64_t step = 1; step <= 200; ++step) {
    for (size_t i = 0; i < n; ++i) a.g16[i] = float_to_bf16(1e-3f);  // Adam's step is ~lr each time
    const AdamStep st = AdamStep::make(h, step);
    adam_q8_update(Isa::kScalar, st, a.args(step));
  }
  const std::vector<float> q = a.master();
  double mean_move = 0;
  for (float x : q) mean_move += 1.0 - double(x);
  mean_move /= double(n);
  const double expected = 200 * h.lr;  // |m / sqrt(v)| = 1 for a constant gradient
  INFO("mean movement " << mean_move << " expected " << expected);
  CHECK(mean_move == Approx(expected).epsilon(0.05));
}
