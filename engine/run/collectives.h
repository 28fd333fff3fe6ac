// The ranks of a data-parallel run and the collectives its step takes.
//
// One process per device, launched by torchrun; the transport is
// torch.distributed's own C++ engine (c10d): Gloo over host memory, which is
// where strider's gradients and optimizer state live (and all the CPU device
// has). World size 1 is `solo_collectives()`: every operation a copy or a no-op,
// so a single-process run takes the same code path and stays bit-identical.
//
// Every result a decision depends on (loss sums, token counts, norms, a flag) is
// bit-identical on every rank and from run to run: all_reduce_sum gathers the
// ranks' values and adds them in rank order on each rank, whatever algorithm
// the transport would have picked. A failed or timed-out collective throws
// strider::Error naming the operation, its sequence number and the ranks that
// never reached it (each rank records its progress in the run's store before
// every collective), so a dead or hung rank is named by the others.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>  // c10d::Store, the run's key-value store

namespace strider {

struct RankInfo {
  int rank = 0, world = 1;              // in the whole run
  int local_rank = 0, local_world = 1;  // on this machine
  bool solo() const { return world == 1; }
};

class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual const RankInfo& ranks() const = 0;
  // x summed over ranks, in place: every rank gets the same bits (added in rank order).
  virtual void all_reduce_sum(std::span<double> x) = 0;
  virtual void all_reduce_sum(std::span<int64_t> x) = 0;
  // x summed over ranks, in place, for gradients: reduce_scatter_sum then an
  // all-gather, so every rank gets the same bits, added in rank order. Its
  // scratch grows to the largest x once.
  virtual void all_reduce_sum(std::span<float> x) = 0;
  // in: world slices of out.size() floats, slice r meant for rank r. out: the
  // sum over ranks of this rank's slice, added in rank order ((x0 + x1) + x2
  // ...: what one process accumulating the ranks' micro-batches in order gets).
  virtual void reduce_scatter_sum(std::span<const float> in, std::span<float> out) = 0;
  // in: this rank's slice. out: world slices of in.size() bytes, rank r's at r * in.size().
  virtual void all_gather(std::span<const std::byte> in, std::span<std::byte> out) = 0;
  // Sharded state: uneven slices, in place. `bounds` holds world + 1 offsets
  // into x, from 0, non-decreasing, to x.size(); rank r's slice is
  // [bounds[r], bounds[r + 1]), possibly empty. reduce_scatter_sum: this
  // rank's slice of x becomes the sum over ranks of their x there, added in
  // rank order (the rest of x is left as it was). all_gather: each rank's
  // slice of x (bytes; bounds in bytes) reaches every rank, so x is whole on
  // every rank. Scratch grows to the largest slice once.
  virtual void reduce_scatter_sum(std::span<float> x, std::span<const size_t> bounds) = 0;
  virtual void all_gather(std::span<std::byte> x, std::span<const size_t> bounds) = 0;
  // A collective decision: true on every rank when `flag` is true on any.
  virtual bool any(bool flag) = 0;
  virtual void barrier() = 0;
  // Another channel over the same ranks, for collectives issued from another
  // thread (two threads must never share one: the ranks would pair their
  // collectives in different orders). Itself a collective: every rank splits
  // the same names in the same order.
  virtual std::unique_ptr<Collectives> split(const std::string& name) = 0;
};

// World size 1.
std::unique_ptr<Collectives> solo_collectives();

// Whether this build has c10d's Gloo backend (the gloo headers were found).
bool have_c10d_gloo();

// The ranks torchrun describes in the environment: RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and
// TORCHELASTIC_USE_AGENT_STORE (join torchrun's own store as a client; without
// it rank 0 hosts the store). No WORLD_SIZE, or 1: solo. `timeout` bounds every
// collective and the joining. A malformed or inconsistent variable is an Error
// naming it.
std::unique_ptr<Collectives> collectives_from_env(std::chrono::milliseconds timeout);

// Ranks started without torchrun's store (strider.Engine inside a
// torch.distributed group, whose own store strider cannot reach from C++):
// rank 0 hosts a store of its own on a free port of this machine
// (`host_ranks_store`, returning it and the port); the caller hands the port to
// the other ranks (torch.distributed's broadcast), which join it at rank 0's
// address (`join_ranks_store`). Errors name the address and the timeout.
struct RanksStore {
  c10::intrusive_ptr<c10d::Store> store;
  int port = 0;
};
RanksStore host_ranks_store(int world, std::chrono::milliseconds timeout);
c10::intrusive_ptr<c10d::Store> join_ranks_store(const std::string& host, int port, int world,
                                                 std::chrono::milliseconds timeout);

// `info.world` ranks over a store the caller made (tests: one c10d::HashStore
// shared by threads, one rank per thread).
std::unique_ptr<Collectives> c10d_collectives(const c10::intrusive_ptr<c10d::Store>& store, const RankInfo& info,
                                              std::chrono::milliseconds timeout);

}  // namespace strider
