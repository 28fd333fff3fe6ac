// engine/collectives: the solo world, and c10d's Gloo with one rank per thread
// over a shared in-memory store (torchrun's environment is tested by
// tests/python/test_collectives_torchrun.py, with processes).
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "tests/catch_torch.h"

#include <atomic>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "engine/run/collectives.h"
#include "host/error.h"

using namespace strider;
using namespace std::chrono_literals;

namespace {

// body(rank, collectives) on `world` threads, one rank each, over one store;
// what a thread throws is kept per rank.
std::vector<std::string> on_ranks(int world, std::chrono::milliseconds timeout,
                                  const std::function<void(int, Collectives&)>& body) {
  static std::atomic<int> run{0};  // each call its own keys in the store
  auto store = c10::make_intrusive<c10d::PrefixStore>("run" + std::to_string(run++),
                                                      c10::make_intrusive<c10d::HashStore>());
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        auto c = c10d_collectives(store, {.rank = r, .world = world, .local_rank = r, .local_world = world}, timeout);
        body(r, *c);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace

TEST_CASE("solo collectives pass sums and decisions through and copy slices", "[dist]") {
  auto c = solo_collectives();
  CHECK(c->ranks().solo());
  std::vector<double> x{1.5, -2};
  c->all_reduce_sum(x);
  CHECK(x == std::vector<double>({1.5, -2}));
  std::vector<float> in{1, 2, 3}, out(3);
  c->reduce_scatter_sum(in, out);
  CHECK(out == in);
  CHECK(c->any(true));
  CHECK_FALSE(c->any(false));
  std::vector<float> small(2);
  CHECK_THROWS_WITH(c->reduce_scatter_sum(in, small), Catch::Contains("3 floats in for a slice of 2"));
}

TEST_CASE("c10d collectives give rank-ordered exact sums and slices where they belong and one decision", "[dist]") {
  if (!have_c10d_gloo()) {
    WARN("skipped: this build has no c10d Gloo (no gloo headers)");
    return;
  }
  const int world = GENERATE(2, 3);
  CAPTURE(world);
  constexpr size_t kSlice = 5;
  std::vector<std::vector<double>> sums(world);
  std::vector<std::vector<float>> slices(world);
  std::vector<std::vector<std::byte>> gathered(world);
  std::vector<int> any_one(world), any_none(world);
  std::vector<int64_t> tokens(world);
  std::vector<std::vector<float>> grads(world), side_sums(world);
  std::vector<int> rank_of(world, -1);
  const auto errors = on_ranks(world, 30s, [&](int r, Collectives& c) {
    rank_of[r] = c.ranks().rank;  // (Catch2's assertions are for the main thread only)
    // Order matters for these: (1e16 + 1) - 1e16 is 0 in doubles, 1e16 + (1 - 1e16) is not.
    const double vals[] = {1e16, 1.0, -1e16};
    std::vector<double> x{vals[r], 0.1 * (r + 1)};
    c.all_reduce_sum(x);
    sums[r] = x;
    int64_t t = 1000 + r;
    c.all_reduce_sum(std::span<int64_t>(&t, 1));
    tokens[r] = t;
    std::vector<float> in(kSlice * world), out(kSlice);
    for (size_t i = 0; i < in.size(); ++i) in[i] = float((r + 1) * 1000 + i);
    c.reduce_scatter_sum(in, out);
    slices[r] = out;
    std::vector<std::byte> mine(3, std::byte(r + 1)), all(3 * world);
    c.all_gather(mine, all);
    gathered[r] = all;
    // Gradients: 7 floats (no whole slices) summed on the main channel while
    // another thread sums on a split one.
    auto side = c.split("side");
    std::vector<float> g(7), h{float(r), 1.0f};
    for (size_t i = 0; i < g.size(); ++i) g[i] = 0.5f * float(i) + float(r);
    std::thread other([&] { side->all_reduce_sum(h); });
    c.all_reduce_sum(g);
    other.join();
    grads[r] = g;
    side_sums[r] = h;
    any_one[r] = c.any(r == world - 1);
    any_none[r] = c.any(false);
    c.barrier();
  });
  for (int r = 0; r < world; ++r) REQUIRE(errors[r].empty());
  double expect0 = 0, expect1 = 0;
  const double vals[] = {1e16, 1.0, -1e16};
  for (int r = 0; r < world; ++r) {
    expect0 += vals[r];
    expect1 += 0.1 * (r + 1);
  }
  int64_t expect_tokens = 0;
  for (int r = 0; r < world; ++r) expect_tokens += 1000 + r;
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(rank_of[r] == r);
    // Bit-identical on every rank, and the rank-order sum.
    CHECK(std::memcmp(sums[r].data(), sums[0].data(), 2 * sizeof(double)) == 0);
    CHECK(sums[r][0] == expect0);
    CHECK(sums[r][1] == expect1);
    CHECK(tokens[r] == expect_tokens);
    for (size_t i = 0; i < kSlice; ++i) {
      float e = 0;
      for (int s = 0; s < world; ++s) e += float((s + 1) * 1000 + r * kSlice + i);
      CHECK(slices[r][i] == e);
    }
    for (int s = 0; s < world; ++s)
      for (int k = 0; k < 3; ++k) CHECK(gathered[r][s * 3 + k] == std::byte(s + 1));
    for (size_t i = 0; i < 7; ++i) {
      float e = 0;
      for (int s = 0; s < world; ++s) e += 0.5f * float(i) + float(s);
      CHECK(grads[r][i] == e);  // small integers and halves: exact in any order
    }
    CHECK(std::memcmp(grads[r].data(), grads[0].data(), 7 * sizeof(float)) == 0);
    CHECK(side_sums[r] == std::vector<float>({float(world * (world - 1) / 2), float(world)}));
    CHECK(any_one[r] == 1);
    CHECK(any_none[r] == 0);
  }
}

TEST_CASE("uneven slices: each rank sums its own slice in rank order and gathers the others", "[dist]") {
  auto solo = solo_collectives();
  std::vector<float> x{1, 2};
  const std::vector<size_t> one{0, 2}, bad{0, 1};
  solo->reduce_scatter_sum(x, one);
  CHECK(x == std::vector<float>({1, 2}));
  CHECK_THROWS_WITH(solo->reduce_scatter_sum(x, bad), Catch::Contains("do not cut 2 elements into 1 slices"));
  if (!have_c10d_gloo()) {
    WARN("skipped: this build has no c10d Gloo (no gloo headers)");
    return;
  }
  // 3 ranks, 10 elements: slices of 4, 0 and 6 (an empty one, as a small
  // piece's last ranks get). Values where the order of the additions shows:
  // 1e8 + 1 - 1e8 is 0 in floats, added in rank order.
  const int world = 3;
  const std::vector<size_t> bounds{0, 4, 4, 10};
  std::vector<std::vector<float>> sums(world);
  std::vector<std::vector<std::byte>> gathered(world);
  const float vals[] = {1e8f, 1.0f, -1e8f};
  const auto errors = on_ranks(world, 30s, [&](int r, Collectives& c) {
    std::vector<float> g(10);
    for (size_t i = 0; i < g.size(); ++i) g[i] = vals[r] + float(i % 2);
    c.reduce_scatter_sum(g, bounds);
    sums[r] = g;
    std::vector<std::byte> bytes(10, std::byte(0xEE));
    for (size_t i = bounds[size_t(r)]; i < bounds[size_t(r) + 1]; ++i) bytes[i] = std::byte(r + 1);
    c.all_gather(bytes, bounds);
    gathered[r] = bytes;
  });
  for (int r = 0; r < world; ++r) REQUIRE(errors[r].empty());
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    for (size_t i = 0; i < 10; ++i) {
      const bool mine = i >= bounds[size_t(r)] && i < bounds[size_t(r) + 1];
      float e = vals[0] + float(i % 2);
      for (int s = 1; s < world; ++s) e += vals[s] + float(i % 2);
      CHECK(sums[r][i] == (mine ? e : vals[r] + float(i % 2)));  // elsewhere: as it was
      CHECK(gathered[r][i] == std::byte(i < 4 ? 1 : 3));
    }
  }
}

TEST_CASE("c10d collectives name a rank that never arrives", "[dist]") {
  if (!have_c10d_gloo()) {
    WARN("skipped: this build has no c10d Gloo (no gloo headers)");
    return;
  }
  // "hangs": the last rank holds its connections open but never enters the
  // second collective, so the others time out; "dies": it leaves (its
  // connections close), so the others fail at once.
  const bool hangs = GENERATE(true, false);
  CAPTURE(hangs);
  constexpr int kWorld = 3;
  std::atomic<int> failed{0};
  const auto t0 = std::chrono::steady_clock::now();
  const auto errors = on_ranks(kWorld, 2s, [&](int r, Collectives& c) {
    double x = 1;
    c.all_reduce_sum(std::span<double>(&x, 1));
    if (r == kWorld - 1) {
      if (hangs)
        while (failed.load() < kWorld - 1) std::this_thread::sleep_for(10ms);
      return;
    }
    try {
      c.all_reduce_sum(std::span<double>(&x, 1));
    } catch (...) {
      ++failed;
      throw;
    }
  });
  const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(errors[kWorld - 1].empty());
  for (int r = 0; r < kWorld - 1; ++r) {
    CAPTURE(r, errors[r]);
    CHECK_THAT(errors[r], Catch::Contains(fmt::format("rank {} of 3: all_reduce_sum (collective #2 on channel main, timeout 2000 ms) failed (", r)));
    CHECK_THAT(errors[r], Catch::Contains("Never reached it: rank 2 (at #1)"));
  }
  CHECK(waited_s < 30);  // the 2 s timeout, not a hang
}

TEST_CASE("ranks that are not a world are refused", "[dist]") {
  auto store = c10::make_intrusive<c10d::HashStore>();
  CHECK_THROWS_WITH(c10d_collectives(store, {.rank = 2, .world = 2}, 1s),
                    Catch::Contains("rank 2 of 2 (local 0 of 1) is not a rank of that world"));
  CHECK(c10d_collectives(store, {}, 1s)->ranks().solo());
}
