// How engine/model_config*.cpp read a transformers config.json: bounded
// fields, each error naming the file and the field. Internal to those files.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "engine/model/model_spec.h"
#include "host/error.h"

namespace strider::config_json {

using nlohmann::json;

// Bounds of every number read from a config.json. Each is far past any
// published model (the largest we know: hidden 16384, 126 layers, 128 heads
// and intermediate 53248 in Llama 3.1 405B; a vocab of about 262k in Gemma 3;
// 10M positions in Llama 4 Scout; rope_theta 1e7 in Qwen2.5-1M), so no real
// config is refused. What they stop is a typo or a hostile file
// (num_hidden_layers 10^12) that would otherwise reach loops and allocations
// sized by it, or overflow the 64-bit sizes computed from it.
struct IntRange { int64_t lo, hi; };
constexpr IntRange kLayersRange{1, 100'000};
constexpr IntRange kHiddenRange{1, int64_t{1} << 20};
constexpr IntRange kHeadsRange{1, int64_t{1} << 16};  // attention and KV heads
constexpr IntRange kHeadDimRange{2, int64_t{1} << 20};  // given, or hidden / heads
constexpr IntRange kIntermediateRange{1, int64_t{1} << 22};
constexpr IntRange kVocabRange{1, int64_t{1} << 24};
constexpr IntRange kPositionsRange{1, int64_t{1} << 30};  // positions, sliding window

// A real-valued field's bounds; `lo_open`: lo itself is outside.
struct RealRange { double lo, hi; bool lo_open; };
constexpr RealRange kRopeThetaRange{0, 1e12, true};
constexpr RealRange kRopeFactorRange{0, 1e6, true};  // factor, low and high freq factors
constexpr RealRange kRmsEpsRange{0, 1, true};
constexpr RealRange kMultiplierRange{0, 1e6, true};  // Granite's multipliers and logits_scaling

// Field readers that name the file and the field in every error.
struct Reader {
  const json& j;
  std::string_view source;
  std::string_view prefix = {};  // "rope_scaling." inside that object

  std::string name(std::string_view key) const { return fmt::format("{}{}", prefix, key); }

  const json* find(std::string_view key) const {
    auto it = j.find(key);
    return (it == j.end() || it->is_null()) ? nullptr : &*it;
  }
  // An integer within `r`. JSON's 1e12 or 32.0 is a floating-point number, not
  // an integer: refused with the range, rather than rounded.
  int64_t integer(std::string_view key, IntRange r) const {
    const json* v = find(key);
    STRIDER_CHECK(v != nullptr, "{}: missing field '{}'", source, name(key));
    STRIDER_CHECK(!v->is_number_float(), "{}: field '{}' = {} is a floating-point number; it must be "
                  "an integer in [{}, {}], written without a decimal point or exponent", source, name(key),
                  v->dump(), r.lo, r.hi);
    STRIDER_CHECK(v->is_number_integer(), "{}: field '{}' must be an integer in [{}, {}], got {}",
                  source, name(key), r.lo, r.hi, v->dump());
    // The parser stores a non-negative integer as unsigned; past int64 it
    // would wrap in get<int64_t>(), so compare it as unsigned first.
    const bool in = v->is_number_unsigned()
                        ? v->get<uint64_t>() <= uint64_t(r.hi) && v->get<int64_t>() >= r.lo
                        : v->get<int64_t>() >= r.lo && v->get<int64_t>() <= r.hi;
    STRIDER_CHECK(in, "{}: field '{}' = {} is outside [{}, {}]", source, name(key), v->dump(), r.lo, r.hi);
    return v->get<int64_t>();
  }
  int64_t integer_or(std::string_view key, int64_t dflt, IntRange r) const {
    return find(key) ? integer(key, r) : dflt;
  }
  double number_or(std::string_view key, double dflt, RealRange r) const {
    const json* v = find(key);
    if (!v) return dflt;
    STRIDER_CHECK(v->is_number(), "{}: field '{}' must be a number, got {}", source, name(key), v->dump());
    const double x = v->get<double>();
    const bool in = (r.lo_open ? x > r.lo : x >= r.lo) && x <= r.hi;  // false for NaN
    STRIDER_CHECK(in, "{}: field '{}' = {} is outside {}{}, {}]", source, name(key), v->dump(),
                  r.lo_open ? "(" : "[", r.lo, r.hi);
    return x;
  }
  bool boolean_or(std::string_view key, bool dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    STRIDER_CHECK(v->is_boolean(), "{}: field '{}' must be true or false, got {}", source, name(key), v->dump());
    return v->get<bool>();
  }
  std::string string_or(std::string_view key, std::string dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    STRIDER_CHECK(v->is_string(), "{}: field '{}' must be a string, got {}", source, name(key), v->dump());
    return v->get<std::string>();
  }
};

// RoPE: rope_parameters (transformers >= 5) or rope_theta + rope_scaling
// (older files); `theta`: the architecture's default base, `partial`: its
// rotary fraction where rope_parameters does not give one (model_config.cpp).
RopeDims parse_rope(const Reader& r, int64_t head_dim, double theta = 10000.0, double partial = 1.0);
// The RoPE object `pr` reads (its rope_type and factors) over `rope`; `top`:
// the whole config, whose head_dim is `head_dim`.
RopeDims parse_rope_params(const Reader& pr, RopeDims rope, const Reader& top, int64_t head_dim);

// The families whose layers differ most from Llama's (model_config_families.cpp).
void parse_gemma(const Reader& r, ModelSpec& s);
void parse_moe(const Reader& r, ModelSpec& s);

}  // namespace strider::config_json
