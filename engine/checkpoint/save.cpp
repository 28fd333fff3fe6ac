#include "engine/checkpoint/train_checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>

#include <fmt/ranges.h>

#include "engine/checkpoint/parts.h"
#include "engine/checkpoint/reference_copy.h"
#include "engine/config/engine_config_json.h"
#include "engine/model/hf_folder.h"
#include "engine/model/peft_adapter.h"
#include "host/error.h"
#include "io/atomic_file.h"
#include "io/checksum.h"
#include "io/safetensors.h"

namespace strider {

namespace fs = std::filesystem;

namespace train_checkpoint_parts {

fs::path normalise(const fs::path& dir) {
  fs::path p = dir.lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  STRIDER_CHECK(!p.empty() && p.filename() != "." && p.filename() != "..",
                "training checkpoint: '{}' does not name a directory to save into", dir.string());
  return p;
}
fs::path old_of(const fs::path& dir) { return fs::path(dir.string() + ".old"); }
std::string hex64(uint64_t x) { return fmt::format("{:016x}", x); }

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
  cmp("pad_token_id", a.pad_token, b.pad_token);
  cmp("rms_norm_eps", a.rms_eps, b.rms_eps);
  cmp("rope type", static_cast<int>(a.rope.type), static_cast<int>(b.rope.type));
  cmp("rope_theta", a.rope.theta, b.rope.theta);
  cmp("rope factor", a.rope.factor, b.rope.factor);
  cmp("rope low_freq_factor", a.rope.low_freq_factor, b.rope.low_freq_factor);
  cmp("rope high_freq_factor", a.rope.high_freq_factor, b.rope.high_freq_factor);
  cmp("rope original_max_position_embeddings", a.rope.original_max_position,
      b.rope.original_max_position);
  cmp("rope short_factor", a.rope.short_factor, b.rope.short_factor);
  cmp("rope long_factor", a.rope.long_factor, b.rope.long_factor);
  cmp("rope attention_factor", a.rope.attention_factor, b.rope.attention_factor);
  cmp("partial_rotary_factor", a.rope.partial_rotary, b.rope.partial_rotary);
  cmp("qkv bias", a.qkv_bias, b.qkv_bias);
  cmp("o_proj bias", a.o_bias, b.o_bias);
  cmp("mlp_bias", a.mlp_bias, b.mlp_bias);
  cmp("qk norm", a.qk_norm, b.qk_norm);
  cmp("sliding_window", a.sliding_window, b.sliding_window);
  cmp("sliding layers", fmt::format("{}", fmt::join(ckpt.sliding_layers, "")),
      fmt::format("{}", fmt::join(engine.sliding_layers, "")));
  cmp("sliding layers' rope_theta", ckpt.local_rope.theta, engine.local_rope.theta);
  cmp("sliding layers' rope type", static_cast<int>(ckpt.local_rope.type), static_cast<int>(engine.local_rope.type));
  cmp("sliding layers' rope factor", ckpt.local_rope.factor, engine.local_rope.factor);
  cmp("embedding_multiplier", a.embedding_multiplier, b.embedding_multiplier);
  cmp("attention_multiplier", a.attn_scale, b.attn_scale);
  cmp("residual_multiplier", a.residual_multiplier, b.residual_multiplier);
  cmp("logits_scaling", a.logits_scaling, b.logits_scaling);
  cmp("attn_logit_softcapping", a.attn_softcap, b.attn_softcap);
  cmp("final_logit_softcapping", a.final_softcap, b.final_softcap);
  cmp("lora", ckpt.lora.text().empty() ? std::string("(none)") : ckpt.lora.text(),
      engine.lora.text().empty() ? std::string("(none)") : engine.lora.text());
  // Mixtures of experts: the routing and the load-balancing loss.
  cmp("num_experts", a.moe.experts, b.moe.experts);
  cmp("num_experts_per_tok", a.moe.top_k, b.moe.top_k);
  cmp("moe_intermediate_size", a.moe.intermediate, b.moe.intermediate);
  cmp("norm_topk_prob", a.moe.norm_topk, b.moe.norm_topk);
  cmp("router scores in fp32", a.moe.scores_fp32, b.moe.scores_fp32);
  cmp("shared_expert_intermediate_size", a.moe.shared_intermediate, b.moe.shared_intermediate);
  cmp("dense layers (mlp_only_layers, decoder_sparse_step)", fmt::format("{}", fmt::join(ckpt.dense_layers, "")),
      fmt::format("{}", fmt::join(engine.dense_layers, "")));
  cmp("the load-balancing loss's weight (router_aux_loss_coef, output_router_logits)", ckpt.router_aux_coef,
      engine.router_aux_coef);
  // What the architecture implies, where a config could say otherwise.
  cmp("q/k norm over the whole projection", a.qk_norm_whole, b.qk_norm_whole);
  cmp("norm kind", static_cast<int>(a.norm), static_cast<int>(b.norm));
  cmp("norm placement", static_cast<int>(a.norm_placement), static_cast<int>(b.norm_placement));
  cmp("hidden_act", static_cast<int>(a.act), static_cast<int>(b.act));
  cmp("fused projections", a.fused_projections, b.fused_projections);
  cmp("embedding multiplier in the compute dtype", a.embedding_multiplier_in_dtype, b.embedding_multiplier_in_dtype);
  // Whatever else the reader puts into the blocks' dimensions, named above or
  // not: a member added to BlockDims later is compared without a line here.
  if (d.empty() && !(a == b))
    d.push_back(fmt::format("the blocks' dimensions differ in a field not named here (BlockDims; {} {}, engine {})",
                            source, ckpt.summary(), engine.summary()));
  // And whatever else the reader takes from config.json into the model.
  if (d.empty() && !(ckpt == engine))
    d.push_back(fmt::format("the models differ in a field not named here (ModelSpec; {} {}, engine {})", source,
                            ckpt.summary(), engine.summary()));
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

ModelSpec saved_model(const nlohmann::json& model_config, const nlohmann::json& engine_config,
                      std::string_view source) {
  const ModelSpec base = ModelSpec::from_json(model_config, source);
  const nlohmann::json lora = engine_config.value("lora", nlohmann::json(""));
  return base.with_lora(lora.is_string() ? lora.get<std::string>() : lora.dump(), source);
}

uint64_t frozen_checksum(const ParamLayout& l, std::span<const float> master) {
  Checksum64Stream cs;
  bool any = false;
  for (const TensorSlot& s : l.slots())
    if (!holds_state(s)) {
      cs.update(std::as_bytes(master.subspan(s.offset_elems, s.numel)));
      any = true;
    }
  return any ? cs.digest() : 0;
}

}  // namespace train_checkpoint_parts

using namespace train_checkpoint_parts;

namespace {

fs::path parent_of(const fs::path& dir) {
  return dir.has_parent_path() ? dir.parent_path() : fs::path(".");
}
std::string temp_prefix(const fs::path& dir) { return "." + dir.filename().string() + ".tmp-"; }

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
    const bool trained = std::any_of(l.slots().begin(), l.slots().end(), holds_state);
    for (int k = 0; k < 3; ++k) {
      // A block of frozen tensors only (a LoRA base's embedding) has no moments.
      if (k > 0 && !trained) std::fill(buf.begin(), buf.end(), 0.0f);
      else engine.read_state(b, kKinds[k], buf);
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
  const auto diffs = spec_differences(ModelSpec::from_json(model_config, "model config to save")
                                          .with_lora(engine.config().lora, "engine config lora"),
                                      spec, "config given");
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
      for (const TensorSlot& s : l.slots())
        if (holds_state(s)) specs.push_back({s.name + kSuffix[k], DType::kF32, s.shape});
  }
  SafetensorsWriteOptions sopt;
  sopt.max_shard_bytes = options.state_shard_bytes;
  sopt.base_name = kStateBase;
  sopt.metadata = {{"format", "pt"}, {"strider_step", std::to_string(step)}};
  SafetensorsWriter state(tmp.path.string(), std::move(specs), sopt);
  // The model as it loads elsewhere: transformers' checkpoint, or with LoRA
  // the adapter PEFT loads over its base (fp32: small, and the masters exactly).
  std::optional<HfCheckpointWriter> model;
  std::optional<PeftAdapterWriter> adapter;
  if (options.write_model && spec.lora.enabled())
    adapter.emplace(tmp.path.string(), spec, PeftAdapterOptions{DType::kF32, options.base_model});
  else if (options.write_model)
    model.emplace(tmp.path.string(), spec, model_config_json,
                  HfWriteOptions{options.model_dtype, options.model_shard_bytes});

  nlohmann::json checksums = nlohmann::json::object(), base_checksums = nlohmann::json::object();
  size_t index = 0;
  // The model file in bf16 from a bf16 compute copy: its values, exactly
  // (every rank holds the whole compute copy); else the master.
  const bool model_from_compute = options.model_dtype == DType::kBF16 && engine.config().compute.dtype == at::kBFloat16;
  read_blocks(engine, [&](int64_t b, int k, const ParamLayout& l, std::span<const float> buf) {
    Checksum64Stream cs;
    for (const TensorSlot& s : l.slots()) {
      if (!holds_state(s)) continue;
      const auto bytes = std::as_bytes(buf.subspan(s.offset_elems, s.numel));
      state.write(index++, bytes);
      cs.update(bytes);
    }
    checksums[l.block_name()][kKindKey[k]] = hex64(cs.digest());
    if (k == 0 && spec.lora.enabled()) base_checksums[l.block_name()] = hex64(frozen_checksum(l, buf));
    if (k == 0 && adapter) adapter->write_block(b, buf);
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
  const nlohmann::json reference = save_reference_copy(tmp.path, engine);
  // The exportable model's files, as written: a copy damaged later is then
  // found (check_model_files), not exported silently.
  nlohmann::json model_checksums = nlohmann::json::object();
  if (model) model->finish();
  if (adapter) adapter->finish();
  for (const std::string& name : model ? model->file_names() : adapter ? adapter->file_names() : std::vector<std::string>{})
    model_checksums[name] = hex64(file_checksum64((tmp.path / name).string()));

  nlohmann::json ts = {{"format", kFormat},
                       {"version", kTrainCheckpointVersion},
                       {"step", step},
                       {"model", spec.summary()},
                       {"model_config", model_config},
                       {"engine_config", engine_config_to_json(engine.config())},
                       {"state_files", state.file_names()},
                       {"model_files", model ? model->file_names() : adapter ? adapter->file_names() : std::vector<std::string>{}},
                       {"checksums", checksums},
                       {"checksum", "xxh3-64 of each block's tensors in layout order, per kind"},
                       {"model_checksums", model_checksums},  // xxh3-64 of each model file's bytes
                       // LoRA: the frozen base's fingerprint (frozen_checksum), which a load checks
                       {"base_checksums", base_checksums},
                       {"extra", extra}};
  if (!reference.is_null()) ts["reference"] = reference;  // the starting weights (keep_reference)
  if (engine.config().loss_scaled()) {  // fp16: where its loss scaling stands, so a resume goes on from it
    const LossScaleState ls = engine.loss_scale();
    ts["loss_scale"] = {{"scale", ls.scale}, {"good_steps", ls.good_steps}};
  }
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

}  // namespace

void save_training_checkpoint(const fs::path& dir_in, Engine& engine, std::string_view model_config_json,
                              const nlohmann::json& extra, const TrainCheckpointOptions& options) {
  const fs::path dir = normalise(dir_in);
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

}  // namespace strider
