// StateFormat: how a block's master weights and Adam moments are stored on
// the host (and on NVMe). Chosen per run (`--optimizer-state`), recorded in
// checkpoints; the compute copy (bf16) and the gradient staging come on top.
//
//   fp32  master, m, v in fp32: 12 bytes per parameter. Exact: tracks
//         torch.optim.AdamW to float rounding. The default.
//   q8    3.06 bytes per parameter, no separate fp32 master:
//         - master: the bf16 compute copy is its high half (rounded to
//           nearest), an 8-bit extension its next 8 mantissa bits, so the
//           master carries 16 significant bits and what the compute copy
//           rounds off is kept, not lost (a 24-bit float split 16 + 8);
//         - Adam m: 8 bits, sign + a 4-bit exponent and 3-bit mantissa
//           relative to the absolute maximum of its group of 128;
//         - Adam v: 8 bits of sqrt(v), a 4-bit exponent and 4-bit mantissa
//           relative to its group's maximum (sqrt halves the range an 8-bit
//           code must span; the update divides by sqrt(v) anyway);
//         - one fp32 scale per group of 128 for m and one for v.
//         Every rounding after an update is stochastic (unbiased: updates far
//         below one code's step still move the state in expectation), driven
//         by a hash of (step, block, element) so results are deterministic and
//         independent of K, tiers, chunking and threads. Rounding from floats
//         given by a caller (a checkpoint load) is to nearest, so a save and
//         load round trip is exact.
//         Groups of 128 lie on the block's flat offsets (ParamLayout aligns
//         every tensor to 128), so they never straddle tensors; the engine's
//         vocabulary shards are cut on them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace strider {

enum class StateFormat : uint8_t { kFp32, kQ8 };
enum class StateKind : uint8_t { kMaster, kAdamM, kAdamV };

// "fp32" / "q8".
std::string_view state_format_name(StateFormat f);
// Throws naming the value and the choices.
StateFormat parse_state_format(std::string_view name);
// The choices, for help texts: "fp32, q8".
std::string state_format_choices();

inline constexpr size_t kQ8GroupElems = 128;

// Bytes one kind of state takes for `elems` elements (for q8, a multiple of
// kQ8GroupElems): fp32 4 each; q8 master 1 (its extension; the compute copy is
// the rest), m and v 1 each plus a 4-byte scale per group.
size_t state_kind_bytes(StateFormat f, StateKind kind, size_t elems);
// master + m + v bytes per element (groups' scales included): 12 or 3.0625.
double state_bytes_per_elem(StateFormat f);
// Whether the format keeps the master in the bf16 compute copy (so it needs one).
inline bool state_uses_compute_copy(StateFormat f) { return f == StateFormat::kQ8; }

}  // namespace strider
