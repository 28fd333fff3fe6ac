// The run configuration's one declaration (engine/config/config_fields.json): every
// field's name, command-line flag, type, range or choices, help and default.
// The command line registers its options from it (engine/cli/config_options.h),
// the engine config JSON round trip and checkpoints check against it and take
// their defaults from it (engine/config/engine_config_json.h), and the Python
// strider.EngineConfig is built from the same file (python_shim/strider/config.py).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace strider {

enum class FieldType { kInt, kNumber, kBool, kChoice, kText, kSize, kInts };

// What a field is to a run (engine/config/config_fields.json's "scope"):
// kMaths, kPlacement and kModel are in the engine config and every
// checkpoint; a resume must keep a maths field (it changes the numbers) and
// may change a placement field (the numbers are bit-identical either way); a
// model field is part of the model the engine trains, compared with it.
// kRun is chosen for each run (the device) and saved nowhere.
enum class FieldScope { kMaths, kPlacement, kModel, kRun };

struct ConfigField {
  std::string name;        // JSON and Python: "micro_batch"
  std::string flag;        // the command line's: "--micro-batch"; empty: not an option
  FieldType type = FieldType::kInt;
  nlohmann::json default_value;
  double min = 0, max = 0;  // kInt, kNumber, kInts' elements: the range (see min_open, max_open)
  bool has_min = false, has_max = false, min_open = false, max_open = false;
  std::vector<std::string> choices;  // kChoice: the values; kSize: words taken besides a size ("auto")
  std::string help;
  FieldScope scope = FieldScope::kMaths;
  bool engine = true;      // scope other than run: in EngineConfig and every checkpoint
  // A maths field added after the first checkpoints: what a checkpoint
  // without it meant (null: every checkpoint has it).
  nlohmann::json absent_in_checkpoint;
  // A maths field no allow_changed lets a resume change: its other value is
  // another model (base_format: a base held in another format has other values).
  bool fixed_on_resume = false;
  std::string range_text() const;  // "[1, 16777216]", "(0, 1]"; empty without a range
};

const std::vector<ConfigField>& config_fields();
// Throws naming `name` when no field has it.
const ConfigField& config_field(std::string_view name);

// What is wrong with `value` for field `f` ("is outside [1, 16777216]", "is
// not bf16 or fp32"); empty when nothing is.
std::string config_value_problem(const ConfigField& f, const nlohmann::json& value);
// Checks one value of field `f`, throwing "<where>: field '<name>' = <value>
// <what is wrong>" (its type, its range, its choices).
void check_config_value(const ConfigField& f, const nlohmann::json& value, std::string_view where);

// The demo's values (the built-in model, which trains from scratch) for what
// the user left unset, on any device and on the CPU device (its budget), and
// why the demo takes them.
struct DemoValues {
  nlohmann::json values, cpu_values;
  std::string why;
};
const DemoValues& demo_values();

// "24GiB", "512 MiB", "1.5GB", "2e9", "123456" -> bytes, by CLI11's
// number-with-unit parser over the declaration's units; throws naming the
// text, and the limit for a size past kMaxSizeBytes.
inline constexpr uint64_t kMaxSizeBytes = uint64_t{1} << 60;
uint64_t parse_bytes(const std::string& text);

}  // namespace strider
