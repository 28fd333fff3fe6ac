// Collectives over c10d: the solo world and Gloo (the ranks' rendezvous, from
// torchrun's environment or a store of our own, is engine/run/ranks_store.cpp).
#include "engine/run/collectives.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <type_traits>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "host/error.h"

#ifdef STRIDER_HAVE_C10D_GLOO
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

namespace strider {
namespace {

[[maybe_unused]] std::string first_line(std::string_view s) { return std::string(s.substr(0, s.find('\n'))); }

void check_bounds(std::span<const size_t> bounds, size_t size, int world, const char* op) {
  STRIDER_CHECK(bounds.size() == size_t(world) + 1 && bounds.front() == 0 && bounds.back() == size &&
                    std::is_sorted(bounds.begin(), bounds.end()),
                "{}: slice bounds [{}] do not cut {} elements into {} slices", op, fmt::join(bounds, ", "), size,
                world);
}

class Solo final : public Collectives {
 public:
  const RankInfo& ranks() const override { return info_; }
  void all_reduce_sum(std::span<double>) override {}
  void all_reduce_sum(std::span<int64_t>) override {}
  void all_reduce_sum(std::span<float>) override {}
  void reduce_scatter_sum(std::span<const float> in, std::span<float> out) override {
    STRIDER_CHECK(in.size() == out.size(), "reduce_scatter_sum: {} floats in for a slice of {} in a world of 1",
                  in.size(), out.size());
    std::copy(in.begin(), in.end(), out.begin());
  }
  void all_gather(std::span<const std::byte> in, std::span<std::byte> out) override {
    STRIDER_CHECK(in.size() == out.size(), "all_gather: {} bytes out for a slice of {} in a world of 1", out.size(),
                  in.size());
    std::copy(in.begin(), in.end(), out.begin());
  }
  void reduce_scatter_sum(std::span<float> x, std::span<const size_t> bounds) override {
    check_bounds(bounds, x.size(), 1, "reduce_scatter_sum");
  }
  void all_gather(std::span<std::byte> x, std::span<const size_t> bounds) override {
    check_bounds(bounds, x.size(), 1, "all_gather");
  }
  bool any(bool flag) override { return flag; }
  void barrier() override {}
  std::unique_ptr<Collectives> split(const std::string&) override { return std::make_unique<Solo>(); }

 private:
  RankInfo info_;
};

#ifdef STRIDER_HAVE_C10D_GLOO

// Each rank's sign of life in the run's store: a counter bumped every kBeat by
// a thread of its own, over a connection of its own. A rank whose collective
// failed reads them twice, 4 beats apart, to tell a dead or frozen peer (its
// counter stood still) from a live one. The thread is detached when its owner
// goes: a store that died with its host may block it for the store's timeout,
// and nobody should wait for that.
class Heartbeat {
 public:
  static constexpr std::chrono::milliseconds kBeat{500};

  Heartbeat(const c10::intrusive_ptr<c10d::Store>& store, int rank) : state_(std::make_shared<State>()) {
    c10::intrusive_ptr<c10d::Store> own;
    try {
      own = store->clone();
    } catch (const std::exception&) {
      own = store;  // (a store that cannot clone is shared; c10d's stores lock their own calls)
    }
    state_->store = c10::make_intrusive<c10d::PrefixStore>("strider/alive", own);
    std::thread([s = state_, key = std::to_string(rank)] {
      int64_t n = 0;
      std::unique_lock lk(s->mu);
      while (!s->stop) {
        lk.unlock();
        try {
          s->store->set(key, std::to_string(++n));
        } catch (const std::exception&) {
          // the store is gone: a collective will say so
        }
        lk.lock();
        s->cv.wait_for(lk, kBeat, [&] { return s->stop; });
      }
    }).detach();
  }
  ~Heartbeat() {
    std::lock_guard lk(state_->mu);
    state_->stop = true;
    state_->cv.notify_all();
  }

  // The ranks (not `self`) whose counter did not move over 4 beats.
  std::vector<int> silent(int world, int self) {
    auto read = [&] {
      std::vector<std::string> v(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r)
        if (r != self && state_->store->check({std::to_string(r)})) {
          const std::vector<uint8_t> b = state_->store->get(std::to_string(r));
          v[size_t(r)] = std::string(b.begin(), b.end());
        }
      return v;
    };
    const std::vector<std::string> a = read();
    std::this_thread::sleep_for(4 * kBeat);
    const std::vector<std::string> b = read();
    std::vector<int> out;
    for (int r = 0; r < world; ++r)
      if (r != self && a[size_t(r)] == b[size_t(r)]) out.push_back(r);
    return out;
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool stop = false;
    c10::intrusive_ptr<c10d::Store> store;
  };
  std::shared_ptr<State> state_;
};

// Gloo through c10d. Each collective first records, in the store, how many
// collectives this rank has entered (its key "<rank>": the sequence number),
// so that when one fails the survivors can say who never arrived.
class Gloo final : public Collectives {
 public:
  // `channel` names the process group and its progress records in the store.
  Gloo(c10::intrusive_ptr<c10d::Store> store, const RankInfo& info, std::chrono::milliseconds timeout,
       const std::string& channel = "main", std::shared_ptr<Heartbeat> heartbeat = nullptr)
      : info_(info), timeout_(timeout), channel_(channel), store_(store),
        progress_(c10::make_intrusive<c10d::PrefixStore>("strider/progress/" + channel, store)),
        heartbeat_(heartbeat ? std::move(heartbeat) : std::make_shared<Heartbeat>(store, info.rank)) {
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    try {
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<c10d::PrefixStore>("strider/gloo/" + channel, store), info.rank, info.world, opts);
    } catch (const std::exception& e) {
      throw Error(fmt::format("rank {} of {}: joining the process group failed within {} ms: {}", info.rank,
                              info.world, timeout.count(), first_line(e.what())));
    }
  }

  const RankInfo& ranks() const override { return info_; }

  void all_reduce_sum(std::span<double> x) override { reduce_in_rank_order(x, "all_reduce_sum"); }
  void all_reduce_sum(std::span<int64_t> x) override { reduce_in_rank_order(x, "all_reduce_sum"); }

  void all_reduce_sum(std::span<float> x) override {
    // In place when x is whole slices; otherwise padded to them in the
    // scratch. The scratch's tail holds the slice summed here.
    const size_t world = size_t(info_.world), slice = (x.size() + world - 1) / world;
    const bool whole = slice * world == x.size();
    const size_t need = (whole ? 0 : slice * world) + slice;
    if (scratch_.size() < need) scratch_.resize(need);
    std::span<float> all = whole ? x : std::span<float>(scratch_.data(), slice * world);
    std::span<float> mine(scratch_.data() + need - slice, slice);
    if (!whole) {
      std::copy(x.begin(), x.end(), all.begin());
      std::fill(all.begin() + x.size(), all.end(), 0.0f);
    }
    reduce_scatter_sum(all, mine);
    all_gather(std::as_bytes(mine), std::as_writable_bytes(all));
    if (!whole) std::copy(all.begin(), all.begin() + x.size(), x.begin());
  }

  // Point to point, not Gloo's reduce_scatter: each rank receives every
  // other rank's slice for it and adds them all in rank order, so the sum is
  // (g0 + g1) + g2 ... exactly as one process accumulates its micro-batches,
  // and the same whatever the transport's algorithm. Each rank still sends and
  // receives (world - 1) / world of the buffer, as a ring would.
  void reduce_scatter_sum(std::span<const float> in, std::span<float> out) override {
    STRIDER_CHECK(in.size() == out.size() * static_cast<size_t>(info_.world),
                  "reduce_scatter_sum: {} floats in, {} expected ({} ranks x a slice of {})", in.size(),
                  out.size() * info_.world, info_.world, out.size());
    const size_t n = out.size(), world = size_t(info_.world), me = size_t(info_.rank);
    if (received_.size() < n * world) received_.resize(n * world);
    run("reduce_scatter_sum", [&] {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      const int tag = int(seq_ % (1 << 30));
      for (size_t r = 0; r < world; ++r) {
        if (r == me) continue;
        std::vector<at::Tensor> from{blob(received_.data() + r * n, n, at::kFloat)};
        works.push_back(pg_->recv(from, int(r), tag));
      }
      for (size_t r = 0; r < world; ++r) {
        if (r == me) continue;
        std::vector<at::Tensor> to{blob(const_cast<float*>(in.data()) + r * n, n, at::kFloat)};
        works.push_back(pg_->send(to, int(r), tag));
      }
      return works;
    });
    const float* own = in.data() + me * n;
    for (size_t i = 0; i < n; ++i) {
      float sum = me == 0 ? own[i] : received_[i];
      for (size_t r = 1; r < world; ++r) sum += r == me ? own[i] : received_[r * n + i];
      out[i] = sum;
    }
  }

  // Point to point as above: each rank receives the others' parts of its
  // slice straight from them.
  void reduce_scatter_sum(std::span<float> x, std::span<const size_t> bounds) override {
    check_bounds(bounds, x.size(), info_.world, "reduce_scatter_sum");
    const size_t world = size_t(info_.world), me = size_t(info_.rank);
    const size_t lo = bounds[me], n = bounds[me + 1] - lo;
    if (received_.size() < n * world) received_.resize(n * world);
    run("reduce_scatter_sum", [&] {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      const int tag = int(seq_ % (1 << 30));
      for (size_t r = 0; r < world && n > 0; ++r) {
        if (r == me) continue;
        std::vector<at::Tensor> from{blob(received_.data() + r * n, n, at::kFloat)};
        works.push_back(pg_->recv(from, int(r), tag));
      }
      for (size_t r = 0; r < world; ++r) {
        const size_t len = bounds[r + 1] - bounds[r];
        if (r == me || len == 0) continue;
        std::vector<at::Tensor> to{blob(x.data() + bounds[r], len, at::kFloat)};
        works.push_back(pg_->send(to, int(r), tag));
      }
      return works;
    });
    float* own = x.data() + lo;
    for (size_t i = 0; i < n; ++i) {
      float sum = me == 0 ? own[i] : received_[i];
      for (size_t r = 1; r < world; ++r) sum += r == me ? own[i] : received_[r * n + i];
      own[i] = sum;
    }
  }

  void all_gather(std::span<std::byte> x, std::span<const size_t> bounds) override {
    check_bounds(bounds, x.size(), info_.world, "all_gather");
    const size_t world = size_t(info_.world), me = size_t(info_.rank);
    const size_t mine = bounds[me + 1] - bounds[me];
    run("all_gather", [&] {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      const int tag = int(seq_ % (1 << 30));
      for (size_t r = 0; r < world; ++r) {
        const size_t len = bounds[r + 1] - bounds[r];
        if (r == me || len == 0) continue;
        std::vector<at::Tensor> from{blob(x.data() + bounds[r], len, at::kByte)};
        works.push_back(pg_->recv(from, int(r), tag));
      }
      for (size_t r = 0; r < world && mine > 0; ++r) {
        if (r == me) continue;
        std::vector<at::Tensor> to{blob(x.data() + bounds[me], mine, at::kByte)};
        works.push_back(pg_->send(to, int(r), tag));
      }
      return works;
    });
  }

  void all_gather(std::span<const std::byte> in, std::span<std::byte> out) override {
    STRIDER_CHECK(out.size() == in.size() * static_cast<size_t>(info_.world),
                  "all_gather: {} bytes out, {} expected ({} ranks x a slice of {})", out.size(),
                  in.size() * info_.world, info_.world, in.size());
    gather_bytes(in.data(), in.size(), out.data(), "all_gather");
  }

  bool any(bool flag) override {
    int64_t x = flag ? 1 : 0;
    all_reduce_sum(std::span<int64_t>(&x, 1));
    return x != 0;
  }

  void barrier() override {
    c10d::BarrierOptions o;
    o.timeout = timeout_;
    run("barrier", [&] { return pg_->barrier(o); });
  }

  std::unique_ptr<Collectives> split(const std::string& name) override {
    return std::make_unique<Gloo>(store_, info_, timeout_, channel_ + "/" + name, heartbeat_);
  }

 private:
  static at::Tensor blob(void* p, size_t n, at::ScalarType t) {
    return at::from_blob(p, {static_cast<int64_t>(n)}, at::TensorOptions().dtype(t));  // the caller's memory
  }

  void gather_bytes(const std::byte* in, size_t n, std::byte* out, const char* op) {
    std::vector<at::Tensor> ins{blob(const_cast<std::byte*>(in), n, at::kByte)};
    std::vector<std::vector<at::Tensor>> outs(1);
    for (int r = 0; r < info_.world; ++r) outs[0].push_back(blob(out + r * n, n, at::kByte));
    c10d::AllgatherOptions o;
    o.timeout = timeout_;
    run(op, [&] { return pg_->allgather(outs, ins, o); });
  }

  // Every rank's values gathered, then added in rank order: the same bits on
  // every rank and in every run, whatever algorithm Gloo's allreduce would pick.
  template <class T>
  void reduce_in_rank_order(std::span<T> x, const char* op) {
    const size_t bytes = x.size_bytes();
    if (gathered_.size() < bytes * info_.world) gathered_.resize(bytes * info_.world);  // once: no allocation per step
    const std::byte* all = gathered_.data();
    gather_bytes(reinterpret_cast<const std::byte*>(x.data()), bytes, gathered_.data(), op);
    for (size_t i = 0; i < x.size(); ++i) {
      T sum{};
      for (int r = 0; r < info_.world; ++r) {
        T v;
        std::memcpy(&v, all + r * bytes + i * sizeof(T), sizeof(T));
        sum += v;
      }
      x[i] = sum;
    }
  }

  // start() issues the collective and returns its work (or, point to point, works).
  template <class Start>
  void run(const char* op, Start&& start) {
    ++seq_;
    try {
      progress_->set(std::to_string(info_.rank), std::to_string(seq_));
      auto works = start();
      if constexpr (std::is_same_v<decltype(works), c10::intrusive_ptr<c10d::Work>>) works->wait(timeout_);
      else
        for (auto& w : works) w->wait(timeout_);
    } catch (const std::exception& e) {
      throw Error(fmt::format("rank {} of {}: {} (collective #{} on channel {}, timeout {} ms) failed ({}). {}",
                              info_.rank, info_.world, op, seq_, channel_, timeout_.count(), first_line(e.what()),
                              laggards()));
    }
  }

  // Which ranks never reached this rank's collective, from their records in
  // the store, and which have stopped beating.
  std::string laggards() {
    std::vector<std::string> behind;
    std::vector<int> silent;
    try {
      silent = heartbeat_->silent(info_.world, info_.rank);
      for (int r = 0; r < info_.world; ++r) {
        if (r == info_.rank) continue;
        const std::string key = std::to_string(r);
        int64_t seen = 0;
        if (progress_->check({key})) {
          const std::vector<uint8_t> v = progress_->get(key);
          seen = std::stoll(std::string(v.begin(), v.end()));
        }
        if (seen < seq_) behind.push_back(fmt::format("rank {} (at #{})", r, seen));
      }
    } catch (const std::exception& e) {
      return fmt::format("The run's store did not answer ({}): the rank that hosts it (rank 0 unless torchrun's "
                         "agent does) may be the one that died", first_line(e.what()));
    }
    const std::string quiet =
        silent.empty() ? std::string()
                       : fmt::format("No heartbeat for {} ms from: rank {} (dead or frozen)",
                                     (4 * Heartbeat::kBeat).count(), fmt::join(silent, ", rank "));
    // Reached it, then went silent: it died or froze inside the collective.
    if (behind.empty())
      return silent.empty()
                 ? "Every rank reached it and is alive: the failure is in the transport"
                 : fmt::format("Every rank reached it, and then rank {} went silent (no heartbeat for {} ms): it died "
                               "or froze during the collective; see its output",
                               fmt::join(silent, ", rank "), (4 * Heartbeat::kBeat).count());
    return fmt::format("Never reached it: {} (dead, hung, or stopped by an error of its own: see its output){}",
                       fmt::join(behind, ", "), quiet.empty() ? "" : ". " + quiet);
  }

  RankInfo info_;
  std::chrono::milliseconds timeout_;
  std::string channel_;
  c10::intrusive_ptr<c10d::Store> store_, progress_;
  std::shared_ptr<Heartbeat> heartbeat_;  // one per process, shared by its channels
  std::vector<float> scratch_;   // all_reduce_sum(float)'s padded slices
  std::vector<float> received_;  // reduce_scatter_sum's slices from the other ranks
  std::vector<std::byte> gathered_;  // reduce_in_rank_order's values of every rank
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  int64_t seq_ = 0;
};

#endif  // STRIDER_HAVE_C10D_GLOO

}  // namespace

std::unique_ptr<Collectives> solo_collectives() { return std::make_unique<Solo>(); }

bool have_c10d_gloo() {
#ifdef STRIDER_HAVE_C10D_GLOO
  return true;
#else
  return false;
#endif
}

std::unique_ptr<Collectives> c10d_collectives(const c10::intrusive_ptr<c10d::Store>& store, const RankInfo& info,
                                              std::chrono::milliseconds timeout) {
  STRIDER_CHECK(info.world >= 1 && info.rank >= 0 && info.rank < info.world && info.local_world >= 1 &&
                    info.local_rank >= 0 && info.local_rank < info.local_world && info.local_world <= info.world,
                "ranks: rank {} of {} (local {} of {}) is not a rank of that world", info.rank, info.world,
                info.local_rank, info.local_world);
  if (info.world == 1) return solo_collectives();
#ifdef STRIDER_HAVE_C10D_GLOO
  // Gloo's TCP pairs write to sockets a dead peer has closed: with SIGPIPE's
  // default action the process would die there, silently, instead of the
  // collective failing and naming the rank. The write fails with EPIPE instead.
  struct sigaction was {};
  if (sigaction(SIGPIPE, nullptr, &was) == 0 && was.sa_handler == SIG_DFL) std::signal(SIGPIPE, SIG_IGN);
  return std::make_unique<Gloo>(store, info, timeout);
#else
  (void)store;
  (void)timeout;
  throw Error(fmt::format("a world of {} ranks needs c10d's Gloo backend, and this build has none: its gloo headers "
                          "were not found (scripts/setup.sh installs libgloo-dev; then reconfigure)", info.world));
#endif
}

}  // namespace strider
