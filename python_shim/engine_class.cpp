// torch.classes.strider.Engine: the sliding-window Engine driven from Python.
//
//   s = torch.classes.strider.EngineSettings()          # typed: s.set_int("seq", 1024), ...
//   e = torch.classes.strider.Engine(model_config_json, s, "cpu", 0, False, 1)
//   e.set_param("model.embed_tokens.weight", w)       # or e.init_params(seed)
//   numbers, texts, busy = e.step(ids, labels)         # int64 [batch, seq] each
//   (optional: positions, packed documents; attention_mask, right padding)
//   w = e.compute_view("model.norm.weight")            # aliases the engine's compute copy
//   e.save_checkpoint(dir, model_config_json, extra_json, write_model, base_model)
//   extra = json.loads(e.load_checkpoint(dir, allow_changed, verify_checksums))
//   info = json.loads(torch.ops.strider.inspect_training_checkpoint(dir))
//
// A thin binding: it validates every argument before the engine sees it (a
// refused call leaves parameters and optimizer state as they were), converts
// tensors to the engine's fp32 / int64 host buffers, and turns our errors into
// Python exceptions that carry our message: ValueError for bad arguments and
// bad configs, RuntimeError for failures while running.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/checkpoint/train_checkpoint.h"
#include "engine/config/engine_config_json.h"
#include "engine/model/model_spec.h"
#include "engine/run/collectives.h"
#include "engine/run/engine.h"
#include "gpu/device/device.h"
#include "host/error.h"
#include "io/run_lock.h"
#include "python_shim/engine_plan.h"
#include "python_shim/translated.h"

namespace strider {
namespace {

class EngineHolder : public torch::CustomClassHolder {
 public:
  EngineHolder(const std::string& model_config_json, const c10::intrusive_ptr<EngineSettings>& settings,
               const std::string& device_spec, int64_t device_budget_bytes, bool chaos, int64_t chaos_seed) {
    TORCH_CHECK_VALUE(device_budget_bytes >= 0, "device_budget_bytes must be >= 0 (0: the device's default), got ",
                      device_budget_bytes);
    TORCH_CHECK_VALUE(settings, "settings: expected a torch.classes.strider.EngineSettings, got None");
    EngineArgs args = engine_args(model_config_json, *settings);
    const ModelSpec& spec = args.spec;
    for (int64_t b = 0; b < spec.num_blocks(); ++b) {
      const ParamLayout layout = spec.layout(b);  // named: slots() refers into it
      for (const TensorSlot& t : layout.slots()) {
        names_.push_back(t.name);
        slots_[t.name] = {b, t};
      }
    }
    DeviceOptions dev{.spec = device_spec,
                      .budget_bytes = size_t(device_budget_bytes),
                      .record_spans = true,
                      .chaos = {.enabled = chaos, .seed = uint64_t(chaos_seed)}};
    // The engine checks its config (window, seq against max positions, ...)
    // and the budget before any work: those are the caller's to fix.
    engine_ = translated("engine", true, [&] {
      std::vector<std::unique_ptr<Device>> pool = make_devices(dev, args.devices);
      const size_t budget = pool.front()->budget_bytes();
      args.config.devices = int(pool.size());  // the plan counts each device's share
      take_plan(engine_plan(args, device_spec, budget), args, budget);
      const EngineConfig& config = args.config;
      // The NVMe state is this engine's alone, as the command line's --nvme is
      // its run's: another engine (here or in another process) on the same
      // directory would tear its extents.
      if (!config.nvme_dir.empty()) nvme_lock_.emplace(config.nvme_dir, "nvme_dir");
      return std::make_unique<Engine>(std::move(args.spec), std::move(args.config), std::move(pool));
    });
  }

  void set_param(const std::string& name, const at::Tensor& t) {
    std::lock_guard lk(mu_);
    const std::vector<int64_t>& shape = shape_of(name);
    TORCH_CHECK_VALUE(t.is_floating_point(), "set_param('", name, "'): expected a floating-point tensor, got ",
                      t.scalar_type());
    TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(shape), "set_param('", name, "'): expected shape ",
                      at::IntArrayRef(shape), ", got ", t.sizes());
    at::Tensor f = t.detach().to(at::kCPU, at::kFloat).contiguous();
    translated("set_param", false, [&] {
      usable();
      engine_->set_param(name, {f.data_ptr<float>(), size_t(f.numel())});
    });
  }

  at::Tensor param(const std::string& name) {
    std::lock_guard lk(mu_);
    const std::vector<int64_t>& shape = shape_of(name);
    std::vector<float> v = translated("param", false, [&] {
      usable();
      return engine_->param(name);
    });
    return at::tensor(v, at::kFloat).view(shape);
  }

  std::vector<std::string> param_names() const { return names_; }
  // Those the optimizer trains (TensorSlot::trainable: all but a LoRA base's).
  std::vector<std::string> trainable_names() const {
    std::vector<std::string> out;
    for (const std::string& n : names_)
      if (slots_.at(n).second.trainable) out.push_back(n);
    return out;
  }

  // A CPU tensor over parameter `name`'s slot in the engine's compute copy
  // (bf16, fp16, or fp32: the compute dtype), in the parameter's shape: no
  // copy. The updater rewrites it after each update of its block, so it holds
  // the trained weights once finish() returned. Its storage keeps this holder
  // (and so the engine and its arena) alive: a model whose parameters alias
  // the engine never points into freed memory, whatever Python frees first.
  at::Tensor compute_view(const std::string& name) {
    std::lock_guard lk(mu_);
    const auto& [block, slot] = slot_of(name);
    const std::span<std::byte> copy = translated("compute_view", false, [&] {
      usable();
      return engine_->compute_copy(block);
    });
    const size_t begin = engine_->compute_begin(block);
    TORCH_CHECK(slot.offset_elems >= begin, "compute_view('", name, "'): it is part of a frozen base held in ",
                std::string(base_format_name(engine_->config().base_format)), ", which has no compute copy to alias");
    const at::ScalarType dtype = engine_->config().compute.dtype;
    const size_t elem_bytes = at::elementSize(dtype);
    TORCH_CHECK((slot.offset_elems - begin + slot.numel) * elem_bytes <= copy.size(), "compute_view('", name,
                "'): the slot [", slot.offset_elems, ", +", slot.numel, ") elements of ", elem_bytes,
                " bytes lies outside block ", block, "'s compute copy of ", copy.size(), " bytes");
    c10::intrusive_ptr<EngineHolder> keep = c10::intrusive_ptr<EngineHolder>::reclaim_copy(this);
    return at::from_blob(copy.data() + (slot.offset_elems - begin) * elem_bytes, slot.shape,
                         [keep](void*) {},  // the capture is the point: released with the storage
                         at::TensorOptions().dtype(dtype).device(at::kCPU));
  }

  // The parameter is part of a frozen base held quantized (EngineConfig::base_format): no compute copy.
  bool held_quantized(const std::string& name) {
    std::lock_guard lk(mu_);
    const auto& [block, slot] = slot_of(name);
    return translated("held_quantized", false, [&] {
      usable();
      return slot.offset_elems < engine_->compute_begin(block);
    });
  }

  int64_t steps_done() {
    std::lock_guard lk(mu_);
    return engine_->steps_done();
  }

  // The engine's config as engine/config/engine_config_json.h writes it: what was
  // chosen (saved_blocks for `activations`), not only what was asked.
  std::string engine_config_json() {
    std::lock_guard lk(mu_);
    return engine_config_to_json(engine_->config()).dump();
  }

  // engine/checkpoint/train_checkpoint.h's save: every block's master, m and v, the step
  // count, both configs and `extra_json` (the caller's own state), published
  // atomically into `dir`; with `write_model`, also config.json and
  // model.safetensors (in the compute dtype) that from_pretrained loads.
  // With LoRA the model files are the adapter, naming `base_model` (its base_model_name_or_path).
  void save_checkpoint(const std::string& dir, const std::string& model_config_json, const std::string& extra_json,
                       bool write_model, const std::string& base_model) {
    std::lock_guard lk(mu_);
    const nlohmann::json extra = parse_json(extra_json, "extra_json");
    run("save_checkpoint", [&] { engine_->finish_updates(); }, true);  // a failed update breaks the engine
    const TrainCheckpointOptions options{
        .write_model = write_model,
        .model_dtype = engine_->config().compute.dtype == at::kBFloat16 ? DType::kBF16 : DType::kF32,
        .base_model = base_model};
    // A failed save (a full disk, a path that is not ours) leaves the engine as it was.
    // Data parallel: rank 0 writes; the others send it their slices as it goes.
    translated("save_checkpoint", false, [&] {
      if (engine_->ranks().rank == 0) save_training_checkpoint(dir, *engine_, model_config_json, extra, options);
      else serve_training_checkpoint(*engine_);
    });
  }

  // Data parallel from Python (strider.Engine in a torch.distributed group):
  // rank 0 hosts the ranks' store on a free port and returns the port, which
  // the caller broadcasts; then every rank joins, rank 0 too (a collective:
  // every rank, before the first step).
  int64_t host_ranks(int64_t world, int64_t timeout_s) {
    std::lock_guard lk(mu_);
    return translated("host_ranks", false, [&] {
      hosted_ = host_ranks_store(int(world), std::chrono::seconds(timeout_s));
      return int64_t(hosted_.port);
    });
  }
  void join_ranks(const std::string& host, int64_t port, int64_t rank, int64_t world, int64_t local_rank,
                  int64_t local_world, int64_t timeout_s) {
    std::lock_guard lk(mu_);
    translated("join_ranks", false, [&] {
      const std::chrono::seconds t(timeout_s);
      auto store = rank == 0 ? hosted_.store : join_ranks_store(host, int(port), int(world), t);
      STRIDER_CHECK(store, "join_ranks: rank 0 hosts the ranks' store first (host_ranks)");
      engine_->set_collectives(c10d_collectives(
          store, {.rank = int(rank), .world = int(world), .local_rank = int(local_rank), .local_world = int(local_world)},
          t));
    });
  }

  // engine/checkpoint/train_checkpoint.h's load: validates everything first (model,
  // maths config unless named in allow_changed, tensors, checksums) and
  // refuses with the file and field, the engine untouched; returns "extra".
  std::string load_checkpoint(const std::string& dir, std::vector<std::string> allow_changed,
                              bool verify_checksums) {
    std::lock_guard lk(mu_);
    run("load_checkpoint", [&] { engine_->finish_updates(); });
    const TrainLoadOptions options{.allow_changed = std::move(allow_changed), .verify_checksums = verify_checksums};
    return translated("load_checkpoint", true, [&] {
      usable();
      return load_training_checkpoint(dir, *engine_, options).dump();
    });
  }

  // An objective's inputs (engine.py prepares them; rows < 0: none given):
  // `row` fp32 [batch], `old_logps` and `ref_logps` fp32 [batch, seq].
  struct Objective {
    at::Tensor row, old_logps, ref_logps;  // holding what `in` points into
    ObjectiveInputs in;
    bool any = false;
    const ObjectiveInputs* given() const { return any ? &in : nullptr; }
  };
  Objective objective_inputs(const char* what, int64_t rows, const std::optional<at::Tensor>& row,
                             const std::optional<at::Tensor>& old_logps,
                             const std::optional<at::Tensor>& ref_logps) const {
    const EngineConfig& c = engine_->config();
    auto values = [&](const char* name, const std::optional<at::Tensor>& t, std::vector<int64_t> shape) {
      if (!t.has_value() || !t->defined()) return at::Tensor();
      TORCH_CHECK_VALUE(t->sizes() == at::IntArrayRef(shape), what, ": ", name, " must be of shape ",
                        at::IntArrayRef(shape), ", got ", t->sizes());
      return t->to(at::kCPU, at::kFloat).contiguous();
    };
    Objective o{.row = values("the per-row values", row, {c.batch()}),
                .old_logps = values("old_logps", old_logps, {c.batch(), c.seq}),
                .ref_logps = values("ref_logps", ref_logps, {c.batch(), c.seq}),
                .any = rows >= 0};
    o.in = {.rows = rows,
            .row = o.row.defined() ? o.row.data_ptr<float>() : nullptr,
            .old_logps = o.old_logps.defined() ? o.old_logps.data_ptr<float>() : nullptr,
            .ref_logps = o.ref_logps.defined() ? o.ref_logps.data_ptr<float>() : nullptr};
    return o;
  }

  // The step's report as typed values, no text to parse: its numbers (the
  // counts exact: every one is below 2^53), its texts, and each lane's busy
  // fraction. engine.py's StepResult.from_report reads them.
  using Report = std::tuple<c10::Dict<std::string, double>, c10::Dict<std::string, std::string>,
                            c10::Dict<std::string, double>>;
  // An objective past SFT's inputs: objective_inputs.
  Report step(const at::Tensor& ids, const at::Tensor& labels, const std::optional<at::Tensor>& positions,
              const std::optional<at::Tensor>& attention_mask, int64_t rows, const std::optional<at::Tensor>& row,
              const std::optional<at::Tensor>& old_logps, const std::optional<at::Tensor>& ref_logps) {
    std::lock_guard lk(mu_);
    const Batch b = checked("step", ids, labels, positions, attention_mask);
    const Objective obj = objective_inputs("step", rows, row, old_logps, ref_logps);
    StepReport r = run("step", [&] {
      return engine_->step(b.ids(), b.labels(), b.positions(), b.mask(), obj.given());
    });
    c10::Dict<std::string, double> numbers, busy;
    c10::Dict<std::string, std::string> texts;
    for (const auto& [key, value] : std::initializer_list<std::pair<const char*, double>>{
             {"step", double(r.step)},
             {"loss", r.loss},
             {"tokens", double(r.tokens)},
             {"valid_tokens", double(r.valid_tokens)},
             {"grad_norm", r.grad_norm},
             {"lr", r.lr},
             {"step_s", r.step_s},
             {"tokens_per_s", r.tokens_per_s},
             {"overlap_efficiency", r.stats.overlap_efficiency},
             {"peak_device_bytes", double(r.peak_device_bytes)},
             {"h2d_bytes", double(r.h2d_bytes)},
             {"d2h_bytes", double(r.d2h_bytes)},
             {"work_peak_bytes", double(r.work_peak_bytes)},
             {"skipped", r.skipped ? 1.0 : 0.0},
             {"no_targets", r.no_targets ? 1.0 : 0.0},
             {"nonfinite_block", double(r.nonfinite_block)},
             {"loss_scale", r.loss_scale},
             {"overflow", r.overflow ? 1.0 : 0.0}})
      numbers.insert(key, value);
    for (const auto& [name, value] : r.metrics) numbers.insert("objective:" + name, value);  // TRL's names
    texts.insert("critical_lane", std::string(lane_name(r.stats.critical)));
    texts.insert("skip_reason", r.skip_reason);
    texts.insert("nonfinite_tensor", r.nonfinite_tensor);
    for (int k = 0; k < kNumLanes; ++k)
      busy.insert(std::string(lane_name(static_cast<Lane>(k))), r.stats.lanes[size_t(k)].busy_fraction);
    return {numbers, texts, busy};
  }

  double evaluate(const at::Tensor& ids, const at::Tensor& labels, const std::optional<at::Tensor>& positions,
                  const std::optional<at::Tensor>& attention_mask) {
    std::lock_guard lk(mu_);
    const Batch b = checked("evaluate", ids, labels, positions, attention_mask);
    return run("evaluate", [&] {
      return engine_->evaluate(b.ids(), b.labels(), b.positions(), b.mask());
    });
  }

  // An objective's loss over a batch and its figures, no update (Engine::evaluate_objective); inputs as step's.
  std::tuple<double, c10::Dict<std::string, double>> evaluate_objective(
      const at::Tensor& ids, const at::Tensor& labels, const std::optional<at::Tensor>& positions,
      const std::optional<at::Tensor>& attention_mask, int64_t rows, const std::optional<at::Tensor>& row,
      const std::optional<at::Tensor>& old_logps, const std::optional<at::Tensor>& ref_logps) {
    std::lock_guard lk(mu_);
    const Batch b = checked("evaluate", ids, labels, positions, attention_mask);
    const Objective obj = objective_inputs("evaluate", rows, row, old_logps, ref_logps);
    const ObjectiveEval e = run("evaluate", [&] {
      return engine_->evaluate_objective(b.ids(), b.labels(), b.positions(), b.mask(), obj.given());
    });
    c10::Dict<std::string, double> metrics;
    for (const auto& [name, value] : e.metrics) metrics.insert(name, value);
    return {e.loss, metrics};
  }

  // Each token's log-probability of its label, fp32 [batch, seq] (Engine::logprobs).
  at::Tensor logprobs(const at::Tensor& ids, const at::Tensor& labels, const std::optional<at::Tensor>& positions,
                      const std::optional<at::Tensor>& attention_mask, bool reference) {
    std::lock_guard lk(mu_);
    const Batch b = checked("logprobs", ids, labels, positions, attention_mask);
    std::vector<float> lp = run("logprobs", [&] {
      return engine_->logprobs(b.ids(), b.labels(), b.positions(), b.mask(), reference);
    });
    return at::tensor(lp, at::kFloat).view(ids.sizes());
  }

  void finish() {
    std::lock_guard lk(mu_);
    run("finish", [&] { engine_->finish_updates(); });
  }

  // Engine::inject_device_fault, for the tests of a failure mid-step: the
  // next step's first operation named `op` (step_program_text's names:
  // "forward", "backward", ...) of block `block` throws as it is issued.
  void inject_device_fault(const std::string& op, int64_t block) {
    std::lock_guard lk(mu_);
    translated("inject_device_fault", true, [&] {
      const std::optional<StepOpKind> kind = op_kind_named(op);
      STRIDER_CHECK(kind.has_value(), "inject_device_fault: no operation is named '{}'", op);
      engine_->inject_device_fault(*kind, block);
    });
  }

  void init_params(int64_t seed) {
    std::lock_guard lk(mu_);
    translated("init_params", false, [&] {
      usable();
      engine_->init_params(uint64_t(seed));
    });
  }

  void write_trace(const std::string& path) {
    std::lock_guard lk(mu_);
    run("write_trace", [&] { engine_->finish_updates(); });  // so the last step's optimizer spans are in
    translated("write_trace", false, [&] { engine_->timeline().write_chrome_trace(path); });
  }

 private:
  const std::pair<int64_t, TensorSlot>& slot_of(const std::string& name) const {
    auto it = slots_.find(name);
    TORCH_CHECK_VALUE(it != slots_.end(), "the model has no parameter '", name,
                      "' (param_names() lists them; a tied lm_head.weight is model.embed_tokens.weight)");
    return it->second;
  }
  const std::vector<int64_t>& shape_of(const std::string& name) const { return slot_of(name).second.shape; }

  // [micro_batch * accumulation, seq] int64 each, token ids in the vocabulary,
  // labels -100 or token ids, at least one label that counts: all checked here
  // so that a refused batch never starts a step half-way.
  // A call's batch, checked (checked_batch, checked_positions, checked_mask) and held while the engine reads
  // it; positions and mask null where not given.
  struct Batch {
    at::Tensor id, label, position, attention;
    const int64_t* ids() const { return id.data_ptr<int64_t>(); }
    const int64_t* labels() const { return label.data_ptr<int64_t>(); }
    const int64_t* positions() const { return position.defined() ? position.data_ptr<int64_t>() : nullptr; }
    const int64_t* mask() const { return attention.defined() ? attention.data_ptr<int64_t>() : nullptr; }
  };
  Batch checked(const char* what, const at::Tensor& ids, const at::Tensor& labels,
                const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& attention_mask) const {
    auto [i, l] = checked_batch(what, ids, labels);
    return {i, l, checked_positions(what, positions), checked_mask(what, attention_mask)};
  }

  std::pair<at::Tensor, at::Tensor> checked_batch(const char* what, const at::Tensor& ids,
                                                  const at::Tensor& labels) const {
    const EngineConfig& c = engine_->config();
    const int64_t vocab = engine_->spec().dims.vocab;
    const std::vector<int64_t> want{c.batch(), c.seq};
    for (auto [name, t] : {std::pair{"ids", &ids}, std::pair{"labels", &labels}}) {
      TORCH_CHECK_VALUE(t->sizes() == at::IntArrayRef(want), what, ": ", name, " must have shape [batch, seq] = [",
                        c.batch(), ", ", c.seq, "] (micro_batch ", c.micro_batch, " x accumulation ", c.accumulation,
                        ", seq ", c.seq, "), got ", t->sizes());
      TORCH_CHECK_VALUE(t->scalar_type() == at::kLong, what, ": ", name, " must be int64, got ", t->scalar_type());
    }
    at::Tensor i = ids.to(at::kCPU).contiguous(), l = labels.to(at::kCPU).contiguous();
    const int64_t lo = i.min().item<int64_t>(), hi = i.max().item<int64_t>();
    TORCH_CHECK_VALUE(lo >= 0 && hi < vocab, what, ": token ids must be in [0, ", vocab, "), got values in [", lo,
                      ", ", hi, "]");
    at::Tensor counted = l != -100;
    TORCH_CHECK_VALUE(((l.lt(0) | l.ge(vocab)) & counted).sum().item<int64_t>() == 0, what,
                      ": labels must be -100 (no loss) or token ids in [0, ", vocab, ")");
    // A training batch without a target is skipped by the engine (StepReport::no_targets); an
    // evaluation of one has no loss to return (its log-probabilities are zeros).
    TORCH_CHECK_VALUE(std::string_view(what) != "evaluate" || counted.any().item<bool>(), what,
                      ": every label is -100, so there is no loss to compute");
    return {i, l};
  }

  // Packed documents' positions ([batch, seq] int64, on the CPU), or undefined;
  // their range and the engine's packed_documents are the engine's to check.
  at::Tensor checked_positions(const char* what, const std::optional<at::Tensor>& positions) const {
    if (!positions.has_value() || !positions->defined()) return {};
    const EngineConfig& c = engine_->config();
    TORCH_CHECK_VALUE(positions->sizes() == at::IntArrayRef({c.batch(), c.seq}) &&
                          positions->scalar_type() == at::kLong,
                      what, ": positions must be int64 of shape [batch, seq] = [", c.batch(), ", ", c.seq, "], got ",
                      positions->scalar_type(), " ", positions->sizes());
    return positions->to(at::kCPU).contiguous();
  }
  // transformers' attention mask (bool or integers of 0 and 1; the engine checks the values) as int64.
  at::Tensor checked_mask(const char* what, const std::optional<at::Tensor>& mask) const {
    if (!mask.has_value() || !mask->defined()) return {};
    const EngineConfig& c = engine_->config();
    TORCH_CHECK_VALUE(mask->sizes() == at::IntArrayRef({c.batch(), c.seq}) && !mask->is_floating_point() &&
                          !mask->is_complex(),
                      what, ": attention_mask must be bool or integers of shape [batch, seq] = [", c.batch(), ", ",
                      c.seq, "], got ", mask->scalar_type(), " ", mask->sizes());
    return mask->to(at::kCPU, at::kLong).contiguous();
  }

  // After a failure, only save_checkpoint, and only of a whole state.
  void usable(bool saving = false) const {
    if (failed_.empty() || (saving && broken_.empty())) return;
    STRIDER_CHECK(false, "this Engine failed earlier ({}); {}", failed_, after_failure());
  }
  std::string after_failure() const {
    return broken_.empty()
               ? fmt::format("save() still writes the state of step {}, the last whole one: load it into a new Engine "
                             "to go on",
                             engine_->steps_done())
               : fmt::format("its state is not whole ({}), so it cannot be saved: make a new Engine from the last "
                             "checkpoint",
                             broken_);
  }

  // A failure inside a step (a device, an NVMe read, an update failed)
  // leaves the engine unable to go on (units held, a pass cut short): it is
  // brought to rest, and later calls refuse, except a save of a state that
  // is still whole (no update of the failed step applied: Engine::settle_after_failure).
  // A batch refused before any work (BatchRefused) is the caller's to fix: a
  // ValueError, and the engine goes on.
  template <typename Fn>
  auto run(const char* what, Fn&& fn, bool saving = false) -> decltype(fn()) {
    return translated(what, false, [&] {
      usable(saving);
      try {
        return fn();
      } catch (const BatchRefused& e) {
        TORCH_CHECK_VALUE(false, what, ": ", e.what());
      } catch (c10::Error& e) {  // from ATen: keeps its Python type (an out-of-memory error stays one)
        failed(what, e.what_without_backtrace());
        e.add_context(after_failure());
        throw;
      } catch (const std::exception& e) {
        failed(what, e.what());
        throw Error(fmt::format("{}; {}", e.what(), after_failure()));
      }
    });
  }
  void failed(const char* what, const std::string& error) {
    if (!failed_.empty()) return;
    broken_ = engine_->settle_after_failure(error);
    failed_ = fmt::format("{}: {}", what, error);
  }

  std::mutex mu_;  // Python threads may share one engine; the engine is not reentrant
  std::optional<DirLock> nvme_lock_;  // before engine_: released after the engine is gone
  std::unique_ptr<Engine> engine_;
  RanksStore hosted_;  // rank 0 of a Python data-parallel run: the ranks' store it hosts
  std::vector<std::string> names_;  // block order
  std::map<std::string, std::pair<int64_t, TensorSlot>> slots_;  // name -> (block, slot)
  std::string failed_;  // the first failure
  std::string broken_;  // why the state is not whole after it ("": it is, and may be saved)
};

// What a training checkpoint says about itself (the recovery rule applied),
// as JSON: enough to build the engine to resume into. ValueError naming the
// path or the field when there is none or it is incomplete.
std::string inspect_checkpoint(const std::string& dir) {
  return translated("inspect_training_checkpoint", true, [&] {
    const TrainCheckpointInfo info = inspect_training_checkpoint(dir);
    return nlohmann::json{{"path", info.path.string()},
                          {"step", info.step},
                          {"model_config", nlohmann::json::parse(info.model_config_json)},
                          {"engine_config", info.engine_config},
                          {"extra", info.extra},
                          // The exportable model files' checksums against the files (train_checkpoint.h).
                          {"model_problems", check_model_files(info)}}
        .dump();
  });
}

}  // namespace
}  // namespace strider

TORCH_LIBRARY_FRAGMENT(strider, m) {
  // EngineSettings first: the Engine's constructor takes one, so its type
  // must be known when that schema is made (one fragment, in this order:
  // static initialisers of two files run in no order C++ promises).
  using strider::EngineSettings;
  m.class_<EngineSettings>("EngineSettings")
      .def(torch::init<>())
      .def("set_int", &EngineSettings::set_int)
      .def("set_float", &EngineSettings::set_float)
      .def("set_bool", &EngineSettings::set_bool)
      .def("set_text", &EngineSettings::set_text)
      .def("set_ints", &EngineSettings::set_ints)
      .def("set_activations", &EngineSettings::set_activations)
      .def("set_devices", &EngineSettings::set_devices)
      .def("set_ranks", &EngineSettings::set_ranks)
      .def("plan", &EngineSettings::plan)
      .def("problems", &EngineSettings::problems);
  using strider::EngineHolder;
  m.class_<EngineHolder>("Engine")
      .def(torch::init<std::string, c10::intrusive_ptr<strider::EngineSettings>, std::string, int64_t, bool, int64_t>())
      .def("set_param", &EngineHolder::set_param)
      .def("param", &EngineHolder::param)
      .def("param_names", &EngineHolder::param_names)
      .def("trainable_names", &EngineHolder::trainable_names)
      .def("evaluate_objective", &EngineHolder::evaluate_objective, "",
           {torch::arg("ids"), torch::arg("labels"), torch::arg("positions") = c10::IValue(),
            torch::arg("attention_mask") = c10::IValue(), torch::arg("rows") = -1, torch::arg("row") = c10::IValue(),
            torch::arg("old_logps") = c10::IValue(), torch::arg("ref_logps") = c10::IValue()})
      .def("step", &EngineHolder::step, "",
           {torch::arg("ids"), torch::arg("labels"), torch::arg("positions") = c10::IValue(),
            torch::arg("attention_mask") = c10::IValue(), torch::arg("rows") = -1, torch::arg("row") = c10::IValue(),
            torch::arg("old_logps") = c10::IValue(), torch::arg("ref_logps") = c10::IValue()})
      .def("evaluate", &EngineHolder::evaluate, "",
           {torch::arg("ids"), torch::arg("labels"), torch::arg("positions") = c10::IValue(),
            torch::arg("attention_mask") = c10::IValue()})
      .def("logprobs", &EngineHolder::logprobs, "",
           {torch::arg("ids"), torch::arg("labels"), torch::arg("positions") = c10::IValue(),
            torch::arg("attention_mask") = c10::IValue(), torch::arg("reference") = false})
      .def("finish", &EngineHolder::finish)
      .def("inject_device_fault", &EngineHolder::inject_device_fault)
      .def("init_params", &EngineHolder::init_params)
      .def("write_trace", &EngineHolder::write_trace)
      .def("compute_view", &EngineHolder::compute_view)
      .def("held_quantized", &EngineHolder::held_quantized)
      .def("steps_done", &EngineHolder::steps_done)
      .def("engine_config_json", &EngineHolder::engine_config_json)
      .def("save_checkpoint", &EngineHolder::save_checkpoint)
      .def("load_checkpoint", &EngineHolder::load_checkpoint)
      .def("host_ranks", &EngineHolder::host_ranks)
      .def("join_ranks", &EngineHolder::join_ranks);
}

TORCH_LIBRARY_IMPL(strider, CompositeImplicitAutograd, m) {
  m.impl("inspect_training_checkpoint", &strider::inspect_checkpoint);
}
