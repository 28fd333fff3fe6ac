#include "engine/cli/training_run.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <set>
#include <string_view>

#include "engine/cli/cli.h"
#include "engine/cli/run_outputs.h"
#include "engine/model/builtin.h"
#include "engine/model/hf_folder.h"
#include "engine/plan/plan_device.h"
#include "gpu/device/cpu_device.h"
#include "gpu/device/cuda_device.h"
#include "host/error.h"
#include "io/mapped_file.h"

namespace strider::cli {
namespace {

std::string read_text(const std::filesystem::path& p) {
  check_regular_input(p.string(), "a model config is a JSON file");
  std::ifstream in(p);
  STRIDER_CHECK(in.good(), "cannot read {}", p.string());
  return {std::istreambuf_iterator<char>(in), {}};
}

}  // namespace

void add_model_options(CLI::App& c, TrainOptions& o) {
  c.add_option("--model", o.model, "Hugging Face checkpoint directory, or 'builtin'")->capture_default_str();
  c.add_option("--data", o.data, "token file (python -m strider.data), or 'builtin'")->capture_default_str();
  o.config.add(c, "lora", o.lora);
  o.config.add(c, "base_format", o.base_format);
  o.packed_documents_option = o.config.add(c, "packed_documents", o.packed_documents);
}

BaseFormat base_format_option(const std::string& base_format, const std::string& lora) {
  const BaseFormat f = parse_base_format(base_format, "--base-format");
  STRIDER_CHECK(f == BaseFormat::kCompute || !lora.empty(),
                "--base-format {}: only a frozen LoRA base is held quantized; it needs --lora", base_format);
  return f;
}

bool documents_inside_windows(const TokenFile& file, int64_t seq) {
  for (const uint64_t start : file.doc_starts())
    if (start % uint64_t(seq) != 0) return true;
  return false;
}

void add_placement_options(CLI::App& c, TrainOptions& o) {
  ConfigOptions& f = o.config;
  f.add(c, "device", o.device);
  f.add(c, "devices", o.devices);
  f.add(c, "device_budget", o.device_budget);
  c.add_option("--host-ram", o.host_ram,
               "the machine's host RAM (0: no limit): the whole process plans to hold at most this less 5% left to "
               "the OS; the pinned arena gets what the rest of the process leaves, and state that does not fit goes "
               "to --nvme")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            try {
              parse_bytes(text);
            } catch (const Error& e) {
              return e.what();
            }
            return "";
          },
          "SIZE"));
  f.add(c, "nvme_dir", o.nvme);
  f.add(c, "seq", o.seq);
  f.add(c, "micro_batch", o.micro_batch);
  f.add(c, "accumulation", o.accumulation);
  f.add(c, "window", o.window);
  f.add(c, "dtype", o.dtype);
  f.add(c, "matmul_accumulate", o.matmul_accumulate);
  f.add(c, "vocab_chunk", o.vocab_chunk);
  f.add(c, "vocab_shard_rows", o.vocab_shard_rows);
  f.add(c, "layer_pieces", o.layer_pieces);
  f.add(c, "expert_pieces", o.expert_pieces);
  f.add(c, "mlp_pieces", o.mlp_pieces);
  f.add(c, "token_tile", o.token_tile);
  f.add(c, "grad_transfer", o.grad_transfer);
  f.add(c, "activations", o.activations);
  f.add(c, "optimizer_state", o.optimizer_state);
}

void add_objective_options(CLI::App& c, TrainOptions& o) {
  ConfigOptions& f = o.config;
  f.add(c, "objective", o.objective);
  f.add(c, "loss_type", o.loss_type);
  f.add(c, "beta", o.beta);
  f.add(c, "label_smoothing", o.label_smoothing);
  f.add(c, "simpo_gamma", o.simpo_gamma);
  f.add(c, "epsilon", o.epsilon);
  f.add(c, "epsilon_high", o.epsilon_high);
  f.add(c, "max_completion_length", o.max_completion_length);
}

void add_optimizer_options(CLI::App& c, TrainOptions& o) {
  ConfigOptions& f = o.config;
  f.add(c, "lr", o.lr);
  f.add(c, "schedule", o.schedule);
  f.add(c, "warmup_steps", o.warmup);
  f.add(c, "weight_decay", o.weight_decay);
  f.add(c, "decay_norms_and_biases", o.decay_norms_and_biases);
  f.add(c, "clip_norm", o.clip);
  f.add(c, "loss_scale", o.loss_scale);
  f.add(c, "loss_scale_growth_interval", o.loss_scale_growth_interval);
  f.add(c, "beta1", o.beta1);
  f.add(c, "beta2", o.beta2);
  f.add(c, "eps", o.eps);
  f.add(c, "optimizer", o.optimizer);
  // Checked as text: CLI11 reads "-1" into a uint64 as 2^64 - 1 and clamps
  // 2^64 to it, both without a word.
  c.add_option("--seed", o.seed, "seed for initialisation and data order (0 .. 2^64-1)")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            const std::string max = "18446744073709551615";
            const bool digits = !text.empty() && std::all_of(text.begin(), text.end(), [](char ch) {
              return ch >= '0' && ch <= '9';
            });
            const std::string t = text.substr(std::min(text.find_first_not_of('0'), text.size() - 1));
            if (!digits || t.size() > max.size() || (t.size() == max.size() && t > max))
              return "'" + text + "' is not a seed: a whole number from 0 to " + max;
            return "";
          },
          "SEED"));
  f.add(c, "optimizer_threads", o.optimizer_threads);
}

void add_work_dir_option(CLI::App& c, TrainOptions& o) {
  c.add_option("--work-dir", o.work_dir, "where built-in data is generated")->capture_default_str();
}

uint64_t device_budget_bytes(const std::string& device, const std::string& budget, std::string* why) {
  if (why != nullptr) why->clear();
  if (budget != "auto") return parse_bytes(budget);
  const DeviceChoice choice = choose_device(device);
  if (choice.kind != DeviceKind::kCuda) return CpuDevice::kDefaultBudgetBytes;
  const CudaMemory m = cuda_memory(choice.ordinal);
  const uint64_t bytes = auto_cuda_budget_bytes(m.free_bytes);
  STRIDER_CHECK(bytes > 0,
                "--device-budget auto: cuda:{} has {} free, no more than the margin of {:.0f}% and {} MiB kept for "
                "the CUDA context and ATen's allocator; free GPU memory, or give --device-budget a size",
                choice.ordinal, format_bytes(m.free_bytes), kCudaBudgetMarginFraction * 100,
                kCudaBudgetMarginBytes >> 20);
  if (why != nullptr)
    *why = fmt::format("{} (auto: cuda:{}'s {} free of {}, less {:.0f}% and {} MiB)", format_bytes(bytes),
                       choice.ordinal, format_bytes(m.free_bytes), format_bytes(m.total_bytes),
                       kCudaBudgetMarginFraction * 100, kCudaBudgetMarginBytes >> 20);
  return bytes;
}

uint64_t pool_device_budget_bytes(const std::vector<std::string>& pool, const std::string& budget, std::string* why) {
  uint64_t least = 0;
  size_t at = 0;
  std::string least_why;
  std::set<std::string> distinct;
  for (size_t i = 0; i < pool.size(); ++i) {
    std::string w;
    const uint64_t b = device_budget_bytes(pool[i], budget, &w);
    distinct.insert(pool[i]);
    if (i == 0 || b < least) {
      least = b;
      at = i;
      least_why = w;
    }
  }
  if (why != nullptr) {
    *why = least_why;
    if (budget == "auto" && distinct.size() > 1 && !least_why.empty())
      *why += fmt::format(", the least of the pool's {} devices: each plans on it ({} is the smallest)", pool.size(),
                          pool[at]);
  }
  return least;
}

void check_single_process(std::string_view command) {
  // Under a launcher that starts several processes (torchrun sets WORLD_SIZE)
  // each would profile alone and race the others on its outputs.
  if (const char* ws = std::getenv("WORLD_SIZE"); ws != nullptr && *ws != '\0' && std::string_view(ws) != "1")
    throw Error(fmt::format("WORLD_SIZE={} (set by torchrun or another launcher): strider {} measures one device in "
                            "one process; several would each run alone and overwrite each other's output. Launch "
                            "one process (`strider finetune` is the command that runs as several ranks)",
                            ws, command));
}

std::optional<InjectedFault> injected_fault_from_env() {
  const char* v = std::getenv("STRIDER_INJECT_DEVICE_FAULT");
  if (v == nullptr || *v == '\0') return std::nullopt;
  const std::string_view text(v);
  const size_t a = text.find(':'), b = text.rfind(':');
  InjectedFault f;
  auto number = [](std::string_view s, int64_t& out) {
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
    return ec == std::errc() && end == s.data() + s.size() && out >= 0;
  };
  std::optional<StepOpKind> kind = a < b ? op_kind_named(text.substr(a + 1, b - a - 1)) : std::nullopt;
  if (kind && op_side(*kind) != OpSide::kDevice) kind.reset();  // the engine's updater has no fault point
  STRIDER_CHECK(a < b && kind && number(text.substr(0, a), f.step) && number(text.substr(b + 1), f.block) && f.step > 0,
                "STRIDER_INJECT_DEVICE_FAULT={}: expected STEP:OP:BLOCK (a test hook; OP a device operation of the "
                "step program), e.g. 3:backward:1",
                text);
  f.kind = *kind;
  return f;
}

TrainingRun make_training_run(TrainOptions& o, std::string_view command, RunLength length,
                              std::FILE* log, Collectives* ranks) {
  namespace fs = std::filesystem;
  std::unique_ptr<Collectives> solo;
  if (ranks == nullptr) ranks = (solo = solo_collectives()).get();
  const RankInfo& me = ranks->ranks();
  TrainingRun run;
  // Data parallel on GPUs: each rank the machine's local rank's GPU, or with
  // --devices N (a count) a pool of its N: local rank r takes cuda:rN to
  // cuda:rN+N-1. Everything the ranks exchange lives in host memory
  // (gradients after their D2H, the state's slices, the shared compute
  // copy), so the transport is the same Gloo as on the CPU device.
  std::string device_spec = o.device;
  if (!me.solo() && o.device != "cpu" && o.device.rfind("sim", 0) != 0) {
    STRIDER_CHECK(o.device == "auto" || o.device == "cuda",
                  "--device {}: each data-parallel rank takes the GPU of its local rank (cuda:LOCAL_RANK); pass "
                  "--device cuda (or auto), and CUDA_VISIBLE_DEVICES to choose the machine's GPUs",
                  o.device);
    if (choose_device(o.device).kind == DeviceKind::kCuda) {
      int per_rank = 0;
      const auto [end, ec] = std::from_chars(o.devices.data(), o.devices.data() + o.devices.size(), per_rank);
      STRIDER_CHECK(ec == std::errc() && end == o.devices.data() + o.devices.size() && per_rank >= 1,
                    "--devices {} with {} data-parallel ranks: give a count N (local rank r takes cuda:rN to "
                    "cuda:rN+N-1); a list names one process's GPUs", o.devices, me.world);
      const CudaProbe probe = probe_cuda();
      const int first = me.local_rank * per_rank;
      STRIDER_CHECK(first + per_rank <= probe.device_count,
                    "rank {} (local rank {} of {}) takes cuda:{}{}, but this machine shows {} CUDA device(s){}; launch "
                    "at most {} ranks per machine (--nproc-per-node) with --devices {}",
                    me.rank, me.local_rank, me.local_world, first,
                    per_rank > 1 ? fmt::format(" to cuda:{}", first + per_rank - 1) : std::string(), probe.device_count,
                    probe.reason.empty() ? "" : " (" + probe.reason + ")", probe.device_count / per_rank, per_rank);
      device_spec = fmt::format("cuda:{}", first);
    }
  }
  // The built-in model trains from scratch: the demo's settings, for what the
  // command line left unset.
  const std::string demo = o.model == "builtin"
                               ? o.config.apply_demo(choose_device(device_spec).kind == DeviceKind::kCuda)
                               : std::string();
  // The model.
  if (o.model == "builtin") {
    run.config = builtin_model_config();
  } else {
    const std::string model = resolve_model_path(o.model);  // a path, or a Hub id in the local cache
    if (model != o.model) fmt::print(log, "  --model {}: the Hugging Face cache's {}\n", o.model, model);
    fs::path p = fs::is_directory(model) ? fs::path(model) / "config.json" : fs::path(model);
    run.model_dir = fs::is_directory(model) ? model : fs::path(model).parent_path().string();
    run.config = nlohmann::json::parse(read_text(p), nullptr, false);
    STRIDER_CHECK(!run.config.is_discarded(), "{}: not valid JSON", p.string());
  }
  run.spec = ModelSpec::from_json(run.config, o.model == "builtin" ? "built-in model" : o.model);
  const ModelSpec trained = run.spec.with_lora(o.lora, "--lora");  // what the engine trains (adapters, if any)

  // The data: generated by rank 0 alone (the others wait for it). Its
  // documents decide packed_documents where the command line does not.
  run.data = o.data;
  if (me.rank == 0) fs::create_directories(o.work_dir);
  if (run.data == "builtin") {
    run.data = (fs::path(o.work_dir) / "builtin-train.tokens").string();
    if (me.rank == 0) write_builtin_dataset(run.data, 2'000'000, 7, o.seed);
  }
  ranks->barrier();
  run.train_file = std::make_unique<TokenFile>(run.data, uint64_t(run.spec.dims.vocab));
  check_token_seq(*run.train_file, uint64_t(o.seq));  // before the model loads, not at the first batch
  const bool given = o.packed_documents_option != nullptr && o.packed_documents_option->count() > 0;
  run.packed = given ? o.packed_documents : documents_inside_windows(*run.train_file, o.seq);

  // The plan, before anything is allocated: the options' engine settings
  // (checked as a config file's), then this run's machine.
  base_format_option(o.base_format, o.lora);  // a base format without --lora: refused naming the flags
  const EngineConfig settings = o.config.engine_settings();
  PlanLimits& lim = run.limits;
  lim.take_settings(settings);
  lim.packed_documents = run.packed;
  // A pool plans every device on one budget (its K units and buffers are the
  // same on each): with auto, the smallest of its devices' (devices of
  // different memory: the larger ones' rest stays unused, and the plan says so).
  std::string budget_why;
  lim.device_bytes = pool_device_budget_bytes(pool_specs(device_spec, o.devices), o.device_budget, &budget_why);
  // --host-ram is the machine's, so each of its ranks plans with its share.
  // Data parallel, the ranks shard the state: each keeps its slice of master,
  // m and v (and its own compute copy and gradient staging). Every rank plans
  // for rank 0's slice, the largest, so that all take the same plan.
  lim.state_shards = me.world;
  lim.shared_compute = me.world > 1 && me.world == me.local_world && fs::is_directory("/dev/shm");
  const uint64_t host_ram = parse_bytes(o.host_ram);
  lim.host_bytes = host_ram - os_ram_headroom_bytes(host_ram);
  uint64_t shared = 0;
  if (lim.shared_compute) {
    shared = shared_compute_bytes(trained, parse_compute_dtype(o.dtype, "--dtype"));
    // A /dev/shm too small for it (a container's 64 MiB default) means a
    // compute copy per rank instead, decided together: every rank must
    // finish a piece's update the same way (a barrier, or a gather).
    std::error_code ec;
    const fs::space_info room = fs::space("/dev/shm", ec);
    const bool fits = !ec && room.available >= shared;
    if (ranks->any(!fits)) {
      lim.shared_compute = false;
      fmt::print(log, "  /dev/shm has {} free (on some rank), less than the shared compute copy's {}: a compute copy "
                 "per rank (a larger /dev/shm, e.g. docker --shm-size, shares it)\n",
                 ec ? std::string("?") : format_bytes(room.available), format_bytes(shared));
    }
  }
  if (lim.shared_compute) {  // the machine holds the compute copy once, outside the ranks' arenas
    STRIDER_CHECK(lim.host_bytes == 0 || shared < lim.host_bytes,
                  "--host-ram {}: the model's compute copy alone, shared by the machine's ranks, is {}", o.host_ram,
                  format_bytes(shared));
    if (lim.host_bytes > 0) lim.host_bytes -= shared;
  }
  lim.host_bytes /= uint64_t(me.local_world);
  STRIDER_CHECK(me.solo() || (o.device != "sim" && o.device.rfind("sim:", 0) != 0),
                "--device {}: a simulated device predicts one rank; `strider plan --gpus N` predicts data parallel",
                o.device);
  const std::string nvme_dir = o.nvme.empty() || me.solo() ? o.nvme : (fs::path(o.nvme) / fmt::format("rank{}", me.rank)).string();
  lim.nvme_dir = nvme_dir;
  lim.devices = int(pool_specs(device_spec, o.devices).size());
  lim.activations = parse_activation_mode(o.activations);
  set_device_rates(lim, device_spec);  // kept activations priced, and ATen's working memory sized, on this machine
  // The process's peak host memory (the plan's host_peak_bytes): what it holds
  // now, before anything is allocated, and what the run will add to the arena.
  lim.process_bytes = process_rss_bytes();
  lim.loads_checkpoint = !run.model_dir.empty();
  run.plan = Plan::make(run.spec, lim);
  fmt::print(log, "strider {}: {}\n{}{}", command, run.spec.summary(), demo.empty() ? "" : "  " + demo + "\n",
             run.plan.explain());
  if (!budget_why.empty()) fmt::print(log, "  device budget: {}\n", budget_why);
  if (run.packed)
    fmt::print(log, "  packed documents: each attends only to itself, its positions from its start ({})\n",
               given ? "--packed-documents"
                     : "the data's documents start inside --seq windows; --packed-documents=false lets them attend "
                       "across");
  if (host_ram > 0) fmt::print(log, "  RAM: {}\n", ram_headroom_text("--host-ram", host_ram));
  STRIDER_CHECK(run.plan.feasible, "{}", run.plan.reason);
  if (run.plan.nvme_bytes > 0) {
    // The plan counts the NVMe tier's bytes; the disk must have them (of the
    // directory, or of the nearest parent that exists: it is created later).
    fs::path at = nvme_dir;
    std::error_code ec;
    while (!at.empty() && !fs::exists(at, ec)) at = at.parent_path();
    const fs::space_info room = fs::space(at.empty() ? fs::path(".") : at, ec);
    STRIDER_CHECK(ec || room.available >= run.plan.nvme_bytes,
                  "--nvme {}: the plan puts {} of optimizer state there, but its file system has {} free; free space, "
                  "give --nvme on a larger disk, give more --host-ram, or choose --optimizer-state q8",
                  nvme_dir, format_bytes(run.plan.nvme_bytes), format_bytes(room.available));
  }

  EngineConfig cfg = run.plan.engine_config(lim);
  // What the plan does not decide, as the settings say.
  cfg.adam = settings.adam;
  cfg.decay_norms_and_biases = settings.decay_norms_and_biases;
  cfg.schedule = settings.schedule;
  // A preference objective reads pairs: each rank's rows are its pairs' chosen, then their rejected.
  const bool pairs = cfg.objective.resolve().pairs();
  run.loader = std::make_unique<TokenLoader>(
      *run.train_file, TokenLoaderOptions{.batch = uint64_t(cfg.batch() * me.world), .seq = uint64_t(cfg.seq),
                                          .seed = o.seed, .pair_rows = pairs ? uint64_t(cfg.batch()) : 0});
  run.total_steps = length.steps;
  if (length.epochs > 0) {
    const uint64_t units = run.loader->num_windows();  // a pass: each window (pair) once
    const uint64_t per_step = uint64_t(cfg.batch() * me.world) / (pairs ? 2 : 1);
    const long double steps = std::ceil((long double)length.epochs * units / per_step);
    STRIDER_CHECK(steps >= 1 && steps <= (long double)kMaxSteps, "--epochs {}: {} steps of {} {} over {}'s {} {}, "
                  "outside [1, {}]", length.epochs, double(steps), per_step, pairs ? "pairs" : "windows", run.data,
                  units, pairs ? "pairs" : "windows", kMaxSteps);
    run.total_steps = int64_t(steps);
    fmt::print(log, "--epochs {}: {} steps ({} {} of seq {} in {}, {} a step)\n", length.epochs, run.total_steps,
               units, pairs ? "pairs" : "windows", cfg.seq, run.data, per_step);
  }
  cfg.schedule.total_steps = run.total_steps;
  cfg.loss_scaling = settings.loss_scaling;
  cfg.optimizer_threads = settings.optimizer_threads;
  cfg.state_shard = me.rank;
  // One machine: its ranks share one compute copy in shared memory, named
  // for the run (torchrun's rendezvous port and run id). Local rank 0 clears
  // a dead run's file first; each engine maps (creating) it; once all have,
  // rank 0 unlinks the name, and the memory lives while a rank maps it.
  if (lim.shared_compute) {
    const char* port = std::getenv("MASTER_PORT");
    const char* run_id = std::getenv("TORCHELASTIC_RUN_ID");
    cfg.shared_compute_file = fmt::format("/dev/shm/strider-{}-{}-compute", port ? port : "0", run_id ? run_id : "run");
    if (me.local_rank == 0) fs::remove(cfg.shared_compute_file);
    ranks->barrier();
  }
  if (!nvme_dir.empty()) {
    if (!me.solo()) fs::create_directories(nvme_dir);
    check_output_dir(nvme_dir, "--nvme");
    run.nvme_lock.emplace(nvme_dir, "--nvme");
  }
  std::string why;
  // ATen's working memory gets what the budget leaves after the engine's own
  // buffers, enforced per op (a visit that would pass it fails naming itself,
  // rather than the budget being exceeded); the plan's estimate of it fits in there.
  const uint64_t work_limit = lim.device_bytes - std::min(lim.device_bytes, run.plan.device_buffer_bytes);
  if (lim.devices == 1) {
    auto device = make_device({.spec = device_spec, .budget_bytes = lim.device_bytes, .record_spans = true,
                               .work_limit_bytes = work_limit},
                              &why);
    fmt::print(log, "  device: {}{}\n", device->name(), why.empty() ? "" : " (" + why + ")");
    run.engine = std::make_unique<Engine>(run.spec, cfg, std::move(device));
  } else {
    auto pool = make_devices({.spec = device_spec, .budget_bytes = lim.device_bytes, .record_spans = true,
                              .work_limit_bytes = work_limit},
                             o.devices);
    std::string names;
    for (const auto& d : pool) names += (names.empty() ? "" : ", ") + d->name();
    fmt::print(log, "  devices: {} (a pool: block b's visits on device b % {}, the head's shards on the devices after)\n", names,
               pool.size());
    run.engine = std::make_unique<Engine>(run.spec, cfg, std::move(pool));
  }
  Engine& engine = *run.engine;
  if (!me.solo()) engine.set_collectives(ranks->split("engine"));
  if (!cfg.shared_compute_file.empty()) {
    ranks->barrier();  // every rank has mapped it
    if (me.local_rank == 0) fs::remove(cfg.shared_compute_file);
  }
  if (!me.solo()) {
    // The machine's host memory: each rank its slice of the state and its own
    // staging and runtime; the compute copy once when shared.
    const EngineFootprint f = footprint(trained, cfg);
    EngineConfig whole_cfg = cfg;
    whole_cfg.state_shards = 1;
    whole_cfg.state_shard = 0;
    whole_cfg.shared_compute_file.clear();
    const EngineFootprint whole = footprint(trained, whole_cfg);
    const uint64_t peak = run.plan.host_peak_bytes, staging = peak - std::min(peak, f.optimizer_host_bytes);
    fmt::print(log,
               "  data parallel: {} ranks, each keeping 1/{} of master, m and v ({} here, of {} in all){}; a rank's "
               "own staging and runtime ~{}; the machine's {} ranks ~{}\n",
               me.world, me.world, format_bytes(f.optimizer_host_bytes), format_bytes(whole.optimizer_host_bytes),
               f.shared_host_bytes ? fmt::format("; the compute copy ({}) shared in memory", format_bytes(f.shared_host_bytes))
                                   : std::string("; a compute copy each"),
               format_bytes(staging), me.local_world,
               format_bytes(uint64_t(me.local_world) * staging + whole.optimizer_host_bytes * uint64_t(me.local_world) / uint64_t(me.world) +
                            f.shared_host_bytes));
  }

  // The parameters. A simulated engine holds none: its losses are NaN anyway.
  if (engine.simulated()) {
    // nothing to initialise
  } else if (run.model_dir.empty()) {
    engine.init_params(o.seed);
  } else {
    // The checkpoint holds the model without adapters (run.spec); the
    // engine's blocks (engine.spec()) add them after each layer's base, new
    // as PEFT makes them (initial_values): the adapted model starts as the base.
    HfCheckpointReader reader(run.model_dir, run.spec);
    run.source_dtype = reader.dtype();
    for (int64_t b = 0; b < run.spec.num_blocks(); ++b) {
      std::vector<float> w(reader.layout(b).total_elems());
      reader.read_block(b, w);
      for (const TensorSlot& t : reader.layout(b).slots())
        for (size_t i = 0; i < t.numel; ++i)
          STRIDER_CHECK(std::isfinite(w[t.offset_elems + i]),
                        "{}: tensor '{}' holds {} at element {}: a model with a non-finite weight cannot train "
                        "(every loss would be NaN); repair or re-export the checkpoint",
                        run.model_dir, t.name, w[t.offset_elems + i], i);
      if (trained.lora.enabled()) {
        const ParamLayout base = reader.layout(b), with = trained.layout(b);
        std::vector<float> a(with.total_elems(), 0.0f);
        for (const TensorSlot& t : with.slots()) {
          const std::span<float> to = std::span(a).subspan(t.offset_elems, t.numel);
          if (const TensorSlot* from = base.find(t.name))
            std::copy_n(w.begin() + ptrdiff_t(from->offset_elems), t.numel, to.begin());
          else
            initial_values(t, o.seed, to, trained.dims.norm);
        }
        w = std::move(a);
      }
      engine.write_state(b, ExtentKind::kMaster, w);
    }
    fmt::print(log, "  loaded {}\n", run.model_dir);
  }

  return run;
}

}  // namespace strider::cli
