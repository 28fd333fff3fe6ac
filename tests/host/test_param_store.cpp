#include <unistd.h>

#include <catch2/catch.hpp>

#include "host/error.h"
#include "host/param_store.h"

using namespace strider;

namespace {

ParamLayout layer_layout(const std::string& name, int64_t hidden) {
  ParamLayout l(name);
  l.add(name + ".input_layernorm.weight", {hidden});
  l.add(name + ".self_attn.q_proj.weight", {hidden, hidden});
  l.add(name + ".mlp.up_proj.weight", {3 * hidden + 1, hidden});
  return l;
}

}  // namespace

TEST_CASE("layout offsets are 256-byte aligned for bf16 and fp32 and never overlap", "[host][layout]") {
  ParamLayout l = layer_layout("model.layers.0", 37);
  size_t end = 0;
  for (const auto& s : l.slots()) {
    CHECK((s.offset_elems * 2) % 256 == 0);
    CHECK((s.offset_elems * 4) % 256 == 0);
    CHECK(s.offset_elems >= end);
    end = s.offset_elems + s.numel;
  }
  CHECK(l.total_elems() >= end);
  CHECK(l.total_elems() % ParamLayout::kAlignElems == 0);
  CHECK(l.param_elems() == 37 + 37 * 37 + (3 * 37 + 1) * 37);
  CHECK(l.at("model.layers.0.mlp.up_proj.weight").shape == std::vector<int64_t>{112, 37});
}

TEST_CASE("layout rejects duplicates, negative dims and unknown names with the names", "[host][layout]") {
  ParamLayout l("embed");
  l.add("model.embed_tokens.weight", {10, 4});
  CHECK_THROWS_WITH(l.add("model.embed_tokens.weight", {1}), Catch::Contains("added twice"));
  CHECK_THROWS_WITH(l.add("x", {2, -1}), Catch::Contains("negative dimension -1"));
  CHECK_THROWS_WITH(l.at("lm_head.weight"), Catch::Contains("'embed'") && Catch::Contains("lm_head.weight"));
  CHECK(l.find("lm_head.weight") == nullptr);
}

TEST_CASE("store carves every kind in the arena, zeroed, sized by bytes_needed", "[host][store]") {
  std::vector<BlockSpec> blocks;
  blocks.push_back({layer_layout("model.layers.0", 16), true});
  blocks.push_back({layer_layout("model.layers.1", 24), false});  // NVMe tier
  StoreOptions opts{.grad_dtype = DType::kF32};
  const size_t need = ParamStore::bytes_needed(blocks, opts);
  PinnedArena arena(need, {.lock = LockPolicy::kNone, .huge_pages = false});
  std::memset(arena.data(), 0xff, arena.capacity_bytes());  // dirty: the store must zero
  ParamStore store(blocks, opts, arena);
  CHECK(arena.used_bytes() <= need);

  const BlockState& b0 = store.block(0);
  CHECK(b0.master.size() == b0.elems());
  CHECK(b0.grad.size() == b0.elems() * 4);
  for (float x : b0.m) REQUIRE(x == 0.0f);
  for (float x : b0.v) REQUIRE(x == 0.0f);
  for (auto x : b0.compute) REQUIRE(x == 0);
  for (auto span : {b0.master, b0.m, b0.v})
    CHECK(arena.contains(span.data(), span.size_bytes()));

  const BlockState& b1 = store.block(1);
  CHECK(b1.master.empty());
  CHECK(b1.compute.size() == b1.elems());
  CHECK_THROWS_WITH(store.master_of(1, "model.layers.1.mlp.up_proj.weight"), Catch::Contains("NVMe"));
  CHECK(store.max_block_elems() == b1.elems());
  CHECK(store.param_elems() == blocks[0].layout.param_elems() + blocks[1].layout.param_elems());

  // A block whose gradients are staged elsewhere (the engine's NVMe-tier ring)
  // gets no gradient buffer, and the bytes needed drop by exactly that much.
  std::vector<BlockSpec> no_grad = blocks;
  no_grad[1].grad_staging = false;
  CHECK(ParamStore::bytes_needed(blocks, opts) - ParamStore::bytes_needed(no_grad, opts) ==
        (b1.elems() * 4 + 255) / 256 * 256);
  PinnedArena arena2(ParamStore::bytes_needed(no_grad, opts), {.lock = LockPolicy::kNone, .huge_pages = false});
  ParamStore store2(no_grad, opts, arena2);
  CHECK(store2.block(1).grad.empty());
  CHECK(store2.block(0).grad.size() == b0.elems() * 4);

  auto q = store.master_of(0, "model.layers.0.self_attn.q_proj.weight");
  CHECK(q.size() == 16 * 16);
  q[3] = 1.5f;
  store.refresh_compute_from_master();
  CHECK(store.compute_of(0, "model.layers.0.self_attn.q_proj.weight")[3] == 0x3fc0);  // bf16(1.5)
}

TEST_CASE("store refuses an arena that is too small, naming both sizes", "[host][store]") {
  std::vector<BlockSpec> blocks{{layer_layout("model.layers.0", 64), true}};
  const size_t need = ParamStore::bytes_needed(blocks, {});
  PinnedArena arena(need / 2, {.lock = LockPolicy::kNone, .huge_pages = false});
  CHECK_THROWS_WITH(ParamStore(blocks, {}, arena),
                    Catch::Contains(std::to_string(need)) && Catch::Contains("bytes_needed"));
  CHECK_THROWS_WITH(ParamStore::bytes_needed(blocks, {.grad_dtype = DType::kF16}), Catch::Contains("F16"));
}

TEST_CASE("an fp32 compute copy follows the master exactly", "[host][store]") {
  std::vector<BlockSpec> blocks{{layer_layout("model.layers.0", 8), true}};
  StoreOptions opts{.grad_dtype = DType::kF32, .compute_dtype = DType::kF32};
  PinnedArena arena(ParamStore::bytes_needed(blocks, opts), {.lock = LockPolicy::kNone, .huge_pages = false});
  ParamStore store(blocks, opts, arena);
  BlockState& b = store.block(0);
  CHECK(b.compute.empty());
  REQUIRE(b.compute_f32.size() == b.elems());
  CHECK(b.compute_bytes().size() == b.elems() * 4);
  b.master[5] = 1.0f + 1e-7f;  // not representable in bf16
  store.refresh_compute(0, 4, 6);
  CHECK(b.compute_f32[5] == b.master[5]);
  CHECK_THROWS_WITH(store.compute_of(0, "model.layers.0.input_layernorm.weight"), Catch::Contains("F32"));
}

TEST_CASE("a kept reference copy is the compute copy as taken, and stays so while the compute copy moves",
          "[host][store]") {
  std::vector<BlockSpec> blocks{{layer_layout("model.layers.0", 8), true}, {layer_layout("model.layers.1", 4), true}};
  StoreOptions opts{.grad_dtype = DType::kBF16, .compute_dtype = DType::kBF16};
  const size_t without = ParamStore::bytes_needed(blocks, opts);
  CHECK(ParamStore::reference_bytes_needed(blocks, opts) == 0);
  opts.keep_reference = true;
  const size_t copies = ParamStore::reference_bytes_needed(blocks, opts);
  CHECK(copies == ParamStore::compute_bytes_needed(blocks, opts));
  CHECK(ParamStore::bytes_needed(blocks, opts) == without + copies);
  PinnedArena arena(ParamStore::bytes_needed(blocks, opts), {.lock = LockPolicy::kNone, .huge_pages = false});
  ParamStore store(blocks, opts, arena);
  for (size_t b = 0; b < 2; ++b) {
    BlockState& s = store.block(b);
    REQUIRE(s.reference.size() == s.compute_bytes().size());
    for (size_t i = 0; i < s.master.size(); ++i) s.master[i] = float(i % 7) - 3.0f + 0.25f * float(b);
    store.refresh_compute(b);
  }
  store.take_reference();
  BlockState& s = store.block(1);
  std::vector<std::byte> taken(s.reference.begin(), s.reference.end());
  CHECK(std::equal(taken.begin(), taken.end(), s.compute_bytes().begin()));
  for (float& m : s.master) m += 1.0f;  // an update
  store.refresh_compute(1);
  CHECK(std::equal(taken.begin(), taken.end(), s.reference.begin()));
  CHECK_FALSE(std::equal(taken.begin(), taken.end(), s.compute_bytes().begin()));
  // The same elements as compute_range: element 5 onwards, 3 of them.
  CHECK(s.reference_range(5, 3).data() == s.reference.data() + 5 * 2);
  CHECK(s.reference_range(5, 3).size() == 3 * 2);
  StoreOptions none{.grad_dtype = DType::kBF16, .compute_dtype = DType::kBF16};
  PinnedArena small(ParamStore::bytes_needed(blocks, none), {.lock = LockPolicy::kNone, .huge_pages = false});
  ParamStore plain(blocks, none, small);
  CHECK(plain.block(0).reference.empty());
  CHECK_THROWS_WITH(plain.block(0).reference_range(0, 1), Catch::Contains("keeps no reference copy"));
  CHECK_THROWS_WITH(plain.take_reference(), Catch::Contains("keeps no reference copy"));
}

TEST_CASE("a store keeps the state of its slice of a block only, with the whole compute copy", "[host][store]") {
  const ParamLayout l = layer_layout("model.layers.0", 16);
  const size_t n = l.total_elems(), lo = 256, hi = 512;
  REQUIRE(n > hi);
  std::vector<BlockSpec> whole{{l, true}}, slice{{l, true, true, lo, hi}};
  StoreOptions opts{.grad_dtype = DType::kF32};
  CHECK(ParamStore::bytes_needed(slice, opts) < ParamStore::bytes_needed(whole, opts));
  PinnedArena arena(ParamStore::bytes_needed(slice, opts), {.lock = LockPolicy::kNone, .huge_pages = false});
  ParamStore store(slice, opts, arena);
  BlockState& s = store.block(0);
  CHECK(s.state_elems() == hi - lo);
  CHECK(s.master.size() == hi - lo);
  CHECK(s.compute.size() == n);
  CHECK(s.grad.size() == n * 4);
  // The master's slice sets the compute copy's slice, nothing else.
  std::vector<float> w(hi - lo, 1.5f);
  store.write_kind(0, StateKind::kMaster, w);
  CHECK(s.compute[lo] == 0x3fc0);
  CHECK(s.compute[hi - 1] == 0x3fc0);
  CHECK(s.compute[lo - 1] == 0);
  CHECK(s.compute[hi] == 0);
  std::vector<float> back(hi - lo);
  store.read_kind(0, StateKind::kMaster, back);
  CHECK(back == w);
  std::vector<float> wrong(n);
  CHECK_THROWS_WITH(store.read_kind(0, StateKind::kAdamM, wrong), Catch::Contains("256 state elements"));
  // refresh_compute's range is the block's, cut to the slice.
  s.master[0] = 2.0f;
  store.refresh_compute(0, 0, lo + 1);
  CHECK(s.compute[lo] == 0x4000);  // bf16(2)
  CHECK(s.compute[0] == 0);
  // A slice off the q8 groups is refused, naming it.
  std::vector<BlockSpec> ragged{{l, true, true, 100, 512}};
  PinnedArena arena2(1 << 20, {.lock = LockPolicy::kNone, .huge_pages = false});
  CHECK_THROWS_WITH(ParamStore(ragged, {.format = StateFormat::kQ8}, arena2),
                    Catch::Contains("state slice [100, 512)"));
}

TEST_CASE("a device registers the compute copies and gradients, not the optimizer state", "[host][store]") {
  struct Recorder : MemoryRegistrar {
    std::byte* base = nullptr;
    size_t bytes = 0;
    void register_memory(void* b, size_t n) override { base = static_cast<std::byte*>(b), bytes = n; }
    void unregister_memory(void*, size_t) noexcept override {}
    std::string_view name() const override { return "recorder"; }
  };
  for (StateFormat format : {StateFormat::kFp32, StateFormat::kQ8}) {
    std::vector<BlockSpec> blocks;
    ParamLayout l("model.layers.0");
    l.add("model.layers.0.mlp.up_proj.weight", {64, 32});
    blocks.push_back({l, true});
    blocks.push_back({l, true});
    const StoreOptions opts{.format = format};
    PinnedArena arena(ParamStore::bytes_needed(blocks, opts), {.lock = LockPolicy::kNone, .huge_pages = false});
    ParamStore store(blocks, opts, arena);
    auto rec = std::make_shared<Recorder>();
    arena.attach(rec, ArenaPart::kCopied);
    const auto registered = [&](std::span<const std::byte> x) {
      return x.data() >= rec->base && x.data() + x.size() <= rec->base + rec->bytes;
    };
    for (size_t b = 0; b < 2; ++b) {
      const BlockState& s = store.block(b);
      CHECK(registered(s.compute_bytes()));
      CHECK(registered(s.grad));
      for (auto state : {std::as_bytes(s.master), std::as_bytes(s.m), std::as_bytes(s.v), std::as_bytes(s.ext),
                         std::as_bytes(s.m_codes), std::as_bytes(s.v_codes), std::as_bytes(s.m_scale)})
        if (!state.empty()) CHECK(state.data() >= rec->base + rec->bytes);
    }
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    CHECK(rec->bytes == (arena.copied_bytes() + page - 1) / page * page);
    CHECK(arena.copied_bytes() == 2 * 2 * 64 * 32 * 2);  // two blocks' bf16 copies and gradients, nothing else
  }
}
