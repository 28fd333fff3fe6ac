#include "engine/config/config_fields.h"

#include <CLI/Error.hpp>
#include <CLI/Validators.hpp>
#include <algorithm>
#include <cctype>
#include <cmath>
#include <fmt/format.h>
#include <map>

#include "host/error.h"

namespace strider {
namespace detail {
// engine/config/config_fields.json, as CMake embedded it (config_fields_text.cpp.in).
extern const char kConfigFieldsJson[];
}  // namespace detail

namespace {

constexpr const char* kFile = "engine/config/config_fields.json";

FieldType parse_type(const std::string& t, const std::string& field) {
  static const std::pair<const char*, FieldType> kTypes[] = {
      {"int", FieldType::kInt},   {"number", FieldType::kNumber}, {"bool", FieldType::kBool},
      {"choice", FieldType::kChoice}, {"text", FieldType::kText}, {"size", FieldType::kSize},
      {"ints", FieldType::kInts}};
  for (auto [name, type] : kTypes)
    if (t == name) return type;
  throw Error(fmt::format("{}: field '{}' has unknown type '{}'", kFile, field, t));
}

struct Declaration {
  std::vector<ConfigField> fields;
  DemoValues demo;
  std::map<std::string, double> units;
};

const Declaration& declaration() {
  static const Declaration d = [] {
    Declaration out;
    const nlohmann::json j = nlohmann::json::parse(detail::kConfigFieldsJson);
    for (const auto& f : j.at("fields")) {
      ConfigField c;
      c.name = f.at("name");
      c.flag = f.value("flag", "");
      c.type = parse_type(f.at("type"), c.name);
      c.default_value = f.at("default");
      c.has_min = f.contains("min");
      c.has_max = f.contains("max");
      c.min = f.value("min", 0.0);
      c.max = f.value("max", 0.0);
      c.min_open = f.value("min_open", false);
      c.max_open = f.value("max_open", false);
      c.choices = f.value("choices", std::vector<std::string>{});
      c.help = f.at("help");
      const std::string scope = f.at("scope");
      c.scope = scope == "maths"       ? FieldScope::kMaths
                : scope == "placement" ? FieldScope::kPlacement
                : scope == "model"     ? FieldScope::kModel
                                       : FieldScope::kRun;
      STRIDER_CHECK(c.scope != FieldScope::kRun || scope == "run",
                    "{}: field '{}' has scope '{}', not maths, placement, model or run", kFile, c.name, scope);
      c.engine = c.scope != FieldScope::kRun;
      c.absent_in_checkpoint = f.value("absent_in_checkpoint", nlohmann::json());
      STRIDER_CHECK(c.absent_in_checkpoint.is_null() || c.scope == FieldScope::kMaths,
                    "{}: field '{}' has absent_in_checkpoint, which only a maths field takes", kFile, c.name);
      c.fixed_on_resume = f.value("fixed_on_resume", false);
      STRIDER_CHECK(!c.fixed_on_resume || c.scope == FieldScope::kMaths,
                    "{}: field '{}' is fixed_on_resume, which only a maths field is", kFile, c.name);
      out.fields.push_back(std::move(c));
    }
    out.demo.why = j.at("demo").at("why");
    out.demo.values = j.at("demo").at("values");
    out.demo.cpu_values = j.at("demo").at("cpu_values");
    // Without a unit a size is bytes: CLI11's parser takes that case itself.
    for (const auto& [unit, factor] : j.at("size_units").items())
      if (!unit.empty()) out.units[unit] = factor.get<double>();
    STRIDER_CHECK(j.at("max_size_bytes").get<uint64_t>() == kMaxSizeBytes, "{}: max_size_bytes is not kMaxSizeBytes",
                  kFile);
    // Every default is a value its own field takes.
    for (const ConfigField& c : out.fields) check_config_value(c, c.default_value, kFile);
    return out;
  }();
  return d;
}

std::string shown(const nlohmann::json& v) { return v.is_string() ? "'" + v.get<std::string>() + "'" : v.dump(); }

bool in_range(const ConfigField& f, double x) {
  if (f.has_min && (f.min_open ? x <= f.min : x < f.min)) return false;
  if (f.has_max && (f.max_open ? x >= f.max : x > f.max)) return false;
  return true;
}

std::string choices_text(const std::vector<std::string>& c) {
  std::string out;
  for (size_t i = 0; i < c.size(); ++i) out += (i == 0 ? "" : i + 1 == c.size() ? " or " : ", ") + c[i];
  return out;
}

}  // namespace

std::string ConfigField::range_text() const {
  if (!has_min && !has_max) return "";
  auto num = [&](double x) { return type == FieldType::kNumber ? fmt::format("{}", x) : fmt::format("{}", int64_t(x)); };
  return fmt::format("{}{}, {}{}", min_open ? "(" : "[", has_min ? num(min) : "-inf", has_max ? num(max) : "inf",
                     max_open ? ")" : "]");
}

const std::vector<ConfigField>& config_fields() { return declaration().fields; }

const ConfigField& config_field(std::string_view name) {
  for (const ConfigField& f : config_fields())
    if (f.name == name) return f;
  throw Error(fmt::format("no configuration field '{}' ({})", name, kFile));
}

const DemoValues& demo_values() { return declaration().demo; }

std::string config_value_problem(const ConfigField& f, const nlohmann::json& v) {
  auto integer_problem = [&](const nlohmann::json& x) -> std::string {
    if (!x.is_number_integer()) return fmt::format("is not an integer (expected one in {})", f.range_text());
    const double d = x.is_number_unsigned() ? double(x.get<uint64_t>()) : double(x.get<int64_t>());
    return in_range(f, d) ? "" : "is outside " + f.range_text();
  };
  const auto is_choice = [&] {
    return v.is_string() && std::find(f.choices.begin(), f.choices.end(), v.get<std::string>()) != f.choices.end();
  };
  switch (f.type) {
    case FieldType::kInt:
      return integer_problem(v);
    case FieldType::kNumber:
      if (!v.is_number()) return fmt::format("is not a number (expected one in {})", f.range_text());
      // NaN is outside every range, and so is infinity.
      return std::isfinite(v.get<double>()) && in_range(f, v.get<double>()) ? "" : "is outside " + f.range_text();
    case FieldType::kBool:
      return v.is_boolean() ? "" : "is not true or false";
    case FieldType::kChoice:
      return is_choice() ? "" : "is not " + choices_text(f.choices);
    case FieldType::kText:
      return v.is_string() ? "" : "is not text";
    case FieldType::kSize:
      if (is_choice()) return "";
      if (v.is_number_integer()) {
        if (!v.is_number_unsigned() && v.get<int64_t>() < 0) return "is negative";
        return v.get<uint64_t>() <= kMaxSizeBytes
                   ? ""
                   : fmt::format("is past the largest size strider accepts ({}, 1 EiB)", kMaxSizeBytes);
      }
      if (!v.is_string())
        return fmt::format("is not a size (such as 20GiB, or a number of bytes) or {}", choices_text(f.choices));
      try {
        parse_bytes(v.get<std::string>());
      } catch (const Error& e) {
        // parse_bytes names the text itself: say the rest.
        const std::string why = e.what(), own = "'" + v.get<std::string>() + "' ";
        return why.rfind(own, 0) == 0 ? why.substr(own.size()) : why;
      }
      return "";
    case FieldType::kInts:
      if (!v.is_array()) return "is not a list of integers";
      for (const auto& x : v)
        if (std::string p = integer_problem(x); !p.empty()) return "holds " + x.dump() + ", which " + p;
      return "";
  }
  return "";
}

void check_config_value(const ConfigField& f, const nlohmann::json& v, std::string_view where) {
  const std::string problem = config_value_problem(f, v);
  STRIDER_CHECK(problem.empty(), "{}: field '{}' = {} {}", where, f.name, shown(v), problem);
}

uint64_t parse_bytes(const std::string& text) {
  // CLI11's number-with-unit parser checks the text: a number, then a unit of
  // the declaration's table (k and KiB are 1024, KB 1000), case aside.
  static const CLI::AsNumberWithUnit parser(declaration().units, CLI::AsNumberWithUnit::CASE_INSENSITIVE);
  // "inf" and "nan" are numbers to strtod, and a unit to CLI11.
  if (size_t used = 0; !text.empty()) try {
      const long double x = std::stold(text, &used);
      STRIDER_CHECK(used != text.size() || std::isfinite(x),
                    "size '{}' is past the largest strider accepts ({}, 1 EiB)", text, kMaxSizeBytes);
    } catch (const std::logic_error&) {
      // not a number at all: CLI11 says why below
    }
  std::string checked = text;
  std::string error;
  try {
    error = parser(checked);
  } catch (const CLI::ValidationError& e) {
    error = e.what();
  }
  if (!error.empty())
    throw Error(fmt::format("'{}' is not a size (use e.g. 24GiB, 512MiB, 2e9; units B, KiB, MiB, GiB, TiB, or KB, "
                            "MB, GB, TB): {}",
                            text, error));
  // It writes the product back at six significant digits, so the bytes are
  // computed again from its split (the trailing letters are the unit): exact
  // for "24GiB", correctly rounded for "1.5GB".
  const size_t end = text.find_last_not_of(" \t") + 1;
  size_t unit = end;
  while (unit > 0 && std::isalpha(static_cast<unsigned char>(text[unit - 1]))) --unit;
  std::string name = text.substr(unit, end - unit);
  for (char& ch : name) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  const std::string number = text.substr(0, unit);
  long double bytes = number.find_first_not_of(" \t") == std::string::npos ? 1.0L : std::stold(number);
  if (!name.empty()) bytes *= static_cast<long double>(declaration().units.at(name));
  STRIDER_CHECK(bytes >= 0, "size '{}' is negative", text);
  // Past every machine (and past what a uint64 holds a little later): a typo.
  STRIDER_CHECK(std::isfinite(bytes) && bytes <= static_cast<long double>(kMaxSizeBytes),
                "size '{}' is past the largest strider accepts ({}, 1 EiB)", text, kMaxSizeBytes);
  return uint64_t(std::llroundl(bytes));
}

}  // namespace strider
