#include "engine/model/lora.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "host/error.h"

namespace strider {
namespace {

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  for (size_t at = 0;;) {
    const size_t end = std::min(s.find(sep, at), s.size());
    out.push_back(s.substr(at, end - at));
    if (end == s.size()) return out;
    at = end + 1;
  }
}

template <class List>
bool listed(const List& list, std::string_view x) {
  return std::find(std::begin(list), std::end(list), x) != std::end(list);
}

}  // namespace

double LoraSpec::scale() const { return rslora ? alpha / std::sqrt(double(r)) : alpha / double(r); }

bool LoraSpec::targets_module(std::string_view module) const { return enabled() && listed(targets, module); }

bool LoraSpec::trains(std::string_view module) const { return listed(train, module); }

constexpr double kMaxLoraAlpha = 1e6;

LoraSpec LoraSpec::parse(std::string_view text, std::string_view source) {
  LoraSpec l;
  if (text.empty()) return l;
  bool have_alpha = false;
  for (std::string_view field : split(text, ',')) {
    const size_t eq = field.find('=');
    STRIDER_CHECK(eq != std::string_view::npos && eq > 0, "{}: LoRA field '{}' is not key=value (r=16,alpha=32,"
                  "targets=all-linear)", source, field);
    const std::string_view key = field.substr(0, eq), value = field.substr(eq + 1);
    if (key == "r") {
      const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), l.r);
      STRIDER_CHECK(ec == std::errc() && end == value.data() + value.size() && l.r >= 1 && l.r <= 65536,
                    "{}: LoRA r '{}' is not a rank from 1 to 65536", source, value);
    } else if (key == "alpha") {
      const std::string v(value);
      char* end = nullptr;
      l.alpha = std::strtod(v.c_str(), &end);
      STRIDER_CHECK(!v.empty() && end == v.c_str() + v.size() && std::isfinite(l.alpha) && l.alpha > 0,
                    "{}: LoRA alpha '{}' is not a positive number", source, value);
      // The adapters' output is scaled by alpha / r: past a million it overflows the compute dtype at the
      // first step instead of training (PEFT's recipes use alpha = r to 4r).
      STRIDER_CHECK(l.alpha <= kMaxLoraAlpha, "{}: LoRA alpha '{}' is past {:g}: its scale alpha / r would overflow "
                    "the adapters' output; typical values are r to 4r", source, value, kMaxLoraAlpha);
      have_alpha = true;
    } else if (key == "rslora") {
      STRIDER_CHECK(value == "0" || value == "1", "{}: LoRA rslora '{}' is not 0 or 1", source, value);
      l.rslora = value == "1";
    } else if (key == "targets") {
      l.targets.clear();
      for (std::string_view t : split(value, '+')) {
        if (t == "all-linear") {
          for (std::string_view m : kLinearModules) l.targets.emplace_back(m);
          continue;
        }
        STRIDER_CHECK(listed(kLinearModules, t), "{}: LoRA target '{}' is not a decoder layer's linear module ({}, "
                      "or all-linear)", source, t, fmt::join(kLinearModules, ", "));
        l.targets.emplace_back(t);
      }
    } else if (key == "train") {
      for (std::string_view t : split(value, '+')) {
        STRIDER_CHECK(listed(kFullModules, t), "{}: LoRA train '{}' is not a module strider trains in full beside "
                      "adapters ({})", source, t, fmt::join(kFullModules, ", "));
        if (!l.trains(t)) l.train.emplace_back(t);
      }
    } else {
      throw Error(fmt::format("{}: LoRA field '{}' is not one of r, alpha, rslora, targets, train", source, key));
    }
  }
  STRIDER_CHECK(l.r >= 1, "{}: LoRA '{}' gives no rank (r=...)", source, text);
  STRIDER_CHECK(have_alpha, "{}: LoRA '{}' gives no alpha (alpha=...)", source, text);
  STRIDER_CHECK(!l.targets.empty(), "{}: LoRA '{}' targets no module (targets=all-linear, or q_proj+v_proj, ...)",
                source, text);
  // Layer order, each once: the layout's order does not depend on how they were listed.
  std::vector<std::string> ordered;
  for (std::string_view m : kLinearModules)
    if (listed(l.targets, m)) ordered.emplace_back(m);
  l.targets = std::move(ordered);
  return l;
}

std::string LoraSpec::text() const {
  if (!enabled()) return "";
  std::string out = fmt::format("r={},alpha={},targets={}", r, alpha, fmt::join(targets, "+"));
  if (rslora) out += ",rslora=1";
  if (!train.empty()) out += fmt::format(",train={}", fmt::join(train, "+"));
  return out;
}

}  // namespace strider
