// --config FILE: a TOML file read by toml++, an INI file (named *.ini) by inih.
// Each refuses what its spec does (a key given twice, text that is neither,
// bytes that are not UTF-8 in TOML): CLI11's own reader took both leniently,
// the first of two keys winning, a line without '=' a flag set to true.
#include <ini.h>

#include <algorithm>
#include <fmt/format.h>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <toml++/toml.h>

#include "engine/cli/cli.h"
#include "io/mapped_file.h"

namespace strider::cli {
namespace {

bool is_ini(const std::string& path) {
  const std::string ext = ".ini";
  std::string lower = path;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  return lower.size() > ext.size() && lower.compare(lower.size() - ext.size(), ext.size(), ext) == 0;
}

// A TOML value as the text CLI11 converts to the option's type.
std::vector<std::string> toml_inputs(const toml::node& node, const std::string& key) {
  std::vector<std::string> out;
  auto scalar = [&](const toml::node& n) {
    if (auto s = n.as_string()) return s->get();
    if (auto i = n.as_integer()) return std::to_string(i->get());
    if (auto f = n.as_floating_point()) return fmt::format("{}", f->get());
    if (auto b = n.as_boolean()) return std::string(b->get() ? "true" : "false");
    throw CLI::ConfigError(fmt::format("{}: a {} is no option's value (a string, number, boolean or an array of them)",
                                       key, n.type() == toml::node_type::table ? "table" : "date or time"));
  };
  if (const toml::array* a = node.as_array()) {
    for (const toml::node& e : *a) {
      if (e.is_array()) throw CLI::ConfigError(fmt::format("{}: an array of arrays is no option's value", key));
      out.push_back(scalar(e));
    }
  } else {
    out.push_back(scalar(node));
  }
  return out;
}

void toml_items(const toml::table& table, const std::vector<std::string>& parents, std::vector<CLI::ConfigItem>& out) {
  for (const auto& [key, node] : table) {
    if (const toml::table* sub = node.as_table()) {
      std::vector<std::string> inner = parents;
      inner.emplace_back(key.str());
      toml_items(*sub, inner, out);
      continue;
    }
    CLI::ConfigItem item;
    item.parents = parents;
    item.name = std::string(key.str());
    std::string full;
    for (const std::string& p : parents) full += p + ".";
    item.inputs = toml_inputs(node, full + item.name);
    out.push_back(std::move(item));
  }
}

std::vector<CLI::ConfigItem> read_toml(const std::string& text) {
  try {
    std::vector<CLI::ConfigItem> items;
    toml_items(toml::parse(text), {}, items);
    return items;
  } catch (const toml::parse_error& e) {
    const toml::source_region& at = e.source();
    throw CLI::ConfigError(fmt::format("line {}, column {}: {} (TOML, as the file is read unless its name ends in .ini)",
                                       at.begin.line, at.begin.column, e.description()));
  }
}

// inih calls this for each key; configparser's strict mode (its default)
// refuses a key given twice in one section, and so does this.
struct IniRead {
  std::vector<CLI::ConfigItem> items;
  std::set<std::pair<std::string, std::string>> seen;
  std::string error;
};

int ini_key(void* user, const char* section, const char* name, const char* value) {
  auto& r = *static_cast<IniRead*>(user);
  if (!r.seen.insert({section, name}).second) {
    r.error = fmt::format("'{}' is given twice{}", name, *section ? fmt::format(" in section [{}]", section) : "");
    return 0;
  }
  CLI::ConfigItem item;
  if (*section) item.parents.emplace_back(section);
  item.name = name;
  item.inputs = {value};
  r.items.push_back(std::move(item));
  return 1;
}

std::vector<CLI::ConfigItem> read_ini(const std::string& text) {
  // What inih does not check: a line longer than its buffer (INI_MAX_LINE,
  // 200 bytes), which it would parse as two, and a [section] given twice,
  // which configparser refuses.
  std::istringstream lines(text);
  std::set<std::string> sections;
  int n = 0;
  for (std::string line; std::getline(lines, line);) {
    ++n;
    if (line.size() >= 199) throw CLI::ConfigError(fmt::format("line {} is longer than 198 bytes, the INI reader's limit", n));
    const size_t close = line.find(']');  // an indented line continues the value above it
    if (line.empty() || line[0] != '[' || close == std::string::npos) continue;
    if (!sections.insert(line.substr(1, close - 1)).second)
      throw CLI::ConfigError(fmt::format("line {}: section {} is given twice", n, line.substr(0, close + 1)));
  }
  IniRead r;
  const int line = ini_parse_string(text.c_str(), ini_key, &r);
  if (line != 0)
    throw CLI::ConfigError(fmt::format("line {}: {} (INI, as a file named *.ini is read; a line is [section], key = value, "
                                       "or a comment starting with ; or #)",
                                       line, r.error.empty() ? "not INI" : r.error));
  return r.items;
}

// CLI11 reads a config file on the main app, where a subcommand's options sit
// in its [section]. Ours holds one command's options at the top: they are
// that command's, so each top-level key is moved into the section of the
// subcommand the command line chose (finetune when none).
class CommandConfig final : public CLI::ConfigTOML {
 public:
  explicit CommandConfig(const CLI::App& app) : app_(app) {}

  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override {
    const std::string path = app_.get_config_ptr()->as<std::string>();
    const std::string text{std::istreambuf_iterator<char>(input), std::istreambuf_iterator<char>()};
    std::vector<CLI::ConfigItem> items = is_ini(path) ? read_ini(text) : read_toml(text);
    const auto chosen = app_.get_subcommands();
    const std::string command = chosen.empty() ? "finetune" : chosen.front()->get_name();
    for (CLI::ConfigItem& item : items)
      if (item.parents.empty() || item.parents.front() != command) item.parents.insert(item.parents.begin(), command);
    return items;
  }

 private:
  const CLI::App& app_;
};

}  // namespace

CLI::Option* add_config_file(CLI::App& app) {
  app.config_formatter(std::make_shared<CommandConfig>(app));
  app.allow_config_extras(CLI::config_extras_mode::error);
  app.fallthrough();  // the subcommands made after this pass --config up to the main app
  const std::string what =
      "a TOML file (an INI file when its name ends in .ini) of the command's options, each under its long name without "
      "the dashes (seq = 1024, device-budget = \"20GiB\"); the command line's own options win";
  app.footer("--config FILE (after the command): " + what);
  return app.set_config("--config", "", what)
      ->check(CLI::ExistingFile)
      ->check(CLI::Validator(
          [](std::string& path) -> std::string {
            // A regular file: a FIFO (or a device) would block the parse that reads it.
            try {
              check_regular_input(path, "a config file is TOML or INI text");
              return "";
            } catch (const std::exception& e) {
              return e.what();
            }
          },
          "FILE"));
}

}  // namespace strider::cli
