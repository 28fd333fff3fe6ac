// The plan's words: activation modes parsed from the command line, byte
// counts and the process's own size, the plan printed as text and JSON and
// written as the engine's configuration.
// (The plan's search, engine/plan/plan.cpp, computes; this file reads and writes.)
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "engine/config/engine_config.h"
#include "engine/plan/plan.h"
#include "host/error.h"

namespace strider {

std::string format_bytes(uint64_t b) {
  if (b >= (1ull << 30)) return fmt::format("{:.2f} GiB", double(b) / double(1ull << 30));
  if (b >= (1ull << 20)) return fmt::format("{:.1f} MiB", double(b) / double(1ull << 20));
  if (b >= (1ull << 10)) return fmt::format("{:.1f} KiB", double(b) / 1024.0);
  return fmt::format("{} B", b);
}

std::string ram_headroom_text(std::string_view option, uint64_t ram) {
  const uint64_t keep = os_ram_headroom_bytes(ram);
  return fmt::format("{} {} less {} ({}%) left to the OS: {} for strider", option, format_bytes(ram),
                     format_bytes(keep), kOsRamPercent, format_bytes(ram - keep));
}

uint64_t process_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return uint64_t(std::strtoull(line.c_str() + 6, nullptr, 10)) * 1024;  // kB
  return 0;
}

const char* activation_mode_name(ActivationMode m) {
  return m == ActivationMode::kRecompute ? "recompute" : m == ActivationMode::kSaved ? "saved" : "auto";
}

ActivationMode parse_activation_mode(const std::string& text) {
  for (ActivationMode m : {ActivationMode::kAuto, ActivationMode::kRecompute, ActivationMode::kSaved})
    if (text == activation_mode_name(m)) return m;
  throw Error(fmt::format("activations '{}': expected auto, recompute or saved", text));
}

std::string Plan::explain() const {
  if (!feasible) return "not feasible: " + reason + "\n";
  std::string out;
  for (const auto& line : why) out += "  " + line + "\n";
  return out;
}

namespace {
nlohmann::json expert_trials_json(const std::vector<Plan::ExpertTrial>& trials) {
  nlohmann::json out = nlohmann::json::array();
  for (const Plan::ExpertTrial& t : trials) out.push_back({{"expert_pieces", t.expert_pieces}, {"tokens_per_s", t.tokens_per_s}});
  return out;
}

nlohmann::json other_formats_json(const std::vector<Plan::FormatFit>& fits) {
  nlohmann::json out = nlohmann::json::array();
  for (const Plan::FormatFit& f : fits)
    out.push_back({{"optimizer_state", state_format_name(f.format)}, {"feasible", f.feasible},
                   {"host_bytes", f.host_bytes}, {"nvme_blocks", f.nvme_blocks}});
  return out;
}
}  // namespace

std::string objective_reason(const ObjectiveConfig& o) {
  return fmt::format(
      "objective {}: one operation between the head's two passes maps the step's log-probabilities to the loss "
      "and each token's gradient (its inputs and coefficients are in the device figure){}",
      o.objective,
      o.objective == "dpo"
          ? "; a step's rows are N chosen sequences then their N rejected ones; the reference's log-probabilities "
            "come from one forward pass over every pair before the first step (`strider finetune --objective dpo`; "
            "Python passes them to each step), priced with --predict"
      : o.objective == "grpo"
          ? "; the reference's log-probabilities (beta > 0) come from Python: Engine.logprobs(..., reference=True) "
            "over the frozen base with LoRA, or with --keep-reference over the starting weights' copy in RAM, "
            "priced with --predict"
          : "");
}

void PlanLimits::take_settings(const EngineConfig& c) {
  seq = c.seq;
  micro_batch = c.micro_batch;
  accumulation = c.accumulation;
  dtype = c.compute.dtype;
  fp16_accumulate = c.compute.fp16_accumulate;
  vocab_chunk = c.compute.vocab_chunk;
  token_tile = c.compute.token_tile;
  window = c.window;
  if (c.checkpoints_on_host) checkpoints = CheckpointPlace::kHost;
  vocab_shard_rows = c.vocab_shard_rows;
  layer_pieces = c.layer_pieces;
  expert_pieces = c.expert_pieces;
  mlp_pieces = c.mlp_pieces;
  lora = c.lora;
  base_format = c.base_format;
  devices = c.devices;
  fp32_grad_transfer = c.fp32_grad_transfer;
  clip_norm = c.clip_norm;
  grad_ring = c.grad_ring;
  optimizer_state = c.optimizer_state;
  packed_documents = c.packed_documents;
  keep_reference = c.keep_reference;
  objective = c.objective;
  state_shards = c.state_shards;
}

// The inverse of PlanLimits::take_settings, with the plan's choices.
EngineConfig Plan::engine_config(const PlanLimits& l) const {
  EngineConfig c;
  c.seq = l.seq;
  c.micro_batch = l.micro_batch;
  c.accumulation = l.accumulation;
  c.compute = {l.dtype, l.vocab_chunk, token_tile, l.fp16_accumulate};
  c.vocab_shard_rows = l.vocab_shard_rows;
  c.layer_pieces = l.layer_pieces;
  c.expert_pieces = expert_pieces;
  c.mlp_pieces = mlp_pieces;
  c.lora = l.lora;
  c.base_format = l.base_format;
  c.devices = l.devices;
  c.fp32_grad_transfer = l.fp32_grad_transfer;
  c.window = window;
  c.checkpoints_on_host = checkpoints_on_host;
  c.nvme_dir = l.nvme_dir;
  c.nvme_blocks = nvme_blocks;
  c.nvme_compute_blocks = nvme_compute_blocks;
  c.clip_norm = l.clip_norm;
  c.grad_ring = l.grad_ring;
  c.optimizer_state = l.optimizer_state;
  c.saved_blocks = saved_blocks;
  c.keep_logits = keep_logits;
  c.packed_documents = l.packed_documents;
  c.keep_reference = l.keep_reference;
  c.objective = l.objective;
  c.state_shards = l.state_shards;
  if (l.shared_compute) c.shared_compute_file = "(shared memory)";  // its size is what counts here; the run names it
  return c;
}

nlohmann::json Plan::to_json() const {
  return {{"feasible", feasible}, {"reason", reason}, {"window", window},
          {"checkpoints_on_host", checkpoints_on_host}, {"nvme_blocks", nvme_blocks},
          {"nvme_compute_blocks", nvme_compute_blocks},
          {"unit_bytes", unit_bytes}, {"vocab_shards", vocab_shards}, {"shard_rows", shard_rows},
          {"head_chunk", head_chunk},
          {"token_tile", token_tile}, {"expert_pieces", expert_pieces}, {"mlp_pieces", mlp_pieces},
          {"device_buffer_bytes", device_buffer_bytes},
          {"device_work_bytes", device_work_bytes}, {"device_peak_bytes", device_peak_bytes},
          {"host_bytes", host_bytes}, {"host_pinned_bytes", pinned_bytes},
          {"host_registered_bytes", registered_bytes}, {"host_peak_bytes", host_peak_bytes},
          {"nvme_bytes", nvme_bytes}, {"optimizer_state", state_format_name(optimizer_state)},
          {"base_format", base_format_name(base_format)}, {"other_formats", other_formats_json(other_formats)},
          {"activations", activation_mode_name(activations)}, {"saved_layers", saved_layers},
          {"saved_blocks", saved_blocks}, {"saved_bytes_per_layer", saved_bytes_per_layer},
          {"saved_host_bytes", saved_host_bytes}, {"reference_host_bytes", reference_host_bytes}, {"keep_logits", keep_logits}, {"logits_bytes", logits_bytes},
          {"link_hide_tokens", link_hide_tokens}, {"expert_pieces_tried", expert_trials_json(expert_trials)},
          {"activation_cost", {{"recompute_s", layer_cost.recompute_s}, {"saved_s", layer_cost.saved_s},
                               {"pays", layer_cost.pays()}}},
          {"why", why}};
}

namespace {

std::string seconds_text(double s) { return s >= 1 ? fmt::format("{:.2f} s", s) : fmt::format("{:.1f} ms", s * 1e3); }

}  // namespace

// The pinned arena's parts, largest first: what a refusal names, so that
// the largest is the first a user reads ("141 GiB of block inputs kept for
// the backward", not the optimizer state's 12 bytes per parameter).
std::string host_parts_text(const EngineFootprint& f, const Placement& placed, const PlanLimits& l) {
  const uint64_t compute = ParamStore::compute_bytes_needed(placed.store_blocks, placed.store);
  const uint64_t reference = ParamStore::reference_bytes_needed(placed.store_blocks, placed.store);
  std::vector<std::pair<uint64_t, std::string>> parts = {
      {f.optimizer_host_bytes, fmt::format("the optimizer state ({}: master, Adam m and v at {:.4g} bytes per "
                                           "parameter)", state_format_name(l.optimizer_state),
                                           state_bytes_per_elem(l.optimizer_state))},
      {compute, "the compute copy"},
      {f.checkpoint_host_bytes,
       fmt::format("the block inputs kept for the backward ({} micro-batches x every layer at seq {}: "
                   "--accumulation, --micro-batch and --seq set it)", l.accumulation, l.seq)},
      {reference, "the starting weights' reference copy (--keep-reference)"}};
  uint64_t named = 0;
  for (const auto& [bytes, what] : parts) named += bytes;
  parts.push_back({f.host_bytes - std::min(f.host_bytes, named), "gradient staging and buffers"});
  std::stable_sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::string> text;
  for (const auto& [bytes, what] : parts)
    if (bytes > 0) text.push_back(fmt::format("{} {}", format_bytes(bytes), what));
  return fmt::format("{}", fmt::join(text, ", "));
}

std::string link_line(const PlanLimits& l, const LinkBalance& b) {
  std::string line = fmt::format(
      "link: a step sends {} of compute copies to the device (forward and backward), ~{} at {:.4g} GB/s, against "
      "~{} of compute for its {} tokens at {:.4g} TFLOP/s: about {} tokens per step hide the link",
      format_bytes(b.bytes), seconds_text(b.link_s), l.link_bytes_per_s * 1e-9, seconds_text(b.compute_s), b.tokens,
      l.compute_flops_per_s * 1e-12, b.hide_tokens);
  if (b.tokens < b.hide_tokens)
    line += fmt::format("; warning: {} do not, so the link sets the step's pace (from --accumulation ~{} on it "
                        "is hidden; with --predict the first line names the accumulation worth running at)",
                        b.tokens, (b.hide_tokens + l.seq * l.micro_batch - 1) / (l.seq * l.micro_batch));
  return line;
}

std::string activations_line(const ModelSpec& spec, const PlanLimits& l, const Plan& p, size_t wanted,
                             const std::string& device_fallback) {
  if (l.mlp_pieces > 0)
    return "activations: every layer recomputes from its checkpoint: a layer cut into sub-layer pieces keeps none";
  const ActivationCost& c = p.layer_cost;
  const std::string rates = fmt::format("at {:.4g} TFLOP/s and {:.4g} GB/s{}", l.compute_flops_per_s * 1e-12,
                                        l.copy_bytes_per_s() * 1e-9,
                                        l.copy_bytes_per_s() < l.link_bytes_per_s
                                            ? fmt::format(" (each of {} devices' share of the host's {:.4g} GB/s memory "
                                                          "bus, both ways)", l.devices, l.host_memory_bytes_per_s * 1e-9)
                                            : std::string());
  const std::string costs = fmt::format("per layer and step: recompute ~{}, kept ~{} {}", seconds_text(c.recompute_s),
                                        seconds_text(c.saved_s), rates);
  if (l.activations == ActivationMode::kRecompute)
    return "activations: every layer recomputes its forward from its checkpoint in backward (as asked)";
  if (!device_fallback.empty()) return "activations: every layer recomputes from its checkpoint: " + device_fallback;
  if (wanted == 0)
    return fmt::format("activations: every layer recomputes from its checkpoint: keeping its projections' outputs "
                       "would not pay ({})", costs);
  if (p.saved_layers == 0)
    return fmt::format("activations: every layer recomputes from its checkpoint: the host RAM limit {} leaves no "
                       "room for kept activations ({} per layer per step) after the optimizer state (kept "
                       "activations never push state to NVMe)",
                       format_bytes(l.host_bytes), format_bytes(p.saved_bytes_per_layer));
  std::string line = fmt::format(
      "activations: {} of {} layers keep their projections' outputs in host RAM ({} per layer per step, {}): their "
      "backward recomputes no matmul",
      p.saved_layers, spec.layers, format_bytes(p.saved_bytes_per_layer), format_bytes(p.saved_host_bytes));
  if (size_t(p.saved_layers) < wanted)
    line += fmt::format("; the host RAM limit {} holds {} of the {} after the optimizer state (kept activations "
                        "never push state to NVMe): the last {} keep theirs (their backward comes first)",
                        format_bytes(l.host_bytes), p.saved_layers, wanted, p.saved_layers);
  if (p.saved_layers < spec.layers) line += "; the rest recompute from checkpoints";
  if (l.activations == ActivationMode::kAuto) line += fmt::format(" ({})", costs);
  return line;
}

}  // namespace strider
