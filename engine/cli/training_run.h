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

#include "engine/collectives.h"
#include "engine/engine.h"
#include "engine/plan.h"
#include "io/run_lock.h"
#include "io/token_data.h"

namespace strider::cli {

struct TrainOptions {
  std::string model = "builtin", data = "builtin";
  std::string device = "auto", device_budget = "auto", host_ram = "0", nvme, dtype = "bf16", schedule = "cosine";
  std::string work_dir = ".strider";
  int64_t seq = 128, micro_batch = 4, accumulation = 2, window = 0, warmup = 10, vocab_chunk = 8192;
  int64_t token_tile = -1;              // -1: the plan chooses
  std::string grad_transfer = "bf16";
  std::string activations = "auto";     // auto, recompute, saved (PlanLimits::activations)
  std::string optimizer_state = "fp32"; // host/state_format.h
  double lr = 5e-3, weight_decay = 0.01, clip = 1.0, beta1 = 0.9, beta2 = 0.95;
  uint64_t seed = 1234;
  int optimizer_threads = 0;
};

// Upper bounds of the shape options: far past any machine, so that a value
// beyond them is a typo, refused while parsing.
inline constexpr int64_t kMaxSeq = int64_t{1} << 24, kMaxBatch = int64_t{1} << 20, kMaxWindow = 1 << 16,
                         kMaxVocabChunk = int64_t{1} << 24, kMaxSteps = int64_t{1000000000000};

// Registers TrainOptions' flags on `c` (CLI11 keeps pointers into `o`, which
// must outlive parsing). The steps option is each command's own.
void add_model_options(CLI::App& c, TrainOptions& o);     // --model, --data
void add_placement_options(CLI::App& c, TrainOptions& o);  // device, budgets, NVMe, shapes, dtype
void add_optimizer_options(CLI::App& c, TrainOptions& o);  // lr, schedule, warm-up, decay, clip, seed, threads
void add_work_dir_option(CLI::App& c, TrainOptions& o);
// --seq, --micro-batch, --accumulation, --window; --clip (shared with `strider plan`).
void add_shape_options(CLI::App& c, int64_t& seq, int64_t& micro_batch, int64_t& accumulation, int64_t& window);
void add_clip_option(CLI::App& c, double& clip, const std::string& help);
// --activations {auto,recompute,saved} (shared with `strider plan`).
void add_activations_option(CLI::App& c, std::string& activations);
void add_optimizer_state_option(CLI::App& c, std::string& format);

// --device-budget "auto": on a CUDA device, its free memory at start less a
// margin for what strider does not allocate itself (the CUDA context's
// growth, cuBLAS workspaces, the caching allocator's rounding): 5% of the free
// memory and 512 MiB. On the CPU device (and a simulated one) 24 MiB, the
// demo's: small enough that the built-in model slides its window. Any other
// value is a size ("20GiB") and wins. `why`, if given, says how "auto" came
// to its figure on CUDA (empty otherwise).
inline constexpr uint64_t kCpuDefaultBudgetBytes = uint64_t{24} << 20;
inline constexpr double kCudaBudgetMarginFraction = 0.05;
inline constexpr uint64_t kCudaBudgetMarginBytes = uint64_t{512} << 20;
uint64_t device_budget_bytes(const std::string& device, const std::string& budget, std::string* why = nullptr);

struct TrainingRun {
  nlohmann::json config;   // the model's config.json
  std::string model_dir;   // the checkpoint loaded; empty for the built-in model
  ModelSpec spec;
  PlanLimits limits;
  Plan plan;
  std::optional<DirLock> nvme_lock;  // --nvme is this run's alone (outlives the engine)
  std::unique_ptr<Engine> engine;
  std::string data;        // the training token file (built-in: generated under work_dir)
  std::unique_ptr<TokenFile> train_file;
  std::unique_ptr<TokenLoader> loader;
};

// Refuses, naming the variable, a run started as one of several processes
// (WORLD_SIZE > 1, as torchrun sets it): call before anything touches disk.
// (`strider profile`: a profile is one device's.)
void check_single_process(std::string_view command);

// Parses the model, makes the plan and prints it (headed "strider <command>:")
// to `log`, refuses an infeasible plan with its reason, checks and locks the
// --nvme directory, builds the engine on
// the device, initialises (from the seed) or loads its parameters (not on a
// simulated device: it holds none; a non-finite weight in a loaded model is
// refused, naming the tensor), and opens the training data. `total_steps`
// is the learning-rate schedule's length.
//
// With `ranks` of more than one (data parallel, launched by torchrun): each
// rank plans with its share of the machine's --host-ram (the state is whole on
// every rank), keeps NVMe-tier state under <--nvme>/rank<r>, and gets its
// engine channel; rank 0 writes the generated data while the others wait; the
// loader yields the global batch (every rank the same; rank r steps on its
// r-th share of the rows). Only the CPU device so far.
TrainingRun make_training_run(const TrainOptions& o, std::string_view command, int64_t total_steps,
                              std::FILE* log = stdout, Collectives* ranks = nullptr);

}  // namespace strider::cli
