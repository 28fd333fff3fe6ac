// Command-line options made from the configuration's declaration
// (engine/config/config_fields.json): the flag, help, default, range or choices of
// each come from there, so `strider finetune`, `strider profile`, `strider
// plan`, the engine config JSON and the Python strider.EngineConfig agree.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "engine/config/config_fields.h"
#include "engine/config/engine_config.h"

namespace strider::cli {

class ConfigOptions {
 public:
  ConfigOptions() = default;
  ConfigOptions(const ConfigOptions&) = delete;  // it points into the options it filled
  ConfigOptions& operator=(const ConfigOptions&) = delete;

  // Registers field `name`'s option on `c`, writing into `target`, which
  // takes the field's default now. CLI11 keeps `target`'s address: it must
  // outlive parsing, as must this object. `help`, if given, replaces the
  // declaration's (a command that reads the field differently).
  CLI::Option* add(CLI::App& c, std::string_view name, int64_t& target, std::string help = "");
  CLI::Option* add(CLI::App& c, std::string_view name, int& target, std::string help = "");
  CLI::Option* add(CLI::App& c, std::string_view name, double& target, std::string help = "");
  CLI::Option* add(CLI::App& c, std::string_view name, std::string& target, std::string help = "");
  CLI::Option* add(CLI::App& c, std::string_view name, bool& target, std::string help = "");  // a flag

  // The built-in model trains from scratch, so it takes the declaration's
  // demo values (and, off CUDA, its CPU values) for every option the command
  // line left unset. Returns the line that says what it set and why; empty
  // when the command line set them all.
  std::string apply_demo(bool cuda);

  // The engine settings the registered options hold now (after parsing and
  // apply_demo), read as a config file's are (engine_config_from_json: the
  // declaration's default for a field with no option here, the rules between
  // settings checked): what the command carries to its plan and its engine.
  EngineConfig engine_settings() const;

 private:
  struct Bound {
    const ConfigField* field;
    CLI::Option* option;
    std::function<void(const nlohmann::json&)> set;
    std::function<nlohmann::json()> get;
  };
  CLI::Option* bind(CLI::App& c, const ConfigField& f, CLI::Option* opt, std::function<void(const nlohmann::json&)> set,
                    std::function<nlohmann::json()> get);
  std::vector<Bound> bound_;
};

}  // namespace strider::cli
