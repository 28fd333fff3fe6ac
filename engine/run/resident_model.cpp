#include "engine/run/resident_model.h"

#include <fmt/ranges.h>

#include "engine/model/batch_mask.h"
#include "host/error.h"

namespace strider {

ResidentModel::ResidentModel(ModelSpec spec, ComputeOptions options, at::Device device)
    : spec_(std::move(spec)), options_(options), device_(device) {
  for (int64_t b = 0; b < spec_.num_blocks(); ++b) {
    layouts_.push_back(spec_.layout(b));
    const int64_t n = int64_t(layouts_.back().total_elems());
    params_.push_back(at::zeros({n}, at::TensorOptions().dtype(options_.dtype).device(device_)));
    grads_.push_back(at::zeros({n}, at::TensorOptions().dtype(at::kFloat).device(device_)));
  }
}

std::pair<int64_t, const TensorSlot*> ResidentModel::locate(const std::string& name) const {
  for (int64_t b = 0; b < spec_.num_blocks(); ++b)
    if (const TensorSlot* s = layouts_[b].find(name)) return {b, s};
  throw Error(fmt::format("{} has no parameter '{}'", spec_.arch_name, name));
}

void ResidentModel::set_param(const std::string& name, const at::Tensor& tensor) {
  auto [b, s] = locate(name);
  STRIDER_CHECK(tensor.sizes().vec() == s->shape, "parameter '{}': shape {} given, the model needs {}",
                name, fmt::join(tensor.sizes(), "x"), fmt::join(s->shape, "x"));
  param(name).copy_(tensor);
}

at::Tensor ResidentModel::param(const std::string& name) const {
  auto [b, s] = locate(name);
  return params_[b].slice(0, int64_t(s->offset_elems), int64_t(s->offset_elems + s->numel)).view(s->shape);
}

at::Tensor ResidentModel::grad(const std::string& name) const {
  auto [b, s] = locate(name);
  return grads_[b].slice(0, int64_t(s->offset_elems), int64_t(s->offset_elems + s->numel)).view(s->shape);
}

std::vector<at::Tensor> ResidentModel::routing(const at::Tensor& input_ids) {
  STRIDER_CHECK(input_ids.dim() == 2, "input_ids must be [batch, seq]; got {}", fmt::join(input_ids.sizes(), "x"));
  BlockRunner run(spec_, options_, input_ids.size(1), device_);
  const BatchPositions pos;
  std::vector<at::Tensor> out;
  at::Tensor x = input_ids.to(device_);
  for (int64_t b = 0; b + 1 < spec_.num_blocks(); ++b) {
    std::vector<at::Tensor> tiles;
    MoeStep st;
    if (b > 0 && spec_.sparse(b - 1)) st.routes = &tiles;
    x = run.forward(b, params_[b], x, {}, &pos, &st);
    if (!tiles.empty()) out.push_back(at::cat(tiles, 0));
  }
  return out;
}

std::vector<std::string> ResidentModel::param_names() const {
  std::vector<std::string> out;
  for (const auto& l : layouts_)
    for (const auto& s : l.slots()) out.push_back(s.name);
  return out;
}

StepLoss ResidentModel::forward_backward(const at::Tensor& input_ids, const at::Tensor& labels,
                                         int64_t micro_batches, bool keep_outputs, const at::Tensor& positions,
                                         const at::Tensor& attention_mask) {
  STRIDER_CHECK(input_ids.dim() == 2 && labels.sizes() == input_ids.sizes(),
                "input_ids and labels must both be [batch, seq]; got {} and {}",
                fmt::join(input_ids.sizes(), "x"), fmt::join(labels.sizes(), "x"));
  const int64_t batch = input_ids.size(0), seq = input_ids.size(1);
  STRIDER_CHECK(micro_batches >= 1 && batch % micro_batches == 0,
                "batch {} does not split into {} micro-batches", batch, micro_batches);
  BlockRunner run(spec_, options_, seq, device_);
  const int64_t nb = spec_.num_blocks(), head = nb - 1;
  std::vector<at::Tensor> ids = input_ids.to(device_).chunk(micro_batches, 0);
  std::vector<at::Tensor> labs = labels.to(device_).chunk(micro_batches, 0);
  // Each micro-batch's documents, as the engine finds them (packed_longest).
  std::vector<BatchPositions> pos(static_cast<size_t>(micro_batches));
  if (positions.defined()) {
    STRIDER_CHECK(positions.sizes() == input_ids.sizes() && positions.scalar_type() == at::kLong,
                  "positions must be int64 [batch, seq] as input_ids");
    const at::Tensor host = positions.cpu().contiguous();
    const std::vector<at::Tensor> rows = host.chunk(micro_batches, 0);
    for (int64_t m = 0; m < micro_batches; ++m) {
      const int64_t longest = packed_longest({rows[m].data_ptr<int64_t>(), size_t(rows[m].numel())}, seq);
      if (longest > 0) pos[m] = {rows[m].to(device_), longest};
    }
  }
  for (auto& g : grads_) g.zero_();

  // The loss is a mean over the whole batch's valid tokens, so count them first.
  const int64_t valid = (labels != -100).sum().item<int64_t>();
  STRIDER_CHECK(valid > 0, "the batch has no label other than -100: nothing to train on");

  // The load-balancing loss (docs/moe.md, "How the engine runs them"): each
  // micro-batch's routing statistics over its sparse layers, then each
  // sparse layer's backward adds its gradient, a mean over the micro-batches.
  const bool aux = spec_.router_aux_coef > 0;
  const at::Tensor stats = aux ? at::zeros({micro_batches, 2, spec_.dims.moe.experts},
                                           at::TensorOptions().dtype(at::kFloat).device(device_))
                               : at::Tensor();
  // With padding, a micro-batch's rows count its input tokens, and one of
  // padding only has no such loss: the mean is over the others.
  std::vector<at::Tensor> token_valid(static_cast<size_t>(micro_batches));
  RouterRows rows = count_router_rows({}, size_t(batch * seq), micro_batches, spec_.sparse_layer_count());
  if (attention_mask.defined()) {  // checked as the engine checks it
    STRIDER_CHECK(attention_mask.sizes() == input_ids.sizes(), "attention_mask must be [batch, seq] as input_ids");
    const at::Tensor mask = attention_mask.to(at::kCPU, at::kLong).contiguous();
    const at::Tensor lab = labels.to(at::kCPU, at::kLong).contiguous();
    const std::span<const int64_t> m01(mask.data_ptr<int64_t>(), size_t(mask.numel()));
    check_attention_mask(m01, {lab.data_ptr<int64_t>(), m01.size()}, seq);
    if (aux) {
      rows = count_router_rows(m01, m01.size(), micro_batches, spec_.sparse_layer_count());
      const std::vector<at::Tensor> chunks = mask.to(at::kFloat).chunk(micro_batches, 0);
      for (int64_t m = 0; m < micro_batches; ++m)
        if (rows.padded[size_t(m)]) token_valid[size_t(m)] = chunks[m].reshape({-1}).to(device_);
    }
  }
  const double aux_batches = rows.with_inputs;
  auto moe = [&](int64_t b, int64_t m, bool backward) {
    MoeStep st;
    if (!aux || b == 0 || b == head || !spec_.sparse(b - 1)) return st;
    st.stats = stats[m];
    st.valid = token_valid[size_t(m)];
    if (backward && aux_batches > 0)
      st.aux_scale = spec_.router_aux_coef / aux_batches, st.rows = rows.rows[size_t(m)];
    return st;
  };

  // Forward, block-major; inputs[b][m] is block b's input for micro-batch m.
  std::vector<std::vector<at::Tensor>> inputs(nb);
  inputs[0] = ids;
  for (int64_t b = 0; b < head; ++b)
    for (int64_t m = 0; m < micro_batches; ++m) {
      const MoeStep st = moe(b, m, false);
      inputs[b + 1].push_back(run.forward(b, params_[b], inputs[b][m], {}, &pos[m], &st));
    }

  StepLoss out;
  const at::Tensor tied_p = spec_.tie_embeddings ? params_[0] : at::Tensor();
  const at::Tensor tied_g = spec_.tie_embeddings ? grads_[0] : at::Tensor();
  std::vector<at::Tensor> grad_out(micro_batches);
  double loss_sum = 0;
  for (int64_t m = 0; m < micro_batches; ++m) {
    HeadResult r = run.head_backward(params_[head], grads_[head], tied_p, tied_g, inputs[head][m],
                                     labs[m], 1.0 / double(valid));
    loss_sum += r.loss_sum;
    grad_out[m] = r.grad_input;
  }
  for (int64_t b = head - 1; b >= 0; --b)
    for (int64_t m = 0; m < micro_batches; ++m) {
      const MoeStep st = moe(b, m, true);
      grad_out[m] = run.backward(b, params_[b], inputs[b][m], grad_out[m], grads_[b], {}, 0, &pos[m], &st);
    }

  out.loss = loss_sum / double(valid);
  for (int64_t m = 0; aux && aux_batches > 0 && m < micro_batches; ++m)
    out.loss += spec_.router_aux_coef / aux_batches * moe_aux_loss(stats[m], rows.rows[size_t(m)]).item<double>();
  out.valid_tokens = valid;
  if (keep_outputs)
    for (int64_t b = 1; b <= head; ++b) out.block_outputs.push_back(at::cat(inputs[b], 0));
  return out;
}

}  // namespace strider
