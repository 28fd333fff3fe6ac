// Plan: before anything is allocated, decide from a model and the machine's
// limits how the sliding window will run, and say why, or refuse with the
// number that would be needed. The engine allocates exactly what the plan
// counted (device buffers beyond ATen's own working memory, host arena), and
// the same numbers drive the cost-model simulator.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "engine/config/config_fields.h"  // parse_bytes
#include "engine/config/objective_config.h"
#include "engine/model/model_spec.h"
#include "engine/placement/placement.h"
#include "gpu/device/sim_device.h"  // CostModel

namespace strider {

enum class CheckpointPlace { kAuto, kDevice, kHost };

// Per decoder layer, what its backward starts from (EngineConfig::saved_blocks):
// kRecompute: its block-input checkpoint (the forward's matmuls run again);
// kSaved: its projections' outputs kept in pinned host RAM (every layer RAM
// holds after everything else); kAuto: kept where that pays on the link by
// the cost model below (Plan::make), within the same RAM.
enum class ActivationMode { kAuto, kRecompute, kSaved };
const char* activation_mode_name(ActivationMode m);  // "auto", "recompute", "saved"
ActivationMode parse_activation_mode(const std::string& text);  // throws naming the text

// The plan's line for an objective past SFT (plan_text.cpp): what it adds, and what the plan does not price.
std::string objective_reason(const ObjectiveConfig& o);

struct PlanLimits {
  uint64_t device_bytes = 0;     // the device budget
  // Host RAM the whole process may hold at its peak (Plan::host_peak_bytes);
  // 0: unlimited. The pinned arena gets what the rest of the process (the
  // terms below, the device's whole budget where it is host memory) leaves.
  uint64_t host_bytes = 0;
  std::string nvme_dir;          // empty: no NVMe tier
  int64_t seq = 1024;
  int64_t micro_batch = 1;
  int64_t accumulation = 1;
  at::ScalarType dtype = at::kBFloat16;
  int64_t vocab_chunk = 8192;
  int64_t window = 0;            // 0: the largest that fits (at most kMaxAutoWindow)
  CheckpointPlace checkpoints = CheckpointPlace::kAuto;
  // Exact global-norm clipping keeps every gradient until the norm is known:
  // NVMe-tier blocks then spill theirs to NVMe (more NVMe space and traffic).
  double clip_norm = 1.0;
  int64_t grad_ring = 3;         // gradient staging slots of the NVMe-tier blocks
  int64_t token_tile = -1;       // tokens per tile in the head and the MLP; -1: the plan chooses, 0: untiled
  int64_t vocab_shard_rows = 0;  // 0: shards no larger than a layer (engine/placement/pieces.h)
  std::string layer_pieces;      // EngineConfig::layer_pieces (empty: one piece per layer)
  int64_t expert_pieces = 0;     // EngineConfig::expert_pieces (0: experts stay in the layer's pieces)
  int64_t mlp_pieces = 0;        // EngineConfig::mlp_pieces (0: whole layers, unless they do not fit: Plan::make)
  std::string lora;              // EngineConfig::lora (empty: every parameter trains); Plan::make applies it
  BaseFormat base_format = BaseFormat::kCompute;  // EngineConfig::base_format: how a LoRA base is held
  int devices = 1;               // a pool's devices, each with device_bytes (EngineConfig::devices)
  bool packed_documents = false; // rows pack documents: a mask per row (EngineConfig::packed_documents)
  bool keep_reference = false;   // a frozen copy of the starting weights in RAM (EngineConfig::keep_reference)
  ObjectiveConfig objective;     // what the step minimises (EngineConfig::objective)
  bool fp32_grad_transfer = false;  // gradients to the host in fp32 rather than the compute dtype
  bool fp16_accumulate = false;     // ComputeOptions::fp16_accumulate (priced by the machine's rate for it)
  StateFormat optimizer_state = StateFormat::kFp32;  // how master, m and v are stored (host/state_format.h)
  ActivationMode activations = ActivationMode::kAuto;
  // Data parallel with sharded state: the ranks the master, m and v are cut
  // over (EngineConfig::state_shards). The plan is rank 0's, whose slice is
  // the largest.
  int state_shards = 1;
  // The ranks of one machine share one compute copy in shared memory
  // (EngineConfig::shared_compute_file): host_bytes is then each rank's share
  // of what the machine has left after it.
  bool shared_compute = false;
  // The rest of the process's host memory, for Plan::host_peak_bytes: what
  // the process holds before the run allocates anything (its libraries and
  // runtimes: the caller measures it, process_rss_bytes()), whether the
  // device's memory is host memory too (the CPU device), and whether the run
  // loads a checkpoint (one block in fp32 plus one tensor's file pages at a
  // time, engine/model/hf_folder.h).
  uint64_t process_bytes = 0;
  bool device_memory_on_host = false;
  bool loads_checkpoint = false;
  // Where the device is the CPU, what the process grows by once ATen computes
  // beyond the device's own figure: its kernels' code paged in on first use,
  // the compute threads' stacks and malloc arenas, the moments when a block's
  // staging and ATen's work overlap. Fitted, not derived: the peak RSS of
  // tests/python/test_host_peak.py's runs (52M-parameter Llama, torch 2.15,
  // 2 cores) passed the other terms by -5 to +75 MiB (the NVMe tier the
  // most); 128 MiB leaves room for that spread.
  static constexpr uint64_t kCpuRuntimeGrowthBytes = uint64_t{128} << 20;
  // The machine kAuto prices a layer's recompute against its kept
  // activations' traffic on: sustained compute (FLOP/s) and PCIe per
  // direction (bytes/s). Defaults: the rtx4090 cost model (gpu/device/sim_device.h);
  // set_machine_rates takes another machine's (`strider plan --predict h200`).
  // The kernel-dependent terms of ATen's working memory (gpu/memory/work_calibration.h):
  // measured on the run's device where it can be (`strider finetune` on the
  // CPU device), the analytic upper bound otherwise.
  WorkCoefficients work = WorkCoefficients::analytic();
  bool work_measured = false;
  double compute_flops_per_s = CostModel::preset("rtx4090").sustained_tflops() * 1e12;
  double link_bytes_per_s = link_rate(CostModel::preset("rtx4090"));
  // The host's memory bus, which every device's copies cross (gpu/device/sim_host_memory.h,
  // SimHostMemory): the CostModel's, or twice a CPU device's measured memcpy
  // rate (a copy there reads and writes host memory).
  double host_memory_bytes_per_s = CostModel::preset("rtx4090").host_memory_gbps() * 1e9;

  // The engine settings the plan takes from `c`: shapes, compute dtype and
  // matmul accumulation, window and token tile (0 and -1: the plan chooses),
  // pieces, LoRA and its base's format, the pool's size, gradient transfer,
  // clipping, the gradient ring, the optimizer-state format, packed
  // documents, state shards, and checkpoints on the host where `c` asks (the
  // plan's choice otherwise). The one place settings are copied into limits:
  // `strider finetune`, `strider profile`, `strider plan` and strider.Engine
  // all make theirs here. Not the machine (budgets, the NVMe directory,
  // rates: set_device_rates) nor the kept activations, which are the run's.
  void take_settings(const EngineConfig& c);

  static double link_rate(const CostModel& m) { return std::min(m.h2d_gbps, m.d2h_gbps) * 1e9; }
  void set_machine_rates(const CostModel& m) {
    compute_flops_per_s = (fp16_accumulate ? m.with_fp16_accumulate() : m).sustained_tflops() * 1e12;
    link_bytes_per_s = link_rate(m);
    host_memory_bytes_per_s = m.host_memory_gbps() * 1e9;
  }
  // What one device's copies get each way: its link, or, where every device
  // of the pool copies both ways at once, its share of the host's memory bus
  // (what the simulator's shared bus gives them then). One device on the
  // rtx4090 preset: its link (25 GB/s against 70 / 2).
  double copy_bytes_per_s() const {
    return std::min(link_bytes_per_s, host_memory_bytes_per_s / (2.0 * double(std::max(devices, 1))));
  }
};

// kAuto's cost model for one decoder layer over one step (all micro-batches),
// in seconds; Plan::make keeps a layer's activations when saved_s < recompute_s.
//   F, B = forward, backward FLOPs (ModelSpec::cost) / compute rate,
//   P = the layer's parameter bytes (compute dtype), S = its kept bytes, link:
//   PlanLimits::copy_bytes_per_s (a pool's device: its share of the host's
//   memory bus, where that is less than its link):
//   recompute: forward max(F, P/link) + backward max(F + B, P/link)
//              (backward runs the forward again: F + B, B = 2F in full
//              training, the input gradients only under LoRA; the
//              parameters cross the link once per sweep, twice in all);
//   saved:     forward max(F, P/link, S/link) (S goes out on the d2h lane
//              while P comes in on h2d) + backward max(B + R, (P + S)/link)
//              (no matmul and no attention core recomputed; R: what is,
//              BlockCost::backward_recompute_flops; P and S both come in
//              on h2d).
// The gradients' D2H is the same either way and left out. A rough, one-layer
// model: the whole schedule, with its overlaps, is what --predict simulates.
struct ActivationCost {
  double forward_flops = 0, recompute_flops = 0;  // the layer's, one step (recompute: a kept backward's)
  double backward_flops = 0;  // its backward's, one step: 2x the forward, or input gradients only under LoRA
  uint64_t param_bytes = 0, saved_bytes = 0;
  double recompute_s = 0, saved_s = 0;
  bool pays() const { return saved_s < recompute_s; }
};
ActivationCost activation_cost(const ModelSpec& spec, const PlanLimits& limits, uint64_t saved_bytes_per_layer);

struct Plan;
// Whether a step's tokens hide the link: each step sends every block's
// compute copy to the device twice (forward, then backward), over one
// direction of the link, while the device computes the step's FLOPs
// (forward, backward, and the forward again where a layer recomputes). Bytes
// grow with the parameters (a mixture of experts': all of them), FLOPs with
// the tokens and the *active* parameters: below `hide_tokens` tokens per step
// the link, not the device, sets the pace. At the PlanLimits' machine rates.
// Not counted: the gradients' D2H (the other direction), blocks that stay in
// the window between forward and backward.
struct LinkBalance {
  uint64_t bytes = 0;       // compute copies sent per step
  double link_s = 0, compute_s = 0;
  int64_t tokens = 0;       // per step
  int64_t hide_tokens = 0;  // tokens per step at which compute_s reaches link_s
};
LinkBalance link_balance(const ModelSpec& spec, const PlanLimits& l, const std::vector<int64_t>& saved_blocks);
// The plan's line for it; `below` when the step's tokens fall short.
std::string link_line(const PlanLimits& l, const LinkBalance& b);

// The plan's line that says which layers keep their activations, and why
// (engine/plan/plan_text.cpp): `wanted` layers asked for, `device_fallback` the
// reason all recompute when their device slots did not fit (or empty).
std::string activations_line(const ModelSpec& spec, const PlanLimits& l, const Plan& p, size_t wanted,
                             const std::string& device_fallback);

struct Plan {
  static constexpr int64_t kMaxAutoWindow = 4;

  bool feasible = false;
  std::string reason;            // why not, with the numbers (when !feasible)
  bool device_short = false;     // not feasible because the device does not hold K = 2 units and what they need
  uint64_t device_rest_bytes = 0;  // then: what it needs besides the units (activations, working memory)
  int64_t window = 0;            // K
  bool checkpoints_on_host = false;
  std::vector<int64_t> nvme_blocks;
  // Decoder layers whose compute copy lives on NVMe too (only where every
  // block's state there still leaves too little RAM), ascending.
  std::vector<int64_t> nvme_compute_blocks;
  uint64_t unit_elems = 0, unit_bytes = 0;
  int64_t vocab_shards = 1, shard_rows = 0;  // the embedding's and LM head's vocabulary shards (engine/placement/pieces.h)
  int64_t head_chunk = 0;  // LM-head rows per logits chunk: below --vocab-chunk where the shards are (the loss rounds as it)
  int64_t token_tile = 0;                    // tokens per tile in the head and the MLP (0: untiled)
  // EngineConfig::expert_pieces: PlanLimits', or, where a mixture of experts
  // does not fit with whole layers, the group size the plan chose (Plan::make).
  int64_t expert_pieces = 0;
  // EngineConfig::mlp_pieces: PlanLimits', or, where a dense model's whole
  // layers do not fit the device, the fewest MLP slices that do (Plan::make).
  int64_t mlp_pieces = 0;
  uint64_t device_buffer_bytes = 0;  // what the engine allocates on the device (units, activations)
  uint64_t device_work_bytes = 0;    // ATen's working memory, estimated from the block costs
  uint64_t device_peak_bytes = 0;    // the two together
  // Pinned host RAM: the training state alone (the optimizer-state format's
  // bytes in RAM, the compute copy, gradient staging, NVMe staging), and the
  // whole arena (that, plus kept activations, host checkpoints, the batch).
  uint64_t host_bytes = 0;
  uint64_t pinned_bytes = 0;
  uint64_t registered_bytes = 0;  // of the pinned bytes, what the GPU page-locks (EngineFootprint)
  StateFormat optimizer_state = StateFormat::kFp32;
  BaseFormat base_format = BaseFormat::kCompute;  // how a LoRA base is held (PlanLimits::base_format)
  // The same limits with each other format: what its state takes in RAM and
  // how many blocks it puts on NVMe (a line of `why` says it too).
  struct FormatFit {
    StateFormat format = StateFormat::kFp32;
    bool feasible = false;
    uint64_t host_bytes = 0;
    int64_t nvme_blocks = 0;
  };
  std::vector<FormatFit> other_formats;
  // The whole process at its peak: the arena, plus PlanLimits::process_bytes,
  // plus the device's peak where its memory is host memory (the CPU device),
  // plus the load's staging. Not counted: a GPU driver's own host memory.
  uint64_t host_peak_bytes = 0;
  uint64_t nvme_bytes = 0;
  // Kept activations (PlanLimits::activations): the mode asked, the decoder
  // layers that keep theirs (blocks, ascending), what one such layer keeps
  // per step and all of them together (pinned host RAM, part of host_bytes),
  // and kAuto's per-layer figures.
  ActivationMode activations = ActivationMode::kAuto;
  std::vector<int64_t> saved_blocks;
  int64_t saved_layers = 0;
  uint64_t saved_bytes_per_layer = 0;
  uint64_t saved_host_bytes = 0;
  uint64_t reference_host_bytes = 0;  // of host_bytes, the starting weights' frozen copy (keep_reference)
  ActivationCost layer_cost;
  // The head's logits kept on the device between its passes
  // (EngineConfig::keep_logits), and their bytes (counted whether kept or not).
  bool keep_logits = false;
  uint64_t logits_bytes = 0;
  // Tokens per step that hide the link (link_balance; 0: not computed, as
  // where every block stays on the device or a LoRA base is quantized).
  int64_t link_hide_tokens = 0;
  // The expert pieces fastest_expert_pieces tried, each with its predicted
  // tokens/s (0 pieces: whole layers); empty where it tried none.
  struct ExpertTrial {
    int64_t expert_pieces = 0;
    double tokens_per_s = 0;
  };
  std::vector<ExpertTrial> expert_trials;
  std::vector<std::string> why;      // the decisions, one line each

  static Plan make(const ModelSpec& spec, const PlanLimits& limits);
  // The engine configuration this plan describes (optimizer settings left default).
  EngineConfig engine_config(const PlanLimits& limits) const;
  std::string explain() const;
  nlohmann::json to_json() const;
};

// A mixture of experts' pieces chosen for speed (engine/plan/plan_speed.cpp):
// where the limits name no cut (neither expert_pieces nor mlp_pieces) and
// `base` (Plan::make's answer) is feasible, the plan with whole layers and
// with pieces of 16, 4 and 1 experts (those below the expert count),
// each predicted by `tokens_per_s`; the fastest, where it beats the
// fastest of fewer pieces by at least 1%. Otherwise `base` as it is.
using PlanSpeed = std::function<double(const Plan&, const PlanLimits&)>;
Plan fastest_expert_pieces(const ModelSpec& spec, const PlanLimits& limits, Plan base, const PlanSpeed& tokens_per_s);

// What the plan advises beside its answer (engine/plan/plan_advice.cpp),
// from `tokens_per_s` (strider plan's simulated machine; empty: fit only).
//
// The accumulation worth running at: the smallest of 1, 2, 4, ..., 256 (at
// the limits' micro-batch) whose predicted speed reaches 90% of the best in
// that range (larger batches keep the link and the host optimizer busier,
// each step longer). Empty where no accumulation fits or nothing predicts.
struct AccumulationAdvice {
  int64_t accumulation = 0;
  double tokens_per_s = 0;
  int64_t best_accumulation = 0;
  double best_tokens_per_s = 0;
  std::vector<std::pair<int64_t, double>> trials;  // each accumulation that fits, and its speed
};
inline constexpr int64_t kMaxAdvisedAccumulation = 256;
inline constexpr double kAdvisedShareOfBest = 0.9;
std::optional<AccumulationAdvice> advise_accumulation(const ModelSpec& spec, const PlanLimits& limits,
                                                      const PlanSpeed& tokens_per_s);
// For a refused plan, each change of the options that makes it fit, as a
// user types it, with what it would reach: a smaller optimizer-state format,
// an NVMe folder, LoRA (full training), a quantized LoRA base, a smaller
// accumulation or micro-batch; a pair where no single change fits.
struct FitOption {
  std::string change;             // "--optimizer-state q8"
  uint64_t host_peak_bytes = 0;   // the process at its peak
  uint64_t nvme_bytes = 0;
  double tokens_per_s = 0;        // 0: not predicted (an NVMe folder that is not given)
};
// `nvme_free_bytes`: the free space of the limits' NVMe folder, which an
// option's state on NVMe must fit.
std::vector<FitOption> fitting_options(const ModelSpec& spec, const PlanLimits& limits, const PlanSpeed& tokens_per_s,
                                       std::optional<uint64_t> nvme_free_bytes = std::nullopt);
std::string fit_option_text(const FitOption& o);
// The pinned arena's parts, largest first, as a RAM refusal names them (plan_text.cpp).
std::string host_parts_text(const EngineFootprint& f, const Placement& placed, const PlanLimits& l);

// This process's resident memory now (VmRSS of /proc/self/status); 0 where unreadable.
uint64_t process_rss_bytes();

std::string format_bytes(uint64_t bytes);

// A host RAM figure given as the machine's (plan --ram, finetune --host-ram):
// strider plans its whole process within it less kOsRamPercent, left to the
// OS and the rest of the machine (the kernel, the page cache, a shell, the
// GPU driver). 0 (no limit) stays 0.
inline constexpr uint64_t kOsRamPercent = 5;
inline uint64_t os_ram_headroom_bytes(uint64_t ram) { return ram / 100 * kOsRamPercent + ram % 100 * kOsRamPercent / 100; }
// "--ram 128.0 GiB less 6.40 GiB (5%) left to the OS: 121.6 GiB for strider"
std::string ram_headroom_text(std::string_view option, uint64_t ram);

}  // namespace strider
