#include "engine/cli/config_options.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/cli/cli.h"
#include "engine/config/engine_config_json.h"
#include "host/error.h"

namespace strider::cli {
namespace {

// The text the command line gave, as the JSON value the declaration checks:
// a number for int and number fields (any other text is then refused by
// type), the text itself otherwise.
nlohmann::json as_value(const ConfigField& f, const std::string& text) {
  if (int64_t i = 0; f.type == FieldType::kInt && CLI::detail::lexical_cast(text, i)) return i;
  if (double d = 0; f.type == FieldType::kNumber && CLI::detail::lexical_cast(text, d)) return d;
  return text;
}

std::string help_of(const ConfigField& f, std::string help) { return help.empty() ? f.help : help; }

}  // namespace

CLI::Option* ConfigOptions::bind(CLI::App& c, const ConfigField& f, CLI::Option* opt,
                                 std::function<void(const nlohmann::json&)> set,
                                 std::function<nlohmann::json()> get) {
  STRIDER_CHECK(!f.flag.empty(), "configuration field '{}' has no command-line flag (engine/config/config_fields.json)",
                f.name);
  const ConfigField* field = &f;
  opt->capture_default_str()->check(CLI::Validator(
      [field](std::string& text) -> std::string {
        const std::string problem = config_value_problem(*field, as_value(*field, text));
        return problem.empty() ? "" : text + " " + problem;
      },
      f.type == FieldType::kChoice ? "{" + fmt::format("{}", fmt::join(f.choices, ",")) + "}"
      : f.range_text().empty()     ? ""
                                   : "in " + f.range_text()));
  bound_.push_back({field, opt, std::move(set), std::move(get)});
  (void)c;
  return opt;
}

CLI::Option* ConfigOptions::add(CLI::App& c, std::string_view name, int64_t& target, std::string help) {
  const ConfigField& f = config_field(name);
  target = f.default_value.get<int64_t>();
  return bind(c, f, c.add_option(f.flag, target, help_of(f, std::move(help))),
              [&target](const nlohmann::json& v) { target = v.get<int64_t>(); }, [&target] { return nlohmann::json(target); });
}

CLI::Option* ConfigOptions::add(CLI::App& c, std::string_view name, int& target, std::string help) {
  const ConfigField& f = config_field(name);
  target = f.default_value.get<int>();
  return bind(c, f, c.add_option(f.flag, target, help_of(f, std::move(help))),
              [&target](const nlohmann::json& v) { target = v.get<int>(); }, [&target] { return nlohmann::json(target); });
}

CLI::Option* ConfigOptions::add(CLI::App& c, std::string_view name, double& target, std::string help) {
  const ConfigField& f = config_field(name);
  target = f.default_value.get<double>();
  return bind(c, f, c.add_option(f.flag, target, help_of(f, std::move(help))),
              [&target](const nlohmann::json& v) { target = v.get<double>(); }, [&target] { return nlohmann::json(target); });
}

CLI::Option* ConfigOptions::add(CLI::App& c, std::string_view name, std::string& target, std::string help) {
  const ConfigField& f = config_field(name);
  target = f.default_value.is_string() ? f.default_value.get<std::string>() : f.default_value.dump();
  return bind(c, f, c.add_option(f.flag, target, help_of(f, std::move(help))),
              [&target](const nlohmann::json& v) { target = v.is_string() ? v.get<std::string>() : v.dump(); },
              [&target, &f] { return as_value(f, target); });
}

CLI::Option* ConfigOptions::add(CLI::App& c, std::string_view name, bool& target, std::string help) {
  const ConfigField& f = config_field(name);
  STRIDER_CHECK(!f.flag.empty() && f.type == FieldType::kBool,
                "configuration field '{}' is not a bool with a command-line flag (engine/config/config_fields.json)", f.name);
  target = f.default_value.get<bool>();
  CLI::Option* opt = c.add_flag(f.flag, target, help_of(f, std::move(help)));
  bound_.push_back({&f, opt, [&target](const nlohmann::json& v) { target = v.get<bool>(); },
                    [&target] { return nlohmann::json(target); }});
  return opt;
}

std::string ConfigOptions::apply_demo(bool cuda) {
  const DemoValues& demo = demo_values();
  std::vector<std::string> set;
  for (const Bound& b : bound_) {
    const nlohmann::json* v = demo.values.contains(b.field->name)                ? &demo.values[b.field->name]
                              : !cuda && demo.cpu_values.contains(b.field->name) ? &demo.cpu_values[b.field->name]
                                                                                 : nullptr;
    if (v == nullptr || b.option->count() > 0) continue;
    b.set(*v);
    set.push_back(fmt::format("{} {}", b.field->flag, v->is_string() ? v->get<std::string>() : v->dump()));
  }
  if (set.empty()) return "";
  return fmt::format("demo settings ({}; the command line's own options win): {}", demo.why, fmt::join(set, ", "));
}

EngineConfig ConfigOptions::engine_settings() const {
  nlohmann::json given = nlohmann::json::object();
  for (const Bound& b : bound_)
    if (b.field->engine) given[b.field->name] = b.get();
  const EngineConfig c = engine_config_from_json(given, /*check_rules=*/false);
  // The rules between settings, each refusal naming the options as given.
  const std::vector<SettingsProblem> problems = settings_problems(c);
  if (problems.empty()) return c;
  const SettingsProblem& p = problems.front();
  auto option = [&](const std::string& name) {
    const ConfigField& f = config_field(name);
    const nlohmann::json v = given.contains(name) ? given[name] : f.default_value;
    return fmt::format("{} {}", f.flag.empty() ? name : f.flag, v.is_string() ? v.get<std::string>() : v.dump());
  };
  throw Error(fmt::format("{}{}: {}", option(p.field), p.other.empty() ? "" : " with " + option(p.other), p.text));
}

}  // namespace strider::cli
