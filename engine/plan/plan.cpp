#include "engine/plan/plan.h"

#include <algorithm>
#include <cmath>
#include <fmt/ranges.h>

#include "engine/config/engine_config.h"
#include "engine/plan/plan_nvme.h"
#include "gpu/blocks/base_dequant.h"  // kDequantWorkBytes
#include "host/error.h"

namespace strider {
namespace {

// Before anything loops over the blocks or sums a size: the model and the
// limits must be ones whose sizes a machine could hold, so that no uint64 in
// the plan or the engine's footprint can wrap. The bounds are upper bounds of
// those sums in long double (which cannot overflow here), not the sums.
void check_plan_inputs(const ModelSpec& spec, const PlanLimits& l) {
  spec.check_size(spec.arch_name.empty() ? "plan: model" : "plan: " + spec.arch_name);
  STRIDER_CHECK(l.seq >= 1 && l.micro_batch >= 1 && l.accumulation >= 1, "plan: seq {}, micro-batch {} "
                "and accumulation {} must be >= 1", l.seq, l.micro_batch, l.accumulation);
  using ld = long double;
  const ld step_tokens = ld(l.seq) * ld(l.micro_batch) * ld(l.accumulation);
  STRIDER_CHECK(step_tokens <= ld(ModelSpec::kMaxTokens), "plan: a step of seq {} x micro-batch {} x "
                "accumulation {} = {:.4g} tokens is past 2^40 (its ids alone would fill 8 TiB)", l.seq,
                l.micro_batch, l.accumulation, double(step_tokens));
  const int64_t blocks = spec.num_blocks();
  STRIDER_CHECK(l.window >= 0 && l.window <= blocks, "plan: window {} is outside [0, {}] (0: choose; "
                "at most one cache unit per block)", l.window, blocks);
  STRIDER_CHECK(l.vocab_chunk >= 0, "plan: vocab chunk {} must be >= 0", l.vocab_chunk);
  STRIDER_CHECK(l.grad_ring >= 1, "plan: grad_ring {} must be >= 1", l.grad_ring);
  STRIDER_CHECK(!state_uses_compute_copy(l.optimizer_state) || l.dtype == at::kBFloat16,
                "plan: --optimizer-state {} keeps the master's high half in the bf16 compute copy: it needs --dtype "
                "bf16", state_format_name(l.optimizer_state));
  STRIDER_CHECK(l.token_tile >= -1 && l.vocab_shard_rows >= 0, "plan: token tile {} must be >= -1 (-1: choose) and "
                "vocab shard rows {} >= 0", l.token_tile, l.vocab_shard_rows);
  // Block inputs kept for backward (every block, every micro-batch, fp32 at
  // most), and the largest block in every cache unit and ring slot.
  const ld ckpt = ld(blocks) * ld(l.accumulation) * ld(l.micro_batch) * ld(l.seq) * ld(spec.dims.hidden) * 4;
  STRIDER_CHECK(ckpt <= ld(ModelSpec::kMaxBytes), "plan: the block inputs of one step ({} blocks x "
                "accumulation {} x micro-batch {} x seq {} x hidden {}) come to {:.4g} bytes, past 2^62; "
                "shorten seq or the batch", blocks, l.accumulation, l.micro_batch, l.seq,
                spec.dims.hidden, double(ckpt));
  const ld emb = ld(spec.layout(0).total_elems()), head = ld(spec.layout(blocks - 1).total_elems());
  const ld largest = std::max({emb, ld(spec.layout(spec.largest_layer_block()).total_elems()), head + emb});
  const int64_t slots = std::max<int64_t>({l.window, Plan::kMaxAutoWindow, l.grad_ring});
  const ld units = ld(slots) * largest * 8;
  STRIDER_CHECK(units <= ld(ModelSpec::kMaxBytes), "plan: {} cache units or gradient ring slots of "
                "{:.4g} elements each come to {:.4g} bytes, past 2^62", slots, double(largest),
                double(units));
}

}  // namespace

namespace {

// The largest fp32 block: what a load or an NVMe-tier save stages at a time.
uint64_t largest_block_f32_bytes(const ModelSpec& spec) {
  uint64_t bytes = 0;
  for (int64_t b = 0; b < spec.num_blocks(); ++b)
    bytes = std::max<uint64_t>(bytes, sizeof(float) * spec.layout(b).total_elems());
  return bytes;
}

// Host memory the process holds at its peak besides the pinned arena, as
// host_peak_bytes counts it (see the end of make_placed), at its largest
// before the plan is made: the device's whole budget where its memory is
// host memory. `parts` names them for a refusal.
uint64_t rest_of_process(const ModelSpec& spec, const PlanLimits& l, bool nvme_staging, std::string* parts) {
  const uint64_t block = largest_block_f32_bytes(spec);
  const uint64_t staging = l.loads_checkpoint ? 2 * block : nvme_staging ? block : 0;
  const uint64_t device = l.device_memory_on_host ? l.devices * l.device_bytes + PlanLimits::kCpuRuntimeGrowthBytes : 0;
  if (parts)
    *parts = fmt::format("{} the process before the run{}{}", format_bytes(l.process_bytes),
                         device ? fmt::format(" + {} the CPU device's budget and ATen's runtime", format_bytes(device))
                                : std::string(),
                         staging ? fmt::format(" + {} staging a block to load or save", format_bytes(staging))
                                 : std::string());
  return l.process_bytes + device + staging;
}

// `nvme_staging`: count one block's staging for a save of NVMe-tier state
// against the host RAM limit (place() asks again with it when the first
// placement put blocks on NVMe).
Plan make_placed(const ModelSpec& spec, const PlanLimits& l, const std::vector<int64_t>& wanted,
                 bool nvme_staging = false) {
  constexpr int64_t kMaxAutoWindow = Plan::kMaxAutoWindow;
  Plan p;
  p.expert_pieces = l.expert_pieces;
  p.mlp_pieces = l.mlp_pieces;
  // The host RAM limit bounds the whole process at its peak (host_peak_bytes):
  // the pinned arena gets what the rest of the process leaves of it.
  std::string rest_parts;
  const uint64_t rest = rest_of_process(spec, l, nvme_staging, &rest_parts);
  if (l.host_bytes > 0 && rest >= l.host_bytes) {
    p.reason = fmt::format("the host RAM limit {} is below what the process holds besides its pinned arena: {} "
                           "({}); raise the limit",
                           format_bytes(l.host_bytes), format_bytes(rest), rest_parts);
    return p;
  }
  const uint64_t arena_limit = l.host_bytes > 0 ? l.host_bytes - rest : 0;
  const std::string limit_text =
      l.host_bytes == 0 ? std::string()
                        : fmt::format("{} (the host RAM limit {} less {} for the rest of the process: {})",
                                      format_bytes(arena_limit), format_bytes(l.host_bytes), format_bytes(rest),
                                      rest_parts);
  const int64_t blocks = spec.num_blocks();
  const int cbytes = l.dtype == at::kFloat ? 4 : 2;
  const bool quantized = spec.lora.enabled() && l.base_format != BaseFormat::kCompute;  // a LoRA base in int8 or NF4
  // ATen's working memory: the largest visit's backward (recompute + autograd)
  // or the head's streamed loss, for one micro-batch, as ModelSpec::cost
  // models it from what tests/engine/test_layer_memory and test_head_memory
  // measure on the CPU (the CUDA figure is unmeasured until a GPU run). Every
  // layer has the same dimensions, so the embedding, one layer and the head
  // say it all.
  const Sharding sh = make_sharding(spec, l.vocab_chunk, l.vocab_shard_rows,
                                    l.optimizer_state == StateFormat::kQ8 ? int64_t(kQ8GroupElems) : 1, "", l.devices);
  uint64_t work = 0;
  auto work_for = [&](int64_t tile) {
    uint64_t w = 0;
    for (int64_t b : {int64_t{0}, int64_t{1}, blocks - 1}) {
      const BlockCost c = spec.cost(b, l.micro_batch, l.seq, sh.chunk, cbytes, tile, l.work, l.packed_documents);
      w = std::max<uint64_t>(w, uint64_t(std::max(c.forward_work_bytes, c.backward_work_bytes)));
    }
    if (quantized) w = std::max<uint64_t>(w, kDequantWorkBytes);  // the dequantization, an operation of its own
    return w;
  };

  PlanLimits lim = l;
  auto fits = [&](int64_t k, bool host_ckpt, EngineFootprint* out) {
    Plan trial = p;
    trial.window = k;
    trial.checkpoints_on_host = host_ckpt;
    trial.saved_blocks = wanted;
    EngineFootprint f = footprint(spec, trial.engine_config(lim));
    if (out) *out = f;
    return f.device_bytes + work <= l.device_bytes;
  };
  const int64_t k_min = l.window > 0 ? l.window : 2;
  auto host_ckpt_for = [&] {
    return l.checkpoints == CheckpointPlace::kHost || (l.checkpoints == CheckpointPlace::kAuto && !fits(2, false, nullptr));
  };
  // The token tile (the head; the layers' projections and MLP, their
  // attention's queries): untiled unless the working memory does not fit,
  // then the largest tile that makes it fit (long context).
  std::vector<int64_t> tiles;
  const int64_t mb_tokens = l.micro_batch * l.seq;
  if (l.token_tile >= 0) {
    tiles.push_back(l.token_tile);
  } else {
    tiles.push_back(0);
    for (int64_t t : {8192, 4096, 2048, 1024, 512, 256})
      if (t < mb_tokens) tiles.push_back(t);
  }
  uint64_t untiled_work = 0;
  for (size_t i = 0; i < tiles.size(); ++i) {
    p.token_tile = tiles[i];
    work = work_for(p.token_tile);
    if (i == 0) untiled_work = work;
    if (fits(k_min, host_ckpt_for(), nullptr)) break;
  }
  p.device_work_bytes = work;

  // Checkpoints on the device when they fit with K = 2, else on the host.
  EngineFootprint f;
  const bool host_ckpt = host_ckpt_for();
  if (!fits(k_min, host_ckpt, &f)) {
    p.device_short = true;
    p.device_rest_bytes = f.activation_bytes + work;
    p.reason = fmt::format(
        "needs {} of device memory for K={} at micro-batch {} (seq {}): {} cache units of {}, {} of "
        "activations{}, ~{} of working memory; the budget is {}: give the device more (`strider finetune "
        "--device-budget`, `strider plan --gpu`), or a smaller --micro-batch or --seq",
        format_bytes(f.device_bytes + work), k_min, l.micro_batch, l.seq, k_min, format_bytes(f.unit_bytes),
        format_bytes(f.activation_bytes), host_ckpt ? " (checkpoints on the host)" : "", format_bytes(work),
        format_bytes(l.device_bytes));
    return p;
  }
  int64_t k = k_min;
  if (l.window == 0) {
    const int64_t cap = std::min<int64_t>(blocks, kMaxAutoWindow);
    while (k < cap && fits(k + 1, host_ckpt, nullptr)) ++k;
  }
  p.window = k;
  p.checkpoints_on_host = host_ckpt;
  fits(k, host_ckpt, &f);  // f: the footprint of the chosen window
  // A shard smaller than --vocab-chunk shrinks the head's chunks to it: the loss's log-sum-exp then merges
  // other partial sums, so the run's bits are those of --vocab-chunk f.head_chunk, not the default's.
  const int64_t asked_chunk = l.vocab_chunk > 0 ? std::min(l.vocab_chunk, spec.dims.vocab) : spec.dims.vocab;
  const std::string chunk_note = f.head_chunk >= asked_chunk ? "" : fmt::format(
      "; LM-head chunks of {} rows, not {} (--vocab-chunk): the loss rounds as --vocab-chunk {} would",
      f.head_chunk, asked_chunk, f.head_chunk);
  p.why.push_back(fmt::format("{} blocks: embedding, {} layers, head; the embedding and the LM head move in {} "
                              "vocabulary shard{} of {} rows, no larger than a {}{}", blocks, spec.layers,
                              f.vocab_shards, f.vocab_shards == 1 ? "" : "s", f.shard_rows,
                              l.mlp_pieces > 0 ? "layer's piece" : "layer", chunk_note));
  p.why.push_back(fmt::format("window K = {}: {} cache units of {} ({} parameters + fp32 gradients{}{}) {}", k, k,
                              format_bytes(f.unit_bytes), f.unit_elems,
                              f.unit_grad_elems < f.unit_elems ? fmt::format(" of the {} trained", f.unit_grad_elems) : "",
                              quantized ? fmt::format(" + the {} base's bytes, dequantized at each visit",
                                                           base_format_name(l.base_format))
                                             : "",
                              l.window > 0 ? "(as asked)" : k == blocks ? "(the whole model fits)"
                                             : k == kMaxAutoWindow ? "(more hides no more transfer time)"
                                                                   : "(the most that fits)"));
  p.why.push_back(fmt::format("checkpoints (block inputs) on the {}: {} of activations on the device", host_ckpt ? "host" : "device",
                              format_bytes(f.activation_bytes)));
  if (p.token_tile == 0)
    p.why.push_back(fmt::format("head and layers untiled: ~{} of ATen working memory per visit", format_bytes(work)));
  else
    p.why.push_back(fmt::format("head and layers in tiles of {} tokens{} (attention in query tiles of {} positions): "
                                "~{} of ATen working memory per visit{}", p.token_tile,
                                l.token_tile >= 0 ? " (as asked)" : "",
                                attention_query_tile(spec.dims, l.micro_batch, l.seq, p.token_tile), format_bytes(work),
                                l.token_tile >= 0 ? "" : fmt::format(" (untiled: {})", format_bytes(untiled_work))));
  if (l.work_measured && cbytes < 4)
    p.why.push_back(fmt::format("working memory as measured on this device: a bf16 GEMM stages {:.1f} bytes per "
                                "output element, silu's backward {:.1f} (the analytic model: {:.0f} and {:.0f})",
                                l.work.gemm_staging_bytes, l.work.silu_back_staging_bytes,
                                WorkCoefficients::analytic().gemm_staging_bytes,
                                WorkCoefficients::analytic().silu_back_staging_bytes));

  // Host RAM. The optimizer state is placed first, as if no activation were
  // kept: kept activations only take the RAM left after it, so they never
  // push a block's state to NVMe (an NVMe-tier block costs a read and a
  // write of 12 bytes per parameter every step; a layer that cannot keep its
  // activations only recomputes its forward).
  const Placement placed = place(spec, p.engine_config(lim));
  f = placed.footprint;
  // Move blocks' fp32 state to NVMe, largest first, until it fits.
  if (arena_limit > 0 && f.host_bytes - f.optimizer_host_bytes > arena_limit && spec.lora.enabled()) {
    // The frozen base stays in RAM: NVMe takes optimizer state, and a base has none.
    p.feasible = false;
    if (!quantized) {
      const uint64_t base = uint64_t(spec.param_count()) * (l.dtype == at::kFloat ? 4 : 2);
      p.reason = fmt::format("needs {} of pinned host RAM, {} of it the frozen base's compute copy ({}: LoRA "
                             "trains adapters over it, and NVMe holds optimizer state, not a frozen base's compute copy); the "
                             "limit is {}; give more --ram, or hold the base in int8 or NF4 (--base-format)",
                             format_bytes(f.host_bytes), format_bytes(base), compute_dtype_name(l.dtype),
                             limit_text);
    } else {
      const uint64_t base = ParamStore::compute_bytes_needed(placed.store_blocks, placed.store);
      p.reason = fmt::format("needs {} of pinned host RAM, {} of it the frozen base ({} layers, the rest in {}: "
                             "NVMe holds optimizer state, not the base); the limit is {}; give more --ram",
                             format_bytes(f.host_bytes), format_bytes(base), base_format_name(l.base_format),
                             compute_dtype_name(l.dtype), limit_text);
    }
    return p;
  }
  if (arena_limit > 0 && f.host_bytes > arena_limit) {
    if (l.nvme_dir.empty()) {
      p.feasible = false;
      p.reason = fmt::format("needs {} of pinned host RAM ({}); the limit is {}; give an NVMe directory (--nvme) "
                             "for the optimizer state{}",
                             format_bytes(f.host_bytes), host_parts_text(f, placed, l), limit_text,
                             l.optimizer_state == StateFormat::kFp32 ? ", or hold it in 8 bits (--optimizer-state q8)"
                                                                     : "");
      return p;
    }
    if (!place_on_nvme(spec, l, lim, p, f, arena_limit, limit_text)) return p;
  } else {
    p.why.push_back(fmt::format("optimizer state ({}: master, Adam m, v at {:.4g} bytes per parameter) in host RAM",
                                state_format_name(l.optimizer_state), state_bytes_per_elem(l.optimizer_state)));
  }
  if (l.clip_norm <= 0 && l.dtype != at::kHalf)
    p.why.push_back(fmt::format("no clipping: every block's gradients through a ring of {} host slots, each freed "
                                "by its block's update",
                                l.grad_ring));
  // Kept activations: the last of the wanted layers that the RAM left holds
  // (their backward comes first, so their copies back are the first needed).
  p.saved_blocks = wanted;
  if (!wanted.empty()) {
    const EngineFootprint all = footprint(spec, p.engine_config(lim));
    size_t n = wanted.size();
    if (arena_limit > 0 && all.host_bytes > arena_limit) {
      const uint64_t left = arena_limit - std::min(arena_limit, f.host_bytes);
      if (all.saved_bytes_per_layer > 0) n = std::min<size_t>(n, size_t(left / all.saved_bytes_per_layer));
      for (;; --n) {
        p.saved_blocks.assign(wanted.end() - ptrdiff_t(n), wanted.end());
        if (n == 0 || footprint(spec, p.engine_config(lim)).host_bytes <= arena_limit) break;
      }
    }
    f = footprint(spec, p.engine_config(lim));
  }
  p.saved_layers = int64_t(p.saved_blocks.size());
  p.saved_host_bytes = f.saved_host_bytes;
  // Kept logits (not when asked to recompute): the head's pass 2 takes pass
  // 1's logits, one logits GEMM of three less, when they fit on the device
  // after everything else. No link traffic: nothing to weigh but the room.
  if (l.activations != ActivationMode::kRecompute) {
    p.keep_logits = true;
    const EngineFootprint k = footprint(spec, p.engine_config(lim));
    p.logits_bytes = k.logits_bytes;
    p.keep_logits = k.device_bytes + work <= l.device_bytes;
    if (p.keep_logits) f = k;
    p.why.push_back(p.keep_logits
                        ? fmt::format("logits: kept on the device between the head's two passes ({}): its "
                                      "backward computes two of the three logits GEMMs",
                                      format_bytes(p.logits_bytes))
                        : fmt::format("logits: computed again in the head's backward: keeping them ({}) would pass "
                                      "the device budget",
                                      format_bytes(p.logits_bytes)));
  }

  if (!l.objective.sft()) p.why.push_back(objective_reason(l.objective));
  p.feasible = true;
  p.unit_elems = f.unit_elems;
  p.vocab_shards = f.vocab_shards;
  p.shard_rows = f.shard_rows;
  p.head_chunk = f.head_chunk;
  p.unit_bytes = f.unit_bytes;
  p.device_buffer_bytes = f.device_bytes;
  p.device_peak_bytes = f.device_bytes + work;
  p.host_bytes = f.state_host_bytes;
  p.pinned_bytes = f.host_bytes;
  p.registered_bytes = f.registered_host_bytes;
  p.optimizer_state = l.optimizer_state;
  p.base_format = l.base_format;
  p.nvme_bytes = f.nvme_bytes;
  p.why.push_back(fmt::format("device{}: {} allocated at start + ~{} ATen working memory = {} of {}",
                              l.devices > 1 ? fmt::format(" (each of {}; the largest's share)", l.devices) : "",
                              format_bytes(f.device_bytes), format_bytes(work), format_bytes(p.device_peak_bytes),
                              format_bytes(l.device_bytes)));
  // The process's peak (what a host RAM figure given as "the machine's free
  // memory" must hold). Staging, one whole block at a time: a load reads a block into an fp32
  // buffer from one tensor's file pages at a time (at most as many bytes
  // again); a save of NVMe-tier state reads each block's master back first.
  const uint64_t block_bytes = largest_block_f32_bytes(spec);
  const uint64_t staging = l.loads_checkpoint ? 2 * block_bytes : p.nvme_blocks.empty() ? 0 : block_bytes;
  const uint64_t on_device = l.device_memory_on_host ? l.devices * p.device_peak_bytes + PlanLimits::kCpuRuntimeGrowthBytes : 0;
  p.host_peak_bytes = f.host_bytes + l.process_bytes + on_device + staging;
  std::string parts = fmt::format("{} pinned", format_bytes(f.host_bytes));
  if (l.process_bytes > 0) parts += fmt::format(" + {} the process before the run", format_bytes(l.process_bytes));
  if (on_device > 0)
    parts += fmt::format(" + {} device memory and ATen's runtime (host memory on the CPU device)",
                         format_bytes(on_device));
  if (staging > 0) parts += fmt::format(" + {} staging a block to load or save", format_bytes(staging));
  p.reference_host_bytes = l.keep_reference ? ParamStore::reference_bytes_needed(placed.store_blocks, placed.store) : 0;
  const double params = double(spec.param_count());
  p.why.push_back(fmt::format("host: {} pinned, {} of it the training state ({:.2f} bytes per parameter: {} "
                              "optimizer state, the compute copy{}, gradient staging{}); at its peak the process "
                              "holds ~{} ({})", format_bytes(f.host_bytes), format_bytes(p.host_bytes),
                              double(p.host_bytes) / params, state_format_name(l.optimizer_state),
                              quantized ? fmt::format(" (the layers' frozen base in {})", base_format_name(l.base_format))
                                        : "",
                              p.reference_host_bytes > 0
                                  ? fmt::format(", the starting weights' reference copy {}",
                                                format_bytes(p.reference_host_bytes))
                                  : "",
                              format_bytes(p.host_peak_bytes), parts));
  return p;
}

// make_placed, and again with an NVMe-tier save's staging counted against
// the host RAM limit when the first placement put state on NVMe.
Plan place(const ModelSpec& spec, const PlanLimits& l, const std::vector<int64_t>& wanted) {
  Plan p = make_placed(spec, l, wanted);
  if (p.feasible && !p.nvme_blocks.empty() && !l.loads_checkpoint && l.host_bytes > 0)
    p = make_placed(spec, l, wanted, true);
  return p;
}

// The plan for the limits as given (Plan::make may then cut experts).
Plan make_as_given(const ModelSpec& model, const PlanLimits& l) {
  STRIDER_CHECK(l.device_bytes > 0, "plan: the device budget must be > 0");
  const ModelSpec spec = model.with_lora(l.lora, "plan: lora");  // what the engine trains
  check_plan_inputs(spec, l);
  // What one kept layer holds per step, and whether keeping pays (kAuto).
  EngineConfig one;
  one.seq = l.seq;
  one.micro_batch = l.micro_batch;
  one.accumulation = l.accumulation;
  one.compute = {l.dtype, l.vocab_chunk, 0};
  one.saved_blocks = {1};
  const uint64_t per_layer = footprint(spec, one).saved_bytes_per_layer;
  const ActivationCost cost = activation_cost(spec, l, per_layer);
  std::vector<int64_t> wanted;
  // A layer cut into sub-layer pieces keeps none (docs/pieces.md, "Sub-layer pieces").
  if (l.mlp_pieces == 0 &&
      (l.activations == ActivationMode::kSaved || (l.activations == ActivationMode::kAuto && cost.pays())))
    for (int64_t b = 1; b <= spec.layers; ++b) wanted.push_back(b);

  Plan p = place(spec, l, wanted);
  std::string device_fallback;
  if (!p.feasible && !wanted.empty()) {
    // The kept activations' two device slots may be what does not fit: then
    // every layer recomputes, and the plan says so.
    Plan without = place(spec, l, {});
    if (without.feasible) {
      device_fallback = fmt::format("the two device slots of kept activations do not fit (with them the plan {})",
                                    p.reason);
      p = std::move(without);
    }
  }
  if (p.feasible) {
    // What the other formats would take under the same limits.
    std::vector<std::string> fits;
    for (StateFormat other : {StateFormat::kFp32, StateFormat::kQ8}) {
      if (other == l.optimizer_state) continue;
      PlanLimits lo = l;
      lo.optimizer_state = other;
      if (other == StateFormat::kQ8 && lo.dtype != at::kBFloat16) continue;  // q8 needs the bf16 compute copy
      Plan q;
      try {
        q = place(spec, lo, p.saved_blocks);
      } catch (const Error& e) {  // a cut into sub-layer pieces that splits q8's groups
        fits.push_back(fmt::format("{} cannot be used ({})", state_format_name(other), e.what()));
        continue;
      }
      p.other_formats.push_back({other, q.feasible, q.host_bytes, int64_t(q.nvme_blocks.size())});
      fits.push_back(!q.feasible ? fmt::format("{} does not fit ({})", state_format_name(other), q.reason)
                     : fmt::format("{} would take {} ({:.2f} bytes per parameter) with {}", state_format_name(other),
                                   format_bytes(q.host_bytes), double(q.host_bytes) / double(spec.param_count()),
                                   q.nvme_blocks.empty() ? std::string("all state in RAM")
                                   : q.nvme_compute_blocks.empty()
                                       ? fmt::format("{} blocks' state on NVMe", q.nvme_blocks.size())
                                       : fmt::format("{} blocks' state and {} layers' compute copies on NVMe",
                                                     q.nvme_blocks.size(), q.nvme_compute_blocks.size())));
    }
    if (!fits.empty()) p.why.push_back("other optimizer-state formats (--optimizer-state): " + fmt::format("{}", fmt::join(fits, "; ")));
  }
  p.activations = l.activations;
  p.layer_cost = cost;
  p.saved_bytes_per_layer = per_layer;
  if (p.feasible) {
    // After the checkpoints line, with the decisions about the device.
    const auto at = std::find_if(p.why.begin(), p.why.end(),
                                 [](const std::string& w) { return w.rfind("checkpoints", 0) == 0; });
    p.why.insert(at == p.why.end() ? at : at + 1, activations_line(spec, l, p, wanted.size(), device_fallback));
    if (p.window < spec.num_blocks() && p.base_format == BaseFormat::kCompute) {
      const LinkBalance link = link_balance(spec, l, p.saved_blocks);
      p.link_hide_tokens = link.hide_tokens;
      p.why.push_back(link_line(l, link));
    }
  }
  return p;
}

// A model whose whole layers do not fit (two cache units of a layer with
// its fp32 gradients exceed the device: a 175B-class layer is 12 GiB, a
// Qwen3-235B-A22B layer with its 128 experts 13.9 GiB) may fit with its
// layers cut into sub-layer pieces (EngineConfig::mlp_pieces), unless the
// limits name a count: the fewest MLP slices (groups of experts) that fit,
// so that each visit moves as much as it can (the count doubles from 2; one
// the optimizer state's groups or the experts cannot cut is skipped). None
// is tried once what the device needs besides its units (activations, which
// more pieces never shrink, and working memory) is more than it has.
Plan cut_into_sub_layer_pieces(const ModelSpec& model, const PlanLimits& l, Plan whole) {
  if (whole.feasible || !whole.device_short || l.mlp_pieces != 0 || l.expert_pieces != 0 || !l.lora.empty())
    return whole;
  for (int64_t n = 2; n <= 64 && whole.device_rest_bytes < l.device_bytes; n *= 2) {
    PlanLimits cut = l;
    cut.mlp_pieces = n;
    Plan p;
    try {
      p = make_as_given(model, cut);
    } catch (const Error&) {
      continue;  // mlp_slice_ranges or expert_group_ranges refused this count (q8's groups, the experts)
    }
    if (!p.feasible && p.device_short && p.device_rest_bytes >= l.device_bytes) break;
    if (!p.feasible) continue;
    p.why.push_back(fmt::format("sub-layer pieces: each layer's attention half and {} {} are visits of their own "
                                "(chosen: with whole layers the plan {})", n,
                                model.sparse_layer_count() == 0               ? "slices of its MLP"
                                : model.sparse_layer_count() == model.layers ? "groups of its experts"
                                                                                  : "groups of its experts (slices of a dense MLP)",
                                whole.reason));
    return p;
  }
  return whole;
}
}  // namespace

// A mixture of experts that does not fit with its layers whole in their
// pieces (a gradient ring slot, the NVMe staging and a spill each hold a
// layer's) may fit with its experts cut into pieces of their own
// (EngineConfig::expert_pieces), unless the limits name a size: one expert
// per piece, which needs the least RAM and so leaves the most of it to
// optimizer state. Whole layers come first, with layers' compute copies on
// NVMe where the state's alone is not enough: this search counts bytes; with
// a prediction, fastest_expert_pieces (plan_speed.cpp) compares sizes by speed.
Plan Plan::make(const ModelSpec& model, const PlanLimits& l) {
  const PlacementMemo memo;  // its search places one model many times
  Plan whole = make_as_given(model, l);
  if (whole.feasible) return whole;
  if (whole.device_short || model.sparse_layer_count() == 0)
    return cut_into_sub_layer_pieces(model, l, std::move(whole));
  if (l.expert_pieces != 0) return whole;
  PlanLimits cut = l;
  cut.expert_pieces = 1;
  Plan p = make_as_given(model, cut);
  if (!p.feasible) return whole;
  p.why.push_back(fmt::format("expert pieces: one expert per piece (chosen: with whole layers the plan {})",
                              whole.reason));
  return p;
}

}  // namespace strider
