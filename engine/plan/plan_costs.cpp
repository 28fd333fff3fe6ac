// The plan's cost models in seconds at PlanLimits' machine rates: kept
// activations against recompute for one layer (activation_cost), and a step's
// compute against its compute copies' traffic on the link (link_balance).
#include <algorithm>
#include <cmath>

#include "engine/plan/plan.h"
#include "host/error.h"

namespace strider {

ActivationCost activation_cost(const ModelSpec& spec, const PlanLimits& l, uint64_t saved_bytes_per_layer) {
  STRIDER_CHECK(l.compute_flops_per_s > 0 && l.copy_bytes_per_s() > 0, "plan: compute rate {} FLOP/s and copy rate {} "
                "bytes/s must be > 0", l.compute_flops_per_s, l.copy_bytes_per_s());
  ActivationCost c;
  const int cbytes = l.dtype == at::kFloat ? 4 : 2;
  const double m = double(l.accumulation);
  const int64_t widest = spec.largest_layer_block();
  const BlockCost layer = spec.cost(widest, l.micro_batch, l.seq, l.vocab_chunk, cbytes, 0, l.work, l.packed_documents);
  c.forward_flops = layer.forward_flops * m;
  c.backward_flops = layer.backward_flops * m;
  c.recompute_flops = layer.backward_recompute_flops * m;
  c.param_bytes = uint64_t(spec.layout(widest).total_elems()) * uint64_t(cbytes);
  c.saved_bytes = saved_bytes_per_layer;
  const double f = c.forward_flops / l.compute_flops_per_s, b = c.backward_flops / l.compute_flops_per_s,
               r = c.recompute_flops / l.compute_flops_per_s;
  // A pool's devices share the host's memory bus: the copies of each go at its share (copy_bytes_per_s).
  const double link = l.copy_bytes_per_s();
  const double p = double(c.param_bytes) / link, s = double(c.saved_bytes) / link;
  c.recompute_s = std::max(f, p) + std::max(f + b, p);
  c.saved_s = std::max({f, p, s}) + std::max(b + r, p + s);
  return c;
}

LinkBalance link_balance(const ModelSpec& spec, const PlanLimits& l, const std::vector<int64_t>& saved_blocks) {
  const int cbytes = l.dtype == at::kFloat ? 4 : 2;
  LinkBalance out;
  double flops = 0;
  for (int64_t b = 0; b < spec.num_blocks(); ++b) {
    const BlockCost c = spec.cost(b, l.micro_batch, l.seq, l.vocab_chunk, cbytes, 0, l.work, l.packed_documents);
    const bool kept = std::find(saved_blocks.begin(), saved_blocks.end(), b) != saved_blocks.end();
    flops += c.forward_flops + c.backward_flops + (kept ? c.backward_recompute_flops : c.forward_flops);
    out.bytes += 2 * uint64_t(spec.layout(b).total_elems()) * uint64_t(cbytes);
  }
  out.tokens = l.seq * l.micro_batch * l.accumulation;
  out.compute_s = flops * double(l.accumulation) / l.compute_flops_per_s;
  out.link_s = double(out.bytes) / l.link_bytes_per_s;
  out.hide_tokens = int64_t(std::ceil(double(out.tokens) * out.link_s / out.compute_s));
  return out;
}

}  // namespace strider
