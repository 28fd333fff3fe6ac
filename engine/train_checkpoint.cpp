#include "engine/train_checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include <fmt/ranges.h>

#include "engine/engine_config_json.h"
#include "engine/hf_checkpoint.h"
#include "host/error.h"
#include "io/atomic_file.h"
#include "io/checksum.h"
#include "io/safetensors.h"

namespace strider {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "strider-train-checkpoint";
constexpr const char* kTrainerState = "trainer_state.json";
constexpr const char* kStateBase = "state";
constexpr ExtentKind kKinds[3] = {ExtentKind::kMaster, ExtentKind::kAdamM, ExtentKind::kAdamV};
constexpr const char* kSuffix[3] = {"", ".exp_avg", ".exp_avg_sq"};  // torch.optim.AdamW's names
constexpr const char* kKindKey[3] = {"master", "exp_avg", "exp_avg_sq"};

// "ckpt/" and "ckpt" name the same checkpoint; ".old" and the temp names hang off the last component.
fs::path normalise(const fs::path& dir) {
  fs::path p = dir.lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  STRIDER_CHECK(!p.empty() && p.filename() != "." && p.filename() != "..",
                "training checkpoint: '{}' does not name a directory to save into", dir.string());
  return p;
}
fs::path parent_of(const fs::path& dir) {
  return dir.has_parent_path() ? dir.parent_path() : fs::path(".");
}
fs::path old_of(const fs::path& dir) { return fs::path(dir.string() + ".old"); }
std::string temp_prefix(const fs::path& dir) { return "." + dir.filename().string() + ".tmp-"; }

std::string hex64(uint64_t x) { return fmt::format("{:016x}", x); }

// Removes a temp directory unless published; never throws.
struct TempDirGuard {
  fs::path path;
  bool published = false;
  ~TempDirGuard() {
    if (published || path.empty()) return;
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

void rename_or_throw(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  STRIDER_CHECK(!ec, "cannot rename {} to {}: {}", from.string(), to.string(), ec.message());
}

// Every difference between two models that changes which tensors exist or
// what they compute; empty when they are the same model.
// `source` names where `ckpt` came from ("checkpoint", "config given").
std::vector<std::string> spec_differences(const ModelSpec& ckpt, const ModelSpec& engine, const char* source) {
  std::vector<std::string> d;
  auto cmp = [&](const char* field, const auto& a, const auto& b) {
    if (!(a == b)) d.push_back(fmt::format("{}: {} {}, engine {}", field, source, a, b));
  };
  const BlockDims &a = ckpt.dims, &b = engine.dims;
  cmp("architecture", ckpt.arch_name, engine.arch_name);
  cmp("num_hidden_layers", ckpt.layers, engine.layers);
  cmp("max_position_embeddings", ckpt.max_position, engine.max_position);
  cmp("tie_word_embeddings", ckpt.tie_embeddings, engine.tie_embeddings);
  cmp("hidden_size", a.hidden, b.hidden);
  cmp("num_attention_heads", a.heads, b.heads);
  cmp("num_key_value_heads", a.kv_heads, b.kv_heads);
  cmp("head_dim", a.head_dim, b.head_dim);
  cmp("intermediate_size", a.intermediate, b.intermediate);
  cmp("vocab_size", a.vocab, b.vocab);
  cmp("rms_norm_eps", a.rms_eps, b.rms_eps);
  cmp("rope type", static_cast<int>(a.rope.type), static_cast<int>(b.rope.type));
  cmp("rope_theta", a.rope.theta, b.rope.theta);
  cmp("rope factor", a.rope.factor, b.rope.factor);
  cmp("rope low_freq_factor", a.rope.low_freq_factor, b.rope.low_freq_factor);
  cmp("rope high_freq_factor", a.rope.high_freq_factor, b.rope.high_freq_factor);
  cmp("rope original_max_position_embeddings", a.rope.original_max_position,
      b.rope.original_max_position);
  cmp("qkv bias", a.qkv_bias, b.qkv_bias);
  cmp("o_proj bias", a.o_bias, b.o_bias);
  cmp("mlp_bias", a.mlp_bias, b.mlp_bias);
  cmp("qk norm", a.qk_norm, b.qk_norm);
  cmp("sliding_window", a.sliding_window, b.sliding_window);
  if (!d.empty()) return d;
  // Same numbers; the layouts must then agree too (a guard against a parser change).
  for (int64_t i = 0; i < engine.num_blocks(); ++i) {
    const ParamLayout x = ckpt.layout(i), y = engine.layout(i);
    bool same = x.total_elems() == y.total_elems() && x.slots().size() == y.slots().size();
    for (size_t s = 0; same && s < x.slots().size(); ++s)
      same = x.slots()[s].name == y.slots()[s].name && x.slots()[s].shape == y.slots()[s].shape &&
             x.slots()[s].offset_elems == y.slots()[s].offset_elems;
    if (!same) d.push_back(fmt::format("layout of block '{}' differs", y.block_name()));
  }
  return d;
}

std::string join(const std::vector<std::string>& items, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? std::string(sep) : "") + items[i];
  return out;
}

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

// The state as a save reads it, block by block and kind by kind (host
// memory: one block's buffer whatever the model's size). A sharded engine's
// read_state gathers the block from every rank, so every rank runs this in
// step: rank 0 in save_impl, the others in serve_training_checkpoint. Every
// rank holds the whole block then, so all refuse a non-finite state together.
template <class Fn>
void read_blocks(Engine& engine, Fn&& fn) {
  const ModelSpec& spec = engine.spec();
  std::vector<float> buf;
  for (int64_t b = 0; b < spec.num_blocks(); ++b) {
    const ParamLayout l = spec.layout(b);
    buf.assign(l.total_elems(), 0.0f);
    for (int k = 0; k < 3; ++k) {
      engine.read_state(b, kKinds[k], buf);
      // A checkpoint is a state to go back to: never one that went non-finite.
      if (k == 0)
        for (const TensorSlot& s : l.slots())
          for (size_t i = 0; i < s.numel; ++i)
            STRIDER_CHECK(std::isfinite(buf[s.offset_elems + i]),
                          "parameter '{}' holds {} at element {} at step {}: refusing to save a non-finite state",
                          s.name, buf[s.offset_elems + i], i, engine.steps_done());
      fn(b, k, l, std::span<const float>(buf));
    }
  }
}

void save_impl(const fs::path& dir, Engine& engine, std::string_view model_config_json,
               const nlohmann::json& extra, const TrainCheckpointOptions& options) {
  const ModelSpec& spec = engine.spec();
  // The model config first: a wrong one must fail before any file exists.
  nlohmann::json model_config = nlohmann::json::parse(model_config_json, nullptr, false);
  STRIDER_CHECK(!model_config.is_discarded() && model_config.is_object(),
                "the model config.json text given is not a JSON object; pass the model's config.json");
  const auto diffs = spec_differences(ModelSpec::from_json(model_config, "model config to save"), spec,
                                      "config given");
  STRIDER_CHECK(diffs.empty(), "the model config given describes another model than the engine's "
                "({}): {}; pass the config.json of the model being trained", spec.summary(), join(diffs, "; "));

  const fs::path parent = parent_of(dir);
  std::error_code ec;
  fs::create_directories(parent, ec);
  STRIDER_CHECK(!ec, "cannot create the directory {}: {}", parent.string(), ec.message());
  STRIDER_CHECK(!fs::exists(dir) || fs::is_directory(dir), "{} exists and is not a directory; "
                "choose another checkpoint path", dir.string());
  // Publishing replaces <dir> wholesale: never a directory that is not ours.
  STRIDER_CHECK(!fs::exists(dir) || fs::exists(dir / kTrainerState), "{} exists and is not a strider "
                "training checkpoint (no {}); refusing to replace it: choose another path", dir.string(),
                kTrainerState);
  // Temp directories of saves that died (one saver per dir: none of them is live).
  const std::string prefix = temp_prefix(dir);
  for (const auto& entry : fs::directory_iterator(parent))
    if (entry.path().filename().string().starts_with(prefix)) fs::remove_all(entry.path(), ec);

  static std::atomic<uint64_t> counter{0};
  TempDirGuard tmp{parent / fmt::format("{}{}-{}", prefix, ::getpid(), counter++)};
  STRIDER_CHECK(fs::create_directory(tmp.path, ec) && !ec, "cannot create the temporary directory {}: {}",
                tmp.path.string(), ec ? ec.message() : "it exists");

  engine.finish_updates();
  const int64_t step = engine.steps_done();
  const int64_t blocks = spec.num_blocks();

  std::vector<TensorSpec> specs;
  for (int64_t b = 0; b < blocks; ++b) {
    const ParamLayout l = spec.layout(b);
    for (int k = 0; k < 3; ++k)
      for (const TensorSlot& s : l.slots()) specs.push_back({s.name + kSuffix[k], DType::kF32, s.shape});
  }
  SafetensorsWriteOptions sopt;
  sopt.max_shard_bytes = options.state_shard_bytes;
  sopt.base_name = kStateBase;
  sopt.metadata = {{"format", "pt"}, {"strider_step", std::to_string(step)}};
  SafetensorsWriter state(tmp.path.string(), std::move(specs), sopt);
  std::optional<HfCheckpointWriter> model;
  if (options.write_model)
    model.emplace(tmp.path.string(), spec, model_config_json,
                  HfWriteOptions{options.model_dtype, options.model_shard_bytes});

  nlohmann::json checksums = nlohmann::json::object();
  size_t index = 0;
  // The model file in bf16 from a bf16 compute copy: its values, exactly
  // (every rank holds the whole compute copy); else the master.
  const bool model_from_compute = options.model_dtype == DType::kBF16 && engine.config().compute.dtype == at::kBFloat16;
  read_blocks(engine, [&](int64_t b, int k, const ParamLayout& l, std::span<const float> buf) {
    Checksum64Stream cs;
    for (const TensorSlot& s : l.slots()) {
      const auto bytes = std::as_bytes(buf.subspan(s.offset_elems, s.numel));
      state.write(index++, bytes);
      cs.update(bytes);
    }
    checksums[l.block_name()][kKindKey[k]] = hex64(cs.digest());
    if (k == 0 && model) {
      if (model_from_compute) {
        std::vector<float> w(l.total_elems());
        engine.model_weights(b, options.model_dtype, w);
        model->write_block(b, w);
      } else {
        model->write_block(b, buf);
      }
    }
  });
  state.finish();
  // The exportable model's files, as written: a copy damaged later is then
  // found (check_model_files), not exported silently.
  nlohmann::json model_checksums = nlohmann::json::object();
  if (model) {
    model->finish();
    for (const std::string& name : model->file_names())
      model_checksums[name] = hex64(file_checksum64((tmp.path / name).string()));
  }

  nlohmann::json ts = {{"format", kFormat},
                       {"version", kTrainCheckpointVersion},
                       {"step", step},
                       {"model", spec.summary()},
                       {"model_config", model_config},
                       {"engine_config", engine_config_to_json(engine.config())},
                       {"state_files", state.file_names()},
                       {"model_files", model ? model->file_names() : std::vector<std::string>{}},
                       {"checksums", checksums},
                       {"checksum", "xxh3-64 of each block's tensors in layout order, per kind"},
                       {"model_checksums", model_checksums},  // xxh3-64 of each model file's bytes
                       {"extra", extra}};
  const std::string text = ts.dump(2) + "\n";
  // Last: its presence marks the directory complete.
  write_file_atomic((tmp.path / kTrainerState).string(), std::as_bytes(std::span(text)));
  fsync_directory(tmp.path.string());

  // Publish (see the header for the recovery rule).
  const fs::path old = old_of(dir);
  if (fs::exists(dir)) {
    // <dir> is complete, so an <dir>.old beside it is garbage of an earlier save.
    fs::remove_all(old, ec);
    STRIDER_CHECK(!ec, "cannot remove the stale {}: {}", old.string(), ec.message());
    rename_or_throw(dir, old);
    fsync_directory(parent.string());
  }
  rename_or_throw(tmp.path, dir);
  tmp.published = true;
  fsync_directory(parent.string());
  fs::remove_all(old, ec);  // best effort: a leftover is removed by the next save
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

void save_training_checkpoint(const fs::path& dir_in, Engine& engine, std::string_view model_config_json,
                              const nlohmann::json& extra, const TrainCheckpointOptions& options) {
  const fs::path dir = normalise(dir_in);
  // Not built yet: a checkpoint's model files are the base's (config.json
  // describes no adapters), and the adapters would need their own folder.
  STRIDER_CHECK(!engine.spec().lora.enabled(), "{}: training checkpoints of LoRA adapters (lora {}) are not "
                "supported yet; after engine.finish(), peft_model.save_pretrained(dir) saves the trained adapter",
                dir.string(), engine.spec().lora.text());
  try {
    save_impl(dir, engine, model_config_json, extra, options);
  } catch (const std::exception& e) {
    throw Error(fmt::format("saving the training checkpoint {} failed (any previous checkpoint there "
                            "is intact): {}", dir.string(), e.what()));
  }
}

void serve_training_checkpoint(Engine& engine) {
  engine.finish_updates();
  if (engine.config().state_shards <= 1) return;  // rank 0 holds the whole state: nothing to send
  read_blocks(engine, [](int64_t, int, const ParamLayout&, std::span<const float>) {});
}

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
  static const std::vector<std::string> kFields = {
      "seq", "micro_batch", "accumulation", "dtype", "vocab_chunk", "lr", "beta1", "beta2", "eps",
      "weight_decay", "decay_norms_and_biases", "optimizer", "schedule", "warmup_steps", "total_steps", "clip_norm", "optimizer_state"};
  return kFields;
}

nlohmann::json load_training_checkpoint(const fs::path& dir, Engine& engine, const TrainLoadOptions& options) {
  const TrainCheckpointInfo info = inspect_training_checkpoint(dir);
  const std::string ts_file = (info.path / kTrainerState).string();
  const ModelSpec& spec = engine.spec();

  // 1. The model.
  const ModelSpec saved = ModelSpec::from_json(info.trainer_state["model_config"], ts_file + " model_config");
  const auto diffs = spec_differences(saved, spec, "checkpoint");
  if (!diffs.empty())
    throw CheckpointMismatch(fmt::format("{}: the checkpoint is of another model ({}) than the engine's ({}): {}",
                                         ts_file, saved.summary(), spec.summary(), join(diffs, "; ")));

  // 2. The engine config fields that change the maths.
  const auto& fields = maths_config_fields();
  for (const std::string& f : options.allow_changed)
    STRIDER_CHECK(std::find(fields.begin(), fields.end(), f) != fields.end(),
                  "allow_changed names '{}', which is not one of the engine config's maths fields ({})", f,
                  join(fields, ", "));
  const nlohmann::json now = engine_config_to_json(engine.config());
  std::vector<std::string> changed;
  for (const std::string& f : fields) {
    // Checkpoints from before the optimizer-state formats hold fp32 state; from
    // before the decay rule, they decayed every tensor (which matters only
    // with weight decay).
    const nlohmann::json saved = f == "optimizer_state"          ? info.engine_config.value(f, nlohmann::json("fp32"))
                                 : f == "decay_norms_and_biases" ? info.engine_config.value(f, nlohmann::json(true))
                                                                 : info.engine_config.value(f, nlohmann::json());
    if (f == "decay_norms_and_biases" && now["weight_decay"] == 0 && info.engine_config.value("weight_decay", 0.0) == 0)
      continue;
    STRIDER_CHECK(!saved.is_null(), "{}: engine_config has no field '{}'", ts_file, f);
    const bool allowed = std::find(options.allow_changed.begin(), options.allow_changed.end(), f) !=
                         options.allow_changed.end();
    if (saved != now[f] && !allowed)
      changed.push_back(fmt::format("{}: checkpoint {}, engine {}{}", f, saved.dump(), now[f].dump(),
                                    f == "optimizer_state" ? " (converting the state between formats is done only "
                                                             "when asked: allow_changed optimizer_state)" : ""));
  }
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

  // 5. Everything checked: now, and only now, the engine changes.
  std::vector<float> buf;
  for (int64_t b = 0; b < blocks; ++b) {
    const ParamLayout l = spec.layout(b);
    for (int k = 0; k < 3; ++k) {
      buf.assign(l.total_elems(), 0.0f);  // the layout's padding is zero in every kind
      const auto& vs = views[size_t(b)][size_t(k)];
      for (size_t i = 0; i < vs.size(); ++i)
        std::memcpy(buf.data() + l.slots()[i].offset_elems, vs[i].bytes.data(), vs[i].bytes.size());
      engine.write_state(b, kKinds[k], buf);
    }
  }
  engine.set_steps_done(info.step);
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
