#include "host/param_store.h"

#include <algorithm>
#include <cstring>

#include "host/adam_q8.h"
#include "host/bf16.h"
#include "host/half.h"
#include "host/error.h"

namespace strider {
namespace {

constexpr size_t kAlignBytes = 256;

size_t aligned(size_t bytes) { return (bytes + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

// Bytes of each kind for one block, in carve order (state: master, m and v
// together).
struct KindBytes { size_t state, compute, grad, reference; };

size_t state_end(const BlockSpec& b) { return std::min(b.state_end, b.layout.total_elems()); }

KindBytes kind_bytes(const BlockSpec& b, const StoreOptions& o) {
  const size_t n = b.layout.total_elems(), ns = state_end(b) - std::min(b.state_begin, state_end(b));
  size_t state = 0;
  if (b.state_on_host) {
    if (o.format == StateFormat::kFp32) {
      state = 3 * aligned(ns * sizeof(float));
    } else {
      const size_t scales = aligned(ns / kQ8GroupElems * sizeof(float));
      state = 3 * aligned(ns) + 2 * scales;
    }
  }
  const size_t compute =
      b.compute_on_host ? aligned((n - std::min(b.base.elems, n)) * dtype_size(o.compute_dtype)) + aligned(b.base.bytes)
                        : 0;
  const size_t reference =
      o.keep_reference && b.compute_on_host ? aligned((n - std::min(b.base.elems, n)) * dtype_size(o.compute_dtype)) : 0;
  return {state, compute, b.grad_staging ? aligned(std::min(b.grad_elems, n) * dtype_size(o.grad_dtype)) : 0,
          reference};
}

void check_options(const StoreOptions& o) {
  STRIDER_CHECK(o.grad_dtype == DType::kBF16 || o.grad_dtype == DType::kF32,
                "ParamStore: gradient staging dtype {} is not supported (use BF16 or F32)",
                dtype_name(o.grad_dtype));
  STRIDER_CHECK(o.compute_dtype == DType::kBF16 || o.compute_dtype == DType::kF16 || o.compute_dtype == DType::kF32,
                "ParamStore: compute dtype {} is not supported (use BF16, F16 or F32)",
                dtype_name(o.compute_dtype));
  STRIDER_CHECK(!state_uses_compute_copy(o.format) || o.compute_dtype == DType::kBF16,
                "ParamStore: the {} optimizer state keeps its master's high half in the bf16 compute copy; "
                "it cannot run with a {} compute copy", state_format_name(o.format), dtype_name(o.compute_dtype));
}

}  // namespace

size_t ParamStore::bytes_needed(const std::vector<BlockSpec>& blocks, const StoreOptions& options) {
  check_options(options);
  size_t total = 0;
  for (const auto& b : blocks) {
    KindBytes k = kind_bytes(b, options);
    total += k.state + k.compute + k.grad + k.reference;
  }
  return total;
}

size_t ParamStore::compute_bytes_needed(const std::vector<BlockSpec>& blocks, const StoreOptions& options) {
  check_options(options);
  size_t total = 0;
  for (const auto& b : blocks) total += kind_bytes(b, options).compute;
  return total;
}

size_t ParamStore::reference_bytes_needed(const std::vector<BlockSpec>& blocks, const StoreOptions& options) {
  check_options(options);
  size_t total = 0;
  for (const auto& b : blocks) total += kind_bytes(b, options).reference;
  return total;
}

size_t ParamStore::state_bytes_needed(const std::vector<BlockSpec>& blocks, const StoreOptions& options) {
  check_options(options);
  size_t total = 0;
  for (const auto& b : blocks) total += kind_bytes(b, options).state;
  return total;
}

ParamStore::ParamStore(std::vector<BlockSpec> blocks, StoreOptions options, PinnedArena& arena,
                       PinnedArena* compute_arena)
    : specs_(std::move(blocks)), options_(options) {
  check_options(options_);
  const size_t need = bytes_needed(specs_, options_) - (compute_arena ? compute_bytes_needed(specs_, options_) : 0);
  STRIDER_CHECK(need <= arena.free_bytes(),
                "ParamStore: {} blocks need {} bytes of pinned memory ({:.2f} GiB) but the arena "
                "has {} free; size the arena with ParamStore::bytes_needed",
                specs_.size(), need, need / double(1ull << 30), arena.free_bytes());
  blocks_.reserve(specs_.size());
  for (const auto& spec : specs_) {
    BlockState s;
    s.layout = &spec.layout;
    s.grad_dtype = options_.grad_dtype;
    s.state_on_host = spec.state_on_host;
    s.compute_on_host = spec.compute_on_host;
    STRIDER_CHECK(spec.compute_on_host || (!spec.state_on_host && spec.base.empty()),
                  "ParamStore: block '{}' keeps its compute copy on NVMe; its state must be there too, and it "
                  "cannot hold a quantized base", spec.layout.block_name());
    s.format = options_.format;
    const size_t n = spec.layout.total_elems();
    const std::string& name = spec.layout.block_name();
    s.state_end = state_end(spec);
    STRIDER_CHECK(spec.state_begin <= s.state_end, "ParamStore: block '{}' has {} elements; its state slice "
                  "[{}, {}) is not inside it", name, n, spec.state_begin, spec.state_end);
    s.state_begin = spec.state_begin;
    const size_t ns = s.state_elems();
    if (spec.state_on_host && options_.format == StateFormat::kFp32) {
      s.master = arena.carve_as<float>(ns, name + " master", kAlignBytes, ArenaUse::kHostOnly);
      s.m = arena.carve_as<float>(ns, name + " adam m", kAlignBytes, ArenaUse::kHostOnly);
      s.v = arena.carve_as<float>(ns, name + " adam v", kAlignBytes, ArenaUse::kHostOnly);
    } else if (spec.state_on_host) {
      STRIDER_CHECK(n % kQ8GroupElems == 0 && s.state_begin % kQ8GroupElems == 0 && ns % kQ8GroupElems == 0,
                    "ParamStore: block '{}' has {} elements and a state slice [{}, {}), not whole q8 groups", name, n,
                    s.state_begin, s.state_end);
      s.ext = arena.carve_as<uint8_t>(ns, name + " master extension", kAlignBytes, ArenaUse::kHostOnly);
      s.m_codes = arena.carve_as<uint8_t>(ns, name + " adam m codes", kAlignBytes, ArenaUse::kHostOnly);
      s.v_codes = arena.carve_as<uint8_t>(ns, name + " adam v codes", kAlignBytes, ArenaUse::kHostOnly);
      s.m_scale = arena.carve_as<float>(ns / kQ8GroupElems, name + " adam m scales", kAlignBytes, ArenaUse::kHostOnly);
      s.v_scale = arena.carve_as<float>(ns / kQ8GroupElems, name + " adam v scales", kAlignBytes, ArenaUse::kHostOnly);
    }
    PinnedArena& carrier = compute_arena ? *compute_arena : arena;
    STRIDER_CHECK(spec.base.elems <= s.state_begin || spec.base.empty(),
                  "ParamStore: block '{}' quantizes its elements [0, {}) but keeps state from {}", name,
                  spec.base.elems, s.state_begin);
    s.compute_begin = spec.base.elems;
    if (!spec.base.empty()) {
      s.base = carrier.carve(spec.base.bytes, kAlignBytes, name + " " + std::string(base_format_name(spec.base.format)) +
                                                                " base");
      s.base_layout = &spec.base;
    }
    s.compute_dtype = options_.compute_dtype;
    if (spec.compute_on_host && options_.compute_dtype != DType::kF32)
      s.compute = carrier.carve_as<uint16_t>(n - s.compute_begin, name + " " + std::string(dtype_name(s.compute_dtype)) +
                                                                       " compute copy", kAlignBytes);
    else if (spec.compute_on_host)
      s.compute_f32 = carrier.carve_as<float>(n - s.compute_begin, name + " fp32 compute copy", kAlignBytes);
    if (spec.compute_on_host && options_.keep_reference)  // this process's own, even beside a shared compute copy
      s.reference = arena.carve(s.compute_bytes().size(), kAlignBytes, name + " reference copy");
    if (spec.grad_staging)
      s.grad = arena.carve(std::min(spec.grad_elems, n) * dtype_size(options_.grad_dtype), kAlignBytes,
                           name + " grad staging");
    // Adam's moments must start at zero and padding must stay zero; the arena
    // may have been used before, so do not rely on fresh mmap pages.
    if (!options_.zero) {
      blocks_.push_back(s);
      continue;
    }
    std::memset(s.master.data(), 0, s.master.size_bytes());
    std::memset(s.m.data(), 0, s.m.size_bytes());
    std::memset(s.v.data(), 0, s.v.size_bytes());
    for (auto q : {s.ext, s.m_codes, s.v_codes}) std::memset(q.data(), 0, q.size_bytes());
    for (auto q : {s.m_scale, s.v_scale}) std::memset(q.data(), 0, q.size_bytes());
    if (!compute_arena) {
      std::memset(s.compute_bytes().data(), 0, s.compute_bytes().size());
      std::memset(s.base.data(), 0, s.base.size());
    }
    std::memset(s.grad.data(), 0, s.grad.size_bytes());
    std::memset(s.reference.data(), 0, s.reference.size());
    blocks_.push_back(s);
  }
}

std::span<std::byte> BlockState::compute_range(size_t begin, size_t n) const {
  STRIDER_CHECK(compute_on_host, "block '{}': its compute copy lives on NVMe, not in RAM", layout->block_name());
  STRIDER_CHECK(begin >= compute_begin && begin + n <= elems(),
                "block '{}': elements [{}, {}) of its compute copy, which holds [{}, {}) (a quantized base before)",
                layout->block_name(), begin, begin + n, compute_begin, elems());
  const size_t e = compute.empty() ? sizeof(float) : sizeof(uint16_t);
  return compute_bytes().subspan((begin - compute_begin) * e, n * e);
}

std::span<std::byte> BlockState::reference_range(size_t begin, size_t n) const {
  STRIDER_CHECK(!reference.empty(), "block '{}' keeps no reference copy", layout->block_name());
  const std::span<std::byte> c = compute_range(begin, n);
  return reference.subspan(size_t(c.data() - compute_bytes().data()), c.size());
}

BlockState& ParamStore::block(size_t i) {
  STRIDER_CHECK(i < blocks_.size(), "ParamStore: block {} out of range ({} blocks)", i, blocks_.size());
  return blocks_[i];
}
const BlockState& ParamStore::block(size_t i) const {
  return const_cast<ParamStore*>(this)->block(i);
}

size_t ParamStore::param_elems() const {
  size_t n = 0;
  for (const auto& s : specs_) n += s.layout.param_elems();
  return n;
}

size_t ParamStore::max_block_elems() const {
  size_t n = 0;
  for (const auto& s : specs_) n = std::max(n, s.layout.total_elems());
  return n;
}

std::span<float> ParamStore::master_of(size_t b, std::string_view tensor) {
  BlockState& s = block(b);
  STRIDER_CHECK(s.state_on_host, "ParamStore: block '{}' keeps its fp32 state on NVMe; '{}' has no host master",
                s.layout->block_name(), tensor);
  STRIDER_CHECK(s.format == StateFormat::kFp32, "ParamStore: block '{}' keeps its master in the {} format; '{}' "
                "has no fp32 master to point at (read_kind decodes it)", s.layout->block_name(),
                state_format_name(s.format), tensor);
  const TensorSlot& t = s.layout->at(tensor);
  STRIDER_CHECK(t.offset_elems >= s.state_begin && t.offset_elems + t.numel <= s.state_end,
                "ParamStore: '{}' is not wholly in this store's state slice of block '{}'", tensor,
                s.layout->block_name());
  return s.master.subspan(t.offset_elems - s.state_begin, t.numel);
}

std::span<uint16_t> ParamStore::compute_of(size_t b, std::string_view tensor) {
  BlockState& s = block(b);
  STRIDER_CHECK(s.compute_on_host, "ParamStore: block '{}' keeps its compute copy on NVMe; '{}' has none in RAM",
                s.layout->block_name(), tensor);
  STRIDER_CHECK(!s.compute.empty(), "ParamStore: compute_of('{}') asks for 16-bit bits but the compute copy is {}",
                tensor, dtype_name(options_.compute_dtype));
  const TensorSlot& t = s.layout->at(tensor);
  STRIDER_CHECK(t.offset_elems >= s.compute_begin, "ParamStore: '{}' is part of block '{}''s {} base; it has no "
                "compute copy", tensor, s.layout->block_name(), base_format_name(s.base_layout->format));
  return s.compute.subspan(t.offset_elems - s.compute_begin, t.numel);
}

void ParamStore::refresh_compute(size_t b, size_t begin, size_t end) {
  BlockState& s = block(b);
  STRIDER_CHECK(s.state_on_host, "ParamStore: block '{}' keeps its master on NVMe; refresh its "
                "compute copy from the staging buffer it was read into", s.layout->block_name());
  begin = std::max(begin, s.state_begin);
  end = std::min(end, s.state_end);
  if (begin >= end) return;
  auto src = std::span<const float>(s.master).subspan(begin - s.state_begin, end - begin);
  if (!s.compute.empty()) round_to_16(s.compute_dtype, src, s.compute.subspan(begin - s.compute_begin, end - begin));
  else std::copy(src.begin(), src.end(), s.compute_f32.begin() + ptrdiff_t(begin - s.compute_begin));
}

void ParamStore::refresh_compute_from_master() {
  if (options_.format != StateFormat::kFp32) return;
  for (size_t b = 0; b < blocks_.size(); ++b)
    if (blocks_[b].state_on_host) refresh_compute(b);
}

void ParamStore::take_reference() {
  STRIDER_CHECK(options_.keep_reference, "ParamStore: take_reference, but the store keeps no reference copy");
  for (BlockState& s : blocks_)
    if (!s.reference.empty()) std::memcpy(s.reference.data(), s.compute_bytes().data(), s.reference.size());
}

void ParamStore::read_kind(size_t b, StateKind kind, std::span<float> out) const {
  const BlockState& s = block(b);
  STRIDER_CHECK(s.state_on_host && out.size() == s.state_elems(),
                "ParamStore::read_kind: block '{}' ({} state elements, {}) and a buffer of {}", s.layout->block_name(),
                s.state_elems(), s.state_on_host ? "on the host" : "on NVMe", out.size());
  if (s.format == StateFormat::kFp32) {
    std::span<const float> src = kind == StateKind::kMaster ? s.master : kind == StateKind::kAdamM ? s.m : s.v;
    std::copy(src.begin(), src.end(), out.begin());
  } else if (kind == StateKind::kMaster) {
    q8_decode_master(s.compute_at(s.state_begin), s.ext.data(), out.data(), out.size());
  } else {
    const bool m = kind == StateKind::kAdamM;
    q8_decode_moment(kind, (m ? s.m_codes : s.v_codes).data(), (m ? s.m_scale : s.v_scale).data(), out.data(),
                     out.size());
  }
}

void ParamStore::write_kind(size_t b, StateKind kind, std::span<const float> in) {
  BlockState& s = block(b);
  STRIDER_CHECK(s.state_on_host && in.size() == s.state_elems(),
                "ParamStore::write_kind: block '{}' ({} state elements, {}) and a buffer of {}", s.layout->block_name(),
                s.state_elems(), s.state_on_host ? "on the host" : "on NVMe", in.size());
  if (s.format == StateFormat::kFp32) {
    std::span<float> dst = kind == StateKind::kMaster ? s.master : kind == StateKind::kAdamM ? s.m : s.v;
    std::copy(in.begin(), in.end(), dst.begin());
    if (kind == StateKind::kMaster) refresh_compute(b);
  } else if (kind == StateKind::kMaster) {
    q8_encode_master(in.data(), s.compute_at(s.state_begin), s.ext.data(), in.size());
  } else {
    const bool m = kind == StateKind::kAdamM;
    q8_encode_moment(kind, in.data(), (m ? s.m_codes : s.v_codes).data(), (m ? s.m_scale : s.v_scale).data(),
                     in.size());
  }
}

}  // namespace strider
