// Loading a training checkpoint (engine/checkpoint/train_checkpoint.h): what it says
// about itself, whether it fits the engine, and its state into the engine.
#include <algorithm>
#include <array>
#include <cstring>
#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>

#include <fmt/ranges.h>

#include "engine/checkpoint/parts.h"
#include "engine/checkpoint/reference_copy.h"
#include "engine/checkpoint/train_checkpoint.h"
#include "engine/config/config_fields.h"
#include "engine/config/engine_config_json.h"
#include "host/error.h"
#include "io/checksum.h"
#include "io/safetensors.h"

namespace strider {

using namespace train_checkpoint_parts;

namespace {

// Where the state tensors of a checkpoint directory are (index preferred, as
// transformers does); "" when neither exists.
std::string state_path(const fs::path& dir) {
  const fs::path index = dir / (std::string(kStateBase) + ".safetensors.index.json");
  if (fs::exists(index)) return index.string();
  const fs::path single = dir / (std::string(kStateBase) + ".safetensors");
  if (fs::exists(single)) return single.string();
  return {};
}

// The checksum of one (block, kind): its tensors' bytes in layout order.
uint64_t block_checksum(const std::vector<TensorView>& views) {
  Checksum64Stream cs;
  for (const TensorView& v : views) cs.update(v.bytes);
  return cs.digest();
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  STRIDER_CHECK(in, "{}: cannot open: {}", path.string(), errno_text(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  STRIDER_CHECK(!in.bad(), "{}: read failed", path.string());
  return ss.str();
}

}  // namespace

TrainCheckpointInfo inspect_training_checkpoint(const fs::path& dir_in) {
  const fs::path dir = normalise(dir_in);
  TrainCheckpointInfo info;
  if (fs::is_directory(dir)) info.path = dir;
  else if (fs::is_directory(old_of(dir))) info.path = old_of(dir);  // died between the renames
  else
    throw Error(fmt::format("no training checkpoint at {} (nor {}); check the path", dir.string(),
                            old_of(dir).string()));
  const fs::path file = info.path / kTrainerState;
  STRIDER_CHECK(fs::exists(file), "{}: missing; {} is not a complete strider training checkpoint",
                file.string(), info.path.string());
  nlohmann::json ts = nlohmann::json::parse(read_text(file), nullptr, false);
  STRIDER_CHECK(!ts.is_discarded() && ts.is_object(), "{}: not a JSON object", file.string());
  auto need = [&](const char* field, bool ok, const char* what) {
    STRIDER_CHECK(ts.contains(field), "{}: field '{}' is missing", file.string(), field);
    STRIDER_CHECK(ok, "{}: field '{}' must be {}, got {}", file.string(), field, what, ts[field].dump());
  };
  need("format", ts.contains("format") && ts["format"] == kFormat, "\"strider-train-checkpoint\"");
  need("version", ts.contains("version") && ts["version"] == kTrainCheckpointVersion,
       "1 (this build reads version 1)");
  need("step", ts.contains("step") && ts["step"].is_number_integer() && ts["step"].get<int64_t>() >= 0,
       "an integer >= 0");
  need("model_config", ts.contains("model_config") && ts["model_config"].is_object(), "an object");
  need("engine_config", ts.contains("engine_config") && ts["engine_config"].is_object(), "an object");
  need("checksums", ts.contains("checksums") && ts["checksums"].is_object(), "an object");
  STRIDER_CHECK(ts.contains("extra"), "{}: field 'extra' is missing", file.string());
  info.step = ts["step"].get<int64_t>();
  info.model_config_json = ts["model_config"].dump(2);
  info.engine_config = ts["engine_config"];
  info.extra = ts["extra"];
  info.trainer_state = std::move(ts);
  return info;
}

const std::vector<std::string>& maths_config_fields() {
  static const std::vector<std::string> kFields = [] {
    std::vector<std::string> out;
    for (const ConfigField& f : config_fields())
      if (f.scope == FieldScope::kMaths) out.push_back(f.name);
    return out;
  }();
  return kFields;
}

std::vector<std::string> maths_changes(const nlohmann::json& saved_config, const nlohmann::json& now,
                                       const std::vector<std::string>& allow_changed, const std::string& source) {
  std::vector<std::string> changed;
  for (const ConfigField& f : config_fields()) {
    if (f.scope != FieldScope::kMaths) continue;
    const std::string& n = f.name;
    // A checkpoint from before the field: what it meant then.
    const nlohmann::json saved = saved_config.value(n, f.absent_in_checkpoint);
    STRIDER_CHECK(!saved.is_null(), "{}: engine_config has no field '{}'", source, n);
    STRIDER_CHECK(now.contains(n), "the engine's config has no field '{}'", n);
    // Where the field cannot matter: decay without weight decay, the
    // gradients' transfer under the fp32 compute dtype (always fp32).
    if (n == "decay_norms_and_biases" && now["weight_decay"] == 0 && saved_config.value("weight_decay", 0.0) == 0)
      continue;
    if (n == "grad_transfer" && now["dtype"] == "fp32" && saved_config.value("dtype", "") == "fp32") continue;
    const bool allowed =
        !f.fixed_on_resume && std::find(allow_changed.begin(), allow_changed.end(), n) != allow_changed.end();
    if (saved == now[n] || allowed) continue;
    changed.push_back(fmt::format("{}: checkpoint {}, engine {}{}", n, saved.dump(), now[n].dump(),
                                  n == "optimizer_state"    ? " (converting the state between formats is done only "
                                                              "when asked: allow_changed optimizer_state)"
                                  : n == "packed_documents" ? " (whether a row's documents attend to each other; "
                                                              "the command line's --packed-documents=true or false "
                                                              "says it)"
                                  : n == "mlp_pieces"       ? " (the layers' cut into sub-layer pieces, which the plan "
                                                              "picks for the device's memory: --mlp-pieces N keeps "
                                                              "the saved run's)"
                                                            : ""));
  }
  return changed;
}

nlohmann::json load_training_checkpoint(const fs::path& dir, Engine& engine, const TrainLoadOptions& options) {
  const TrainCheckpointInfo info = inspect_training_checkpoint(dir);
  const std::string ts_file = (info.path / kTrainerState).string();
  const ModelSpec& spec = engine.spec();

  // 1. The model.
  const ModelSpec saved = saved_model(info.trainer_state["model_config"], info.engine_config, ts_file + " model_config");
  const auto diffs = spec_differences(saved, spec, "checkpoint");
  if (!diffs.empty())
    throw CheckpointMismatch(fmt::format("{}: the checkpoint is of another model ({}) than the engine's ({}): {}",
                                         ts_file, saved.summary(), spec.summary(), join(diffs, "; ")),
                             false);

  // 2. The engine config fields that change the maths. Those fixed on resume
  // first: their other value is another model (a LoRA base held in another
  // format has other values), which no option allows.
  const nlohmann::json now_config = engine_config_to_json(engine.config());
  for (const ConfigField& f : config_fields()) {
    if (!f.fixed_on_resume) continue;
    const nlohmann::json was = info.engine_config.value(f.name, f.absent_in_checkpoint);
    if (was != now_config[f.name])
      throw CheckpointMismatch(fmt::format("{}: {}: checkpoint {}, engine {}, which makes another model; resume with "
                                           "{} {}",
                                           ts_file, f.name, was.dump(), now_config[f.name].dump(), f.flag,
                                           was.is_string() ? was.get<std::string>() : was.dump()),
                               false);
  }
  const auto& fields = maths_config_fields();
  for (const std::string& f : options.allow_changed)
    STRIDER_CHECK(std::find(fields.begin(), fields.end(), f) != fields.end(),
                  "allow_changed names '{}', which is not one of the engine config's maths fields ({})", f,
                  join(fields, ", "));
  const std::vector<std::string> changed =
      maths_changes(info.engine_config, now_config, options.allow_changed, ts_file);
  if (!changed.empty())
    throw CheckpointMismatch(fmt::format("{}: the engine config changes the maths of the saved run: {}; use the "
                                         "saved values, or name the fields in allow_changed to resume anyway",
                                         ts_file, join(changed, "; ")));

  // 3. The tensors: every one present, F32, of the layout's shape, and nothing else.
  const std::string sp = state_path(info.path);
  STRIDER_CHECK(!sp.empty(), "{}: missing (nor {}.safetensors.index.json); the checkpoint is incomplete",
                (info.path / (std::string(kStateBase) + ".safetensors")).string(), kStateBase);
  SafetensorsCheckpoint ck(sp);
  const auto& meta = ck.files().front()->metadata();
  const auto it = meta.find("strider_step");
  STRIDER_CHECK(it != meta.end() && it->second == std::to_string(info.step),
                "{}: __metadata__ strider_step is {}, but {} says step {}; the files are of different saves",
                ck.files().front()->path(), it == meta.end() ? "missing" : it->second, ts_file, info.step);
  const int64_t blocks = spec.num_blocks();
  std::vector<std::string> problems;
  std::vector<std::array<std::vector<TensorView>, 3>> views{static_cast<size_t>(blocks)};
  size_t expected = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const ParamLayout l = spec.layout(b);
    for (int k = 0; k < 3; ++k)
      for (const TensorSlot& s : l.slots()) {
        if (!holds_state(s)) continue;
        const std::string name = s.name + kSuffix[k];
        ++expected;
        auto v = ck.find(name);
        if (!v) {
          problems.push_back(fmt::format("tensor '{}' is missing", name));
          continue;
        }
        if (v->dtype != DType::kF32 || !std::equal(v->shape.begin(), v->shape.end(), s.shape.begin(), s.shape.end())) {
          problems.push_back(fmt::format("tensor '{}' is {} [{}] in {}, expected F32 [{}]", name, dtype_name(v->dtype),
                                         fmt::join(v->shape, ", "), v->file, fmt::join(s.shape, ", ")));
          continue;
        }
        views[size_t(b)][size_t(k)].push_back(*v);
      }
  }
  if (ck.size() != expected)
    for (const std::string& n : ck.names()) {
      bool known = false;
      for (int64_t b = 0; !known && b < blocks; ++b)
        for (int k = 0; !known && k < 3; ++k)
          for (const TensorView& v : views[size_t(b)][size_t(k)]) known = known || v.name == n;
      if (!known) problems.push_back(fmt::format("unexpected tensor '{}'", n));
    }
  if (problems.size() > 12) {
    const size_t more = problems.size() - 12;
    problems.resize(12);
    problems.push_back(fmt::format("... and {} more", more));
  }
  STRIDER_CHECK(problems.empty(), "{}: does not hold the state of {}: {}", sp, spec.summary(), join(problems, "; "));

  // 4. Checksums (a bit flip the format itself cannot see).
  if (options.verify_checksums) {
    const nlohmann::json& sums = info.trainer_state["checksums"];
    for (int64_t b = 0; b < blocks; ++b) {
      const std::string block = spec.block_name(b);
      for (int k = 0; k < 3; ++k) {
        STRIDER_CHECK(sums.contains(block) && sums[block].contains(kKindKey[k]) && sums[block][kKindKey[k]].is_string(),
                      "{}: checksums.{}.{} is missing", ts_file, block, kKindKey[k]);
        const std::string want = sums[block][kKindKey[k]];
        const std::string got = hex64(block_checksum(views[size_t(b)][size_t(k)]));
        STRIDER_CHECK(got == want, "{}: the {} of block '{}' has checksum {}, but {} recorded {}; the file is "
                      "corrupt: use another checkpoint", sp, kKindKey[k], block, got, ts_file, want);
      }
    }
  }

  // 5. LoRA: the engine's base is the one the adapters were trained on.
  const nlohmann::json base_sums = info.trainer_state.value("base_checksums", nlohmann::json::object());
  std::vector<float> buf;
  if (!base_sums.empty()) {
    for (int64_t b = 0; b < blocks; ++b) {
      const ParamLayout l = spec.layout(b);
      buf.assign(l.total_elems(), 0.0f);
      engine.read_state(b, ExtentKind::kMaster, buf);
      const std::string want = base_sums.value(l.block_name(), std::string("?")), got = hex64(frozen_checksum(l, buf));
      if (got != want)
        throw CheckpointMismatch(fmt::format(
            "{}: the adapters were trained over another base: the engine's frozen tensors of block '{}' have "
            "fingerprint {}, the checkpoint's base {}; build the engine on the model the run started from",
            ts_file, l.block_name(), got, want),
            false);
    }
  }

  // 5b. fp16: the loss scale the run had reached (a checkpoint of another
  // dtype has none: the engine's initial scale stands).
  std::optional<LossScaleState> scale;
  if (engine.config().loss_scaled() && info.trainer_state.contains("loss_scale")) {
    const nlohmann::json& j = info.trainer_state["loss_scale"];
    STRIDER_CHECK(j.is_object() && j.value("scale", nlohmann::json()).is_number() &&
                      j.value("good_steps", nlohmann::json()).is_number_integer(),
                  "{}: 'loss_scale' is {}, not {{\"scale\": number, \"good_steps\": integer}}", ts_file, j.dump());
    scale = LossScaleState{j["scale"].get<double>(), j["good_steps"].get<int64_t>()};
    STRIDER_CHECK(std::isfinite(scale->scale) && scale->scale >= engine.config().loss_scaling.floor &&
                      scale->good_steps >= 0,
                  "{}: 'loss_scale' {} is not a finite scale of at least {} with good_steps >= 0", ts_file, j.dump(),
                  engine.config().loss_scaling.floor);
  }

  // 5c. The starting weights, where the engine keeps a reference copy.
  const ReferenceRead reference = check_reference_copy(info.path, info.trainer_state, engine, options.verify_checksums);

  // 6. Everything checked: now, and only now, the engine changes. A frozen
  // tensor keeps its values (the master buffer starts as the engine's).
  for (int64_t b = 0; b < blocks; ++b) {
    const ParamLayout l = spec.layout(b);
    const bool frozen = std::any_of(l.slots().begin(), l.slots().end(), [](const TensorSlot& s) { return !holds_state(s); });
    for (int k = 0; k < 3; ++k) {
      buf.assign(l.total_elems(), 0.0f);  // the layout's padding is zero in every kind
      if (k == 0 && frozen) engine.read_state(b, ExtentKind::kMaster, buf);
      const auto& vs = views[size_t(b)][size_t(k)];
      size_t i = 0;
      for (const TensorSlot& s : l.slots())
        if (holds_state(s)) {
          std::memcpy(buf.data() + s.offset_elems, vs[i].bytes.data(), vs[i].bytes.size());
          ++i;
        }
      engine.write_state(b, kKinds[k], buf);
    }
  }
  load_reference_copy(reference, engine);
  engine.set_steps_done(info.step);
  if (scale) engine.set_loss_scale(*scale);
  return info.extra;
}

std::vector<std::string> check_model_files(const TrainCheckpointInfo& info) {
  std::vector<std::string> problems;
  const nlohmann::json sums = info.trainer_state.value("model_checksums", nlohmann::json::object());
  for (const auto& [name, want] : sums.items()) {
    const fs::path file = info.path / name;
    std::error_code ec;
    if (!fs::is_regular_file(file, ec)) {
      problems.push_back(fmt::format("{} is missing", file.string()));
      continue;
    }
    try {
      const std::string got = hex64(file_checksum64(file.string()));
      if (got != want.get<std::string>())
        problems.push_back(fmt::format("{} has checksum {}, but its save recorded {}", file.string(), got,
                                       want.get<std::string>()));
    } catch (const Error& e) {
      problems.push_back(e.what());
    }
  }
  return problems;
}

}  // namespace strider
