// The ranks' rendezvous: the TCP store rank 0 hosts or torchrun's agent
// holds, joined from torchrun's environment (WORLD_SIZE, RANK, MASTER_ADDR,
// ...) or from a host and port given; the Gloo collectives over it are
// engine/run/collectives.cpp's.
#include <cerrno>
#include <cstdlib>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "engine/run/collectives.h"
#include "host/error.h"

#ifdef STRIDER_HAVE_C10D_GLOO
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif

namespace strider {
namespace {

[[maybe_unused]] std::string first_line(std::string_view s) { return std::string(s.substr(0, s.find('\n'))); }

// An environment variable as an int, or `fallback` when unset.
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v) return fallback;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  STRIDER_CHECK(*v && end && *end == '\0' && errno == 0 && x >= 0 && x <= (1 << 20),
                "environment variable {}='{}' is not a non-negative integer (torchrun sets it; so must a launcher "
                "that imitates it)", name, v);
  return static_cast<int>(x);
}

[[maybe_unused]] std::string env_str(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string(fallback);
}

}  // namespace

RanksStore host_ranks_store(int world, std::chrono::milliseconds timeout) {
#ifdef STRIDER_HAVE_C10D_GLOO
  c10d::TCPStoreOptions o;
  o.port = 0;  // any free port: the caller passes the one chosen to the other ranks
  o.isServer = true;
  o.numWorkers = world;
  o.waitWorkers = false;
  o.timeout = timeout;
  try {
    auto store = c10::make_intrusive<c10d::TCPStore>("0.0.0.0", o);
    const int port = int(store->getPort());
    return {store, port};
  } catch (const std::exception& e) {
    throw Error(fmt::format("rank 0 of {}: cannot host the ranks' store on a free port: {}", world,
                            first_line(e.what())));
  }
#else
  (void)timeout;
  throw Error(fmt::format("a world of {} ranks needs c10d's Gloo backend, and this build has none (no gloo "
                          "headers: scripts/setup.sh installs libgloo-dev)", world));
#endif
}

c10::intrusive_ptr<c10d::Store> join_ranks_store(const std::string& host, int port, int world,
                                                 std::chrono::milliseconds timeout) {
  STRIDER_CHECK(port > 0 && port < 65536, "the ranks' store port {} is not a port", port);
#ifdef STRIDER_HAVE_C10D_GLOO
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(port);
  o.isServer = false;
  o.numWorkers = world;
  o.waitWorkers = false;
  o.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(host, o);
  } catch (const std::exception& e) {
    throw Error(fmt::format("the ranks' store at {}:{} (hosted by rank 0) did not answer within {} ms: {}", host, port,
                            timeout.count(), first_line(e.what())));
  }
#else
  (void)host, (void)timeout;
  throw Error(fmt::format("a world of {} ranks needs c10d's Gloo backend, and this build has none (no gloo "
                          "headers: scripts/setup.sh installs libgloo-dev)", world));
#endif
}

std::unique_ptr<Collectives> collectives_from_env(std::chrono::milliseconds timeout) {
  RankInfo info;
  info.world = env_int("WORLD_SIZE", 1);
  STRIDER_CHECK(info.world >= 1, "environment variable WORLD_SIZE=0: a run has at least one rank");
  if (info.world == 1) return solo_collectives();
  info.rank = env_int("RANK", -1);
  STRIDER_CHECK(info.rank >= 0, "WORLD_SIZE={} but RANK is not set: launch the ranks with torchrun", info.world);
  info.local_rank = env_int("LOCAL_RANK", info.rank);
  info.local_world = env_int("LOCAL_WORLD_SIZE", info.world);
  STRIDER_CHECK(info.rank < info.world && info.local_rank < info.local_world && info.local_world <= info.world,
                "torchrun's environment is inconsistent: RANK={} WORLD_SIZE={} LOCAL_RANK={} LOCAL_WORLD_SIZE={}",
                info.rank, info.world, info.local_rank, info.local_world);
#ifdef STRIDER_HAVE_C10D_GLOO
  const std::string addr = env_str("MASTER_ADDR", "");
  STRIDER_CHECK(!addr.empty(), "WORLD_SIZE={} but MASTER_ADDR is not set: launch the ranks with torchrun",
                info.world);
  const int port = env_int("MASTER_PORT", -1);
  STRIDER_CHECK(port > 0 && port < 65536, "MASTER_PORT is {}: launch the ranks with torchrun",
                port < 0 ? std::string("not set") : std::to_string(port));
  const std::string agent = env_str("TORCHELASTIC_USE_AGENT_STORE", "");
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(port);
  o.isServer = !(agent == "True" || agent == "true" || agent == "1") && info.rank == 0;
  o.numWorkers = info.world;
  o.waitWorkers = false;  // the process group's own rendezvous waits for everyone
  o.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(addr, o);
  } catch (const std::exception& e) {
    throw Error(fmt::format("rank {} of {}: the run's store at {}:{} ({}) did not answer within {} ms: {}", info.rank,
                            info.world, addr, port, o.isServer ? "hosted here" : "torchrun's or rank 0's",
                            timeout.count(), first_line(e.what())));
  }
  return c10d_collectives(store, info, timeout);
#else
  return c10d_collectives(c10::intrusive_ptr<c10d::Store>(), info, timeout);
#endif
}

}  // namespace strider
