#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

#include "host/bf16.h"
#include "host/cpu_adam.h"
#include "host/error.h"
#include "host/half.h"

using namespace strider;

namespace {

// One optimizer's state over n elements, filled from a seed.
struct State {
  std::vector<float> p, m, v, g32;
  std::vector<uint16_t> g16, out;
  explicit State(size_t n, uint32_t seed) : p(n), m(n), v(n), g32(n), g16(n), out(n, 0xdead) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (size_t i = 0; i < n; ++i) {
      p[i] = nd(rng);
      g32[i] = (i % 97 == 0) ? 0.0f : nd(rng) * 1e-2f;  // exact zeros too
      g16[i] = float_to_bf16(g32[i]);
    }
  }
  AdamArgs args(DType gd, bool with_out) {
    return {p.data(), m.data(), v.data(),
            gd == DType::kBF16 ? static_cast<const void*>(g16.data()) : g32.data(), gd,
            with_out ? out.data() : nullptr, p.size()};
  }
  bool same_bits(const State& o) const {
    auto eq = [](const auto& a, const auto& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
    };
    return eq(p, o.p) && eq(m, o.m) && eq(v, o.v) && eq(out, o.out);
  }
};

std::vector<Isa> simd_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512})
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

}  // namespace

TEST_CASE("every SIMD kernel is bit-identical to the scalar reference", "[host][adam]") {
  const auto isas = simd_isas();
  if (isas.empty()) WARN("this CPU has neither AVX2 nor AVX-512: only the scalar path exists");
  AdamHyper h{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  for (size_t n : {size_t{1}, size_t{7}, size_t{22}, size_t{1023}, (size_t{1} << 20) + 3}) {
    for (DType gd : {DType::kBF16, DType::kF32}) {
      for (AdamMode mode : {AdamMode::kAdamW, AdamMode::kAdam}) {
        for (bool with_out : {true, false}) {
          h.mode = mode;
          State ref(n, 42);
          std::vector<State> simd(isas.size(), ref);
          for (int step = 1; step <= 3; ++step) {
            AdamStep s = AdamStep::make(h, step, step == 2 ? 0.37 : 1.0);
            adam_update(Isa::kScalar, s, ref.args(gd, with_out));
            for (size_t k = 0; k < isas.size(); ++k) adam_update(isas[k], s, simd[k].args(gd, with_out));
          }
          for (size_t k = 0; k < isas.size(); ++k) {
            INFO("n=" << n << " isa=" << isa_name(isas[k]) << " grad=" << dtype_name(gd)
                      << " adamw=" << (mode == AdamMode::kAdamW) << " out=" << with_out);
            CHECK(simd[k].same_bits(ref));
          }
          if (with_out) {
            for (size_t i = 0; i < n; i += 1 + n / 50) REQUIRE(ref.out[i] == float_to_bf16(ref.p[i]));
          } else {
            REQUIRE(ref.out[0] == 0xdead);  // untouched without an output
          }
        }
      }
    }
  }
}

TEST_CASE("an fp16 compute copy: every SIMD kernel writes the scalar reference's bits", "[host][adam]") {
  // The SIMD kernels round with F16C's vcvtps2ph, the scalar one with the
  // compiler's _Float16: two implementations of IEEE round-to-nearest-even.
  // Parameters from 2^-30 to 2^17 in magnitude cover fp16's subnormals, its
  // underflow to zero and its overflow to Inf past 65504.
  const auto isas = simd_isas();
  if (isas.empty()) WARN("this CPU has neither AVX2 nor AVX-512: only the scalar path exists");
  const AdamHyper h{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  for (size_t n : {size_t{5}, size_t{1023}, (size_t{1} << 16) + 9}) {
    for (DType gd : {DType::kBF16, DType::kF32}) {
      State ref(n, 9);
      for (size_t i = 0; i < n; ++i) ref.p[i] = std::ldexp(ref.p[i], int(i % 48) - 30);
      std::vector<State> simd(isas.size(), ref);
      auto args = [&](State& s) {
        AdamArgs a = s.args(gd, true);
        a.compute_dtype = DType::kF16;
        return a;
      };
      for (int step = 1; step <= 2; ++step) {
        const AdamStep s = AdamStep::make(h, step);
        adam_update(Isa::kScalar, s, args(ref));
        for (size_t k = 0; k < isas.size(); ++k) adam_update(isas[k], s, args(simd[k]));
      }
      for (size_t k = 0; k < isas.size(); ++k) {
        INFO("n=" << n << " isa=" << isa_name(isas[k]) << " grad=" << dtype_name(gd));
        CHECK(simd[k].same_bits(ref));
      }
      size_t inf = 0, subnormal = 0;
      for (size_t i = 0; i < n; ++i) {
        REQUIRE(ref.out[i] == float_to_f16(ref.p[i]));
        inf += (ref.out[i] & 0x7fff) == 0x7c00;
        subnormal += (ref.out[i] & 0x7c00) == 0 && (ref.out[i] & 0x3ff) != 0;
      }
      if (n > 1000) {
        CHECK(inf > 0);
        CHECK(subnormal > 0);
      }
    }
  }
}

TEST_CASE("the update moves parameters the way Adam does", "[host][adam]") {
  // After one step with no decay, every element moves by lr against the sign
  // of its gradient (|m_hat / sqrt(v_hat)| == 1 at step 1), up to eps.
  State s(1000, 7);
  std::vector<float> before = s.p;
  AdamHyper h{.lr = 1e-2, .weight_decay = 0.0};
  adam_update(detect_isa(), AdamStep::make(h, 1), s.args(DType::kF32, true));
  for (size_t i = 0; i < s.p.size(); ++i) {
    const float g = s.g32[i];
    const float moved = s.p[i] - before[i];
    if (g == 0.0f) REQUIRE(moved == 0.0f);
    else REQUIRE(moved == Approx(g > 0 ? -1e-2f : 1e-2f).margin(1e-7).epsilon(1e-3));
  }
}

TEST_CASE("CpuAdam's threaded chunks give the kernel's bits and report every chunk once", "[host][adam]") {
  const size_t n = (size_t{1} << 18) + 5;
  AdamHyper h{.lr = 1e-3};
  for (int threads : {1, 2}) {
    for (size_t chunk : {size_t{16}, size_t{4096}, size_t{1} << 16}) {
      State ref(n, 3), par(n, 3);
      CpuAdam adam({.threads = threads, .chunk_elems = chunk});
      std::mutex mu;
      std::vector<std::pair<size_t, size_t>> done;
      for (int step = 1; step <= 2; ++step) {
        AdamStep s = AdamStep::make(h, step);
        adam_update(Isa::kScalar, s, ref.args(DType::kBF16, true));
        done.clear();
        adam.step(s, par.args(DType::kBF16, true), [&](size_t b, size_t e) {
          // The chunk's bf16 copy is final when the callback runs.
          for (size_t i = b; i < e; ++i)
            if (par.out[i] != float_to_bf16(par.p[i])) FAIL("chunk reported before written");
          std::lock_guard lk(mu);
          done.emplace_back(b, e);
        });
      }
      INFO("threads=" << threads << " chunk=" << chunk);
      CHECK(par.same_bits(ref));
      std::sort(done.begin(), done.end());
      REQUIRE(done.size() == (n + chunk - 1) / chunk);
      size_t expect = 0;
      for (auto [b, e] : done) {
        REQUIRE(b == expect);
        REQUIRE(e > b);
        expect = e;
      }
      CHECK(expect == n);
    }
  }
}

TEST_CASE("bad optimizer inputs fail with what was wrong", "[host][adam]") {
  State s(8, 1);
  AdamArgs a = s.args(DType::kF32, true);
  a.grad_dtype = DType::kF16;
  CHECK_THROWS_WITH(adam_update(Isa::kScalar, AdamStep::make({}, 1), a),
                    Catch::Contains("F16") && Catch::Contains("BF16"));
  a.grad_dtype = DType::kF32;
  a.compute_dtype = DType::kF32;
  CHECK_THROWS_WITH(adam_update(Isa::kScalar, AdamStep::make({}, 1), a),
                    Catch::Contains("output dtype F32") && Catch::Contains("the compute copy BF16 or F16"));
  CHECK_THROWS_WITH(AdamStep::make({}, 0), Catch::Contains("step 0"));
  CHECK_THROWS_WITH(AdamStep::make({.beta1 = 1.0}, 1), Catch::Contains("betas"));
  CHECK_THROWS_WITH(CpuAdam({.threads = 1, .chunk_elems = 10}), Catch::Contains("chunk_elems 10"));
}
