// EngineCore::allocate_activations: a device's buffers beyond its cache
// units, allocated once, exactly what placement.cpp's count_device counts.
#include <ATen/ATen.h>

#include "engine/run/engine_core.h"
#include "gpu/blocks/blocks.h"  // layer_saved_elems

namespace strider {

void EngineCore::allocate_activations(int d) {
  // What placement.cpp's count_device counts for device d, allocated once.
  Seat& st = seats_[size_t(d)];
  const int64_t M = place_.micro_batches, mb = place_.micro_batch, S = place_.seq, H = spec_.dims.hidden;
  const int64_t head = place_.head;
  const bool runs_head = place_.runs_head(d);
  const auto cdt = compute_.dtype;
  auto make = [&](std::vector<int64_t> shape, at::ScalarType dt, const char* what) {
    size_t n = 1;
    for (int64_t x : shape) n *= size_t(x);
    st.buffers.push_back(st.device->allocate((n * c10::elementSize(dt) + 255) / 256 * 256, what));
    return at::from_blob(st.buffers.back().data(), shape, at::TensorOptions().dtype(dt).device(st.aten));
  };
  st.ids = make({place_.batch(), S}, at::kLong, "batch ids");
  if (runs_head) st.head_stats = make({2, M}, at::kDouble, "head loss figures");
  if (spec_.router_aux_coef > 0) {
    st.moe_stats = make({M, 2, spec_.dims.moe.experts}, at::kFloat, "routing statistics");
    st.token_valid = make({place_.batch() * S}, at::kFloat, "batch attention mask");
  }
  st.labels = make({place_.batch(), S}, at::kLong, "batch labels");
  if (takes_positions_) st.positions = make({place_.batch(), S}, at::kLong, "batch positions");
  st.mb.resize(size_t(M));
  for (int64_t m = 0; m < M; ++m) {
    MicroBatch& x = st.mb[size_t(m)];
    x.ids = st.ids.chunk(M, 0)[m];
    if (takes_positions_) x.position_rows = st.positions.chunk(M, 0)[m];
    x.labels = st.labels.chunk(M, 0)[m].reshape({-1});
    if (st.token_valid.defined()) x.valid = st.token_valid.chunk(M, 0)[m];
    if (!runs_head) continue;
    x.loss_sum = st.head_stats[0][m];
    x.valid_tokens = st.head_stats[1][m];
  }
  // Checkpoints on the device: the inputs of the blocks it runs or writes
  // (every block's, on one device) for every micro-batch. On the host: a
  // ring of two sets on the device, the checkpoints copied out.
  for (int64_t i = 0; i < place_.input_sets(); ++i)
    for (int64_t m = 0; m < M; ++m)
      st.mb[size_t(m)].act.push_back(place_.input_ring || place_.holds_input(d, i + 1)
                                         ? make({mb, S, H}, cdt, "activations")
                                         : at::Tensor());
  for (int64_t m = 0; m < M; ++m) st.mb[size_t(m)].grad_out = make({mb, S, H}, cdt, "output gradients");
  if (place_.cut_layers(d) > 0)
    for (int64_t m = 0; m < M; ++m) {
      MicroBatch& x = st.mb[size_t(m)];
      x.cut_x1 = make({mb, S, H}, cdt, "sub-layer pieces' residual stream");
      x.cut_h2 = make({mb, S, H}, cdt, "sub-layer pieces' MLP input");
      // With a shared expert, its output in the compute dtype after the groups' sum (block_runner.cpp).
      x.cut_sum = make({mb, S, H * (spec_.dims.moe.shared_intermediate > 0 ? 2 : 1)}, at::kFloat,
                       "sub-layer pieces' fp32 sum");
      if (spec_.sparse_layer_count() == 0) continue;
      const int64_t k = spec_.dims.moe.top_k;
      x.cut_top = make({mb * S, k}, at::kLong, "groups of experts' routing");
      x.cut_scores = make({mb * S, k}, at::kFloat, "groups of experts' routing weights");
      x.cut_dscores = make({mb * S * k}, at::kFloat, "groups of experts' routing-weight gradients");
    }
  if (runs_head)
    for (int64_t m = 0; m < M; ++m) {
      MicroBatch& x = st.mb[size_t(m)];
      x.head_state = make({3, mb * S}, at::kFloat, "head running max, sum and target logits");
      x.head = {x.head_state[0], x.head_state[1], x.head_state[2]};
      if (objective_.sft()) {
        x.head_lse = make({mb * S}, at::kFloat, "head log-sum-exp");
      } else {  // the objective's coefficients beside it: one hand-off carries both (Hand::kLse)
        x.lse_coef = make({2, mb * S}, at::kFloat, "head log-sum-exp and objective coefficients");
        x.head_lse = x.lse_coef[0];
        x.coef = x.lse_coef[1];
      }
      st.mb[size_t(m)].grad_h = make({mb * S, H}, at::kFloat, "head hidden gradient");
    }
  if (!objective_.sft() && d == place_.last_head_device()) {
    st.objective_in = make({int64_t(objective_in_elems(place_.batch(), S))}, at::kFloat, "objective inputs");
    st.objective_stats = make({kObjectiveStats}, at::kDouble, "objective figures");
  }
  for (int s = 0; s < 2; ++s) st.ring_free.push_back(st.device->make_event());
  if (keeps_logits(program_, d) && runs_head)
    for (int64_t m = 0; m < M; ++m) st.mb[size_t(m)].logits = make({mb * S, place_.head_rows(d)}, cdt, "kept logits");
  if (place_.runs_kept_layer(d)) {
    const int64_t elems = layer_saved_elems(spec_.saved_dims(), mb * S, int64_t(place_.compute_bytes));
    for (int s = 0; s < 2; ++s) {
      st.saved_dev.push_back(make({elems}, cdt, "kept activations"));
      st.saved_free.push_back(st.device->make_event());
    }
  }
}

}  // namespace strider
