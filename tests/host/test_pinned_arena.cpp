#include <sys/resource.h>

#include <catch2/catch.hpp>
#include <cstring>

#include "host/error.h"
#include "host/pinned_arena.h"

using namespace strider;

namespace {

struct CountingRegistrar : MemoryRegistrar {
  int registered = 0, unregistered = 0;
  void* base = nullptr;
  size_t bytes = 0;
  std::vector<std::string>* order;
  std::string tag;
  CountingRegistrar(std::vector<std::string>* o, std::string t) : order(o), tag(std::move(t)) {}
  void register_memory(void* b, size_t n) override { ++registered; base = b; bytes = n; }
  void unregister_memory(void* b, size_t n) noexcept override {
    ++unregistered;
    order->push_back(tag);
  }
  std::string_view name() const override { return tag; }
};

struct RefusingRegistrar : MemoryRegistrar {
  void register_memory(void*, size_t) override { throw Error("refused"); }
  void unregister_memory(void*, size_t) noexcept override { FAIL("never registered"); }
  std::string_view name() const override { return "refusing"; }
};

}  // namespace

TEST_CASE("arena carves aligned, disjoint buffers and reports what is used", "[host][arena]") {
  PinnedArena arena(1 << 20, {.lock = LockPolicy::kNone, .huge_pages = false});
  REQUIRE(arena.capacity_bytes() >= (1u << 20));
  auto a = arena.carve(10, 256, "a");
  auto b = arena.carve(1000, 4096, "b");
  auto c = arena.carve_as<float>(7, "c");
  CHECK(reinterpret_cast<uintptr_t>(a.data()) % 256 == 0);
  CHECK(reinterpret_cast<uintptr_t>(b.data()) % 4096 == 0);
  CHECK(reinterpret_cast<uintptr_t>(c.data()) % 256 == 0);
  CHECK(b.data() >= a.data() + a.size());
  CHECK(reinterpret_cast<std::byte*>(c.data()) >= b.data() + b.size());
  CHECK(arena.used_bytes() == static_cast<size_t>(reinterpret_cast<std::byte*>(c.data() + 7) - arena.data()));
  CHECK(arena.contains(b.data(), b.size()));
  CHECK_FALSE(arena.contains(arena.data() + arena.capacity_bytes() - 4, 8));
  std::memset(b.data(), 0x5a, b.size());  // writable
}

TEST_CASE("arena exhaustion names the request and what is left", "[host][arena]") {
  PinnedArena arena(4096, {.lock = LockPolicy::kNone, .huge_pages = false, .name = "test arena"});
  arena.carve(4000, 64, "first");
  try {
    arena.carve(512, 64, "second buffer");
    FAIL("carve past capacity succeeded");
  } catch (const Error& e) {
    std::string msg = e.what();
    CHECK_THAT(msg, Catch::Contains("second buffer"));
    CHECK_THAT(msg, Catch::Contains("512"));
    CHECK_THAT(msg, Catch::Contains("test arena"));
  }
  CHECK_THROWS_WITH(arena.carve(1, 3, "odd"), Catch::Contains("power of two"));
}

TEST_CASE("an impossible arena size fails with a clear error", "[host][arena]") {
  // 1 PiB: more than any machine here maps without MAP_NORESERVE.
  CHECK_THROWS_WITH(PinnedArena(size_t{1} << 50, {.lock = LockPolicy::kNone}),
                    Catch::Contains("cannot map") && Catch::Contains("GiB"));
}

TEST_CASE("lock policy 'require' names the memlock limit when mlock is refused", "[host][arena]") {
  // Lower our own soft memlock limit so that mlock must fail unless the process
  // is privileged (CAP_IPC_LOCK ignores the limit); then either outcome is
  // checked for what it promises.
  rlimit old{};
  REQUIRE(getrlimit(RLIMIT_MEMLOCK, &old) == 0);
  rlimit low = old;
  low.rlim_cur = 0;
  REQUIRE(setrlimit(RLIMIT_MEMLOCK, &low) == 0);
  try {
    PinnedArena arena(8 << 20, {.lock = LockPolicy::kRequire, .huge_pages = false});
    CHECK(arena.locked());
  } catch (const Error& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("mlock") && Catch::Contains("ulimit -l"));
  }
  // 'prefer' never throws for the lock and says whether it got it.
  PinnedArena preferred(8 << 20, {.lock = LockPolicy::kPrefer, .huge_pages = false});
  CHECK(preferred.used_bytes() == 0);
  REQUIRE(setrlimit(RLIMIT_MEMLOCK, &old) == 0);
}

TEST_CASE("registrars see the whole mapping and are undone in reverse order", "[host][arena]") {
  std::vector<std::string> order;
  auto first = std::make_shared<CountingRegistrar>(&order, "first");
  auto second = std::make_shared<CountingRegistrar>(&order, "second");
  {
    PinnedArena arena(1 << 20, {.lock = LockPolicy::kNone, .huge_pages = false});
    arena.attach(first);
    arena.attach(second);
    CHECK(first->base == arena.data());
    CHECK(first->bytes == arena.capacity_bytes());
    CHECK_THROWS_WITH(arena.attach(std::make_shared<RefusingRegistrar>()), Catch::Contains(": refused."));
    CHECK(first->unregistered == 0);
  }
  CHECK(first->registered == 1);
  CHECK(first->unregistered == 1);
  CHECK(second->unregistered == 1);
  CHECK(order == std::vector<std::string>{"second", "first"});
}

TEST_CASE("copied buffers are one range at the front and host-only ones fill from the back", "[host][arena]") {
  std::vector<std::string> order;
  auto whole = std::make_shared<CountingRegistrar>(&order, "whole");
  auto copies = std::make_shared<CountingRegistrar>(&order, "copies");
  PinnedArena arena(1 << 20, {.lock = LockPolicy::kNone, .huge_pages = false});
  auto a = arena.carve(10000, 256, "copied a");
  auto s = arena.carve(3000, 256, "state", ArenaUse::kHostOnly);
  auto b = arena.carve(100, 4096, "copied b");
  auto t = arena.carve_as<float>(500, "more state", 256, ArenaUse::kHostOnly);
  CHECK(reinterpret_cast<uintptr_t>(s.data()) % 256 == 0);
  CHECK(reinterpret_cast<uintptr_t>(b.data()) % 4096 == 0);
  CHECK(reinterpret_cast<uintptr_t>(t.data()) % 256 == 0);
  // The copied part ends with the last copied buffer; the state lies beyond it, apart.
  CHECK(arena.copied_bytes() == size_t(b.data() + b.size() - arena.data()));
  CHECK(s.data() + s.size() <= arena.data() + arena.capacity_bytes());
  CHECK(reinterpret_cast<std::byte*>(t.data() + t.size()) <= s.data());
  CHECK(reinterpret_cast<std::byte*>(t.data()) >= arena.data() + 2 * 4096 + 8192);
  CHECK(arena.used_bytes() == arena.copied_bytes() + size_t(arena.data() + arena.capacity_bytes() -
                                                            reinterpret_cast<std::byte*>(t.data())));
  CHECK(arena.free_bytes() == arena.capacity_bytes() - arena.used_bytes());

  arena.attach(whole);
  arena.attach(copies, ArenaPart::kCopied);
  CHECK(whole->bytes == arena.capacity_bytes());
  CHECK(copies->base == arena.data());
  CHECK(copies->bytes == 16384);  // 10000 + pad + 100 bytes, rounded to the page
  CHECK_THROWS_WITH(arena.carve(64, 64, "late batch"),
                    Catch::Contains("late batch") && Catch::Contains("after the copied part was registered"));
  arena.carve(64, 64, "late state", ArenaUse::kHostOnly);  // host-only buffers may still come

  // The two ends meet: the request that would cross is refused, naming it.
  CHECK_THROWS_WITH(arena.carve(arena.free_bytes() + 1, 1, "too much", ArenaUse::kHostOnly),
                    Catch::Contains("too much"));
}

TEST_CASE("a refused registration names the arena, the bytes, the memlock limit and what to do", "[host][arena]") {
  PinnedArena arena(1 << 20, {.lock = LockPolicy::kNone, .huge_pages = false, .name = "test arena"});
  arena.carve(5000, 256, "copied");
  CHECK_THROWS_WITH(arena.attach(std::make_shared<RefusingRegistrar>(), ArenaPart::kCopied),
                    Catch::Contains("test arena") && Catch::Contains("refusing refused 8192 bytes") &&
                        Catch::Contains("refused") && Catch::Contains("ulimit -l") && Catch::Contains("lower"));
}
