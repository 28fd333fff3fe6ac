// What `strider finetune` and `strider profile` share: the options that choose
// a model, its data, where it lives (the plan) and how it trains, and the
// construction, from them, of the model spec, the plan, the engine (with its
// parameters initialised or loaded) and the training data.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/cli/config_options.h"
#include "engine/plan/plan.h"
#include "engine/run/collectives.h"
#include "engine/run/engine.h"
#include "io/run_lock.h"
#include "io/token_data.h"

namespace strider::cli {

// The options of a training run. Those the configuration's declaration
// (engine/config/config_fields.json) holds take its defaults when registered
// (ConfigOptions); the rest are the commands' own.
struct TrainOptions {
  std::string model = "builtin", data = "builtin";
  std::string host_ram = "0", work_dir = ".strider";
  uint64_t seed = 1234;
  // From the declaration (the field's name where it differs).
  std::string device, devices, device_budget, nvme /* nvme_dir */, dtype, schedule, grad_transfer, activations,
      optimizer, optimizer_state, layer_pieces, lora, base_format = "compute";
  int64_t seq = 0, micro_batch = 0, accumulation = 0, window = 0, warmup = 0 /* warmup_steps */, vocab_chunk = 0,
          vocab_shard_rows = 0, expert_pieces = 0, mlp_pieces = 0, token_tile = 0;
  double lr = 0, weight_decay = 0, clip = 0 /* clip_norm */, beta1 = 0, beta2 = 0, eps = 0;
  double loss_scale = 0;                  // fp16's initial loss scale
  std::string matmul_accumulate;          // fp32 or fp16 (CUDA only)
  int64_t loss_scale_growth_interval = 0;
  bool decay_norms_and_biases = false;
  // Packed documents (EngineConfig::packed_documents): as given, or, where
  // the option is absent, on when the data's documents start inside windows.
  bool packed_documents = false;
  CLI::Option* packed_documents_option = nullptr;
  int optimizer_threads = 0;
  // An objective past SFT (`finetune` only; docs/objectives.md), as the declaration names them.
  std::string objective, loss_type;
  double beta = 0, label_smoothing = 0, simpo_gamma = 0, epsilon = 0, epsilon_high = 0;
  int64_t max_completion_length = 0;
  ConfigOptions config;  // what registered them: the demo's values for what was left unset
};

// Upper bounds of the commands' own counts: far past any machine, so that a
// value beyond them is a typo, refused while parsing.
inline constexpr int64_t kMaxSteps = int64_t{1000000000000};

// Registers TrainOptions' flags on `c` (CLI11 keeps pointers into `o`, which
// must outlive parsing). The steps option is each command's own.
void add_model_options(CLI::App& c, TrainOptions& o);     // --model, --data, --lora, --base-format, --packed-documents
void add_placement_options(CLI::App& c, TrainOptions& o);  // device, budgets, NVMe, shapes, dtype
void add_optimizer_options(CLI::App& c, TrainOptions& o);  // lr, schedule, warm-up, decay, clip, seed, threads
void add_work_dir_option(CLI::App& c, TrainOptions& o);
void add_objective_options(CLI::App& c, TrainOptions& o);  // --objective and its settings
// --base-format's value, refused (naming the flag) unless it is "compute" or
// --lora is given: only a frozen LoRA base is held quantized.
BaseFormat base_format_option(const std::string& base_format, const std::string& lora);

// --device-budget "auto": on a CUDA device, its free memory at start less a
// margin for what strider does not allocate itself (the CUDA context's
// growth, cuBLAS workspaces, the caching allocator's rounding): 5% of the free
// memory and 512 MiB (gpu/device/device.h, auto_cuda_budget_bytes). On the CPU
// device (and a simulated one) the CPU device's default, 1 GiB; the built-in
// demo's 24 MiB is its own setting (engine/config/config_fields.json). Any other
// value is a size ("20GiB") and wins. `why`, if given, says how "auto" came
// to its figure on CUDA (empty otherwise).
uint64_t device_budget_bytes(const std::string& device, const std::string& budget, std::string* why = nullptr);
// A pool's (pool_specs): every device plans on one budget, with auto the
// least of its devices' (`why` names the smallest when they differ).
uint64_t pool_device_budget_bytes(const std::vector<std::string>& pool, const std::string& budget,
                                  std::string* why = nullptr);

struct TrainingRun {
  nlohmann::json config;   // the model's config.json
  std::string model_dir;   // the checkpoint loaded; empty for the built-in model
  DType source_dtype = DType::kBF16;  // what most of its tensors are stored in (the built-in model: bf16)
  ModelSpec spec;
  PlanLimits limits;
  Plan plan;
  std::optional<DirLock> nvme_lock;  // --nvme is this run's alone (outlives the engine)
  std::unique_ptr<Engine> engine;
  std::string data;        // the training token file (built-in: generated under work_dir)
  std::unique_ptr<TokenFile> train_file;
  std::unique_ptr<TokenLoader> loader;
  bool packed = false;     // the loader gives positions (EngineConfig::packed_documents)
  int64_t total_steps = 0; // the schedule's length (RunLength)
};

// Whether a token file's documents start inside the windows of `seq` tokens
// the loader cuts it into (a document start off a window's first token):
// there, without packed documents, a window's attention crosses documents.
bool documents_inside_windows(const TokenFile& file, int64_t seq);

// Refuses, naming the variable, a run started as one of several processes
// (WORLD_SIZE > 1, as torchrun sets it): call before anything touches disk.
// (`strider profile`: a profile is one device's.)
void check_single_process(std::string_view command);

// Parses the model, applies the demo's settings to the built-in model (and
// says so), makes the plan and prints it (headed "strider <command>:")
// to `log`, refuses an infeasible plan with its reason, checks and locks the
// --nvme directory, builds the engine on
// the device, initialises (from the seed) or loads its parameters (not on a
// simulated device: it holds none; a non-finite weight in a loaded model is
// refused, naming the tensor), and opens the training data. `length` is
// the learning-rate schedule's.
//
// With `ranks` of more than one (data parallel, launched by torchrun): each
// rank plans with its share of the machine's --host-ram (the state is whole on
// every rank), keeps NVMe-tier state under <--nvme>/rank<r>, and gets its
// engine channel; rank 0 writes the generated data while the others wait; the
// loader yields the global batch (every rank the same; rank r steps on its
// r-th share of the rows). Only the CPU device so far.
//
// The run's length: `steps`, or (epochs > 0, `strider finetune --epochs`)
// as many steps as that many passes over the training file's windows take,
// each step's rows (every rank's; a preference objective's in pairs) being
// windows it has not yet handed out this pass: TrainingRun::total_steps.
struct RunLength {
  int64_t steps = 0;
  double epochs = 0;
  RunLength(int64_t s) : steps(s) {}  // NOLINT: a step count is a run length
  RunLength(int64_t s, double e) : steps(s), epochs(e) {}
};
TrainingRun make_training_run(TrainOptions& o, std::string_view command, RunLength length,
                              std::FILE* log = stdout, Collectives* ranks = nullptr);

// A test hook (engine/cli/README.md, "Testing a failure mid-step"):
// STRIDER_INJECT_DEVICE_FAULT=STEP:OP:BLOCK makes step STEP's first OP
// (the step program's name of a device operation: forward, backward, grads
// out, ...) of block BLOCK fail as it is issued, as a failed kernel launch
// or copy would (Engine::inject_device_fault). None when unset; a value
// that is not of that form is refused, naming the variable.
struct InjectedFault {
  int64_t step = 0;
  StepOpKind kind = StepOpKind::kForward;
  int64_t block = 0;
};
std::optional<InjectedFault> injected_fault_from_env();

}  // namespace strider::cli
