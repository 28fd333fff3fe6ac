// The engine's device pass (docs/design.md, "One training step", steps 1-3): the
// batch upload, the device executor (run_pass walks the program's device
// operations; device_ops.cpp handles each kind), and what its operations
// share: each visit's H2D into a unit, the views over units and
// micro-batches, and the gradients' D2H into host staging (their own buffer
// or the gradient ring).
#include <algorithm>
#include <cstring>

#include "engine/model/batch_mask.h"
#include "engine/run/collectives.h"
#include "engine/run/engine_core.h"
#include "engine/run/sim_updater.h"
#include "host/error.h"

namespace strider {

at::Tensor EngineCore::act(const Seat& s, int64_t b, int64_t m) const {
  // b in 1..head: the input of block b (block 0's input is the ids).
  at::Tensor t = s.mb[size_t(m)].act[size_t(place_.input_set(b))];
  STRIDER_CHECK(t.defined(), "internal: {} holds no input of block {}", s.device->name(), b);
  return t;
}

at::Tensor EngineCore::handed(const Seat& s, const StepOp& op) const {
  const MicroBatch& x = s.mb[size_t(op.micro_batch)];
  const HandArgs& h = op.as<HandArgs>();
  switch (h.hand) {
    case Hand::kBlock: return h.grads ? x.grad_out : act(s, op.block, op.micro_batch);
    case Hand::kHeadState: return x.head_state;
    case Hand::kLse: return x.lse_coef.defined() ? x.lse_coef : x.head_lse;  // an objective's coefficients too
    case Hand::kHeadGrad: return x.grad_h;
  }
  return {};
}

at::Tensor EngineCore::params_view(const Seat& s, const CacheUnit& u, size_t offset, size_t elems) const {
  return at::from_blob(static_cast<std::byte*>(u.params_bf16) + offset * place_.compute_bytes, {int64_t(elems)},
                       at::TensorOptions().dtype(compute_.dtype).device(s.aten));
}

at::Tensor EngineCore::grads_view(const Seat& s, const CacheUnit& u) const {
  return at::from_blob(u.grads_fp32, {int64_t(u.grad_capacity_elems)},
                       at::TensorOptions().dtype(at::kFloat).device(s.aten));
}

at::Tensor EngineCore::rows_view(const at::Tensor& flat, size_t offset, const Piece& rows) const {
  const int64_t H = spec_.dims.hidden;
  return flat.slice(0, int64_t(offset), int64_t(offset) + (rows.row_end - rows.row_begin) * H)
      .view({rows.row_end - rows.row_begin, H});
}

std::vector<int64_t> EngineCore::visit_segments(const StepOp& v) const {
  return place_.shards().visit_pieces(v.piece, v.shard);
}

at::Tensor EngineCore::kept_logits(const Seat& s, int64_t m, int64_t shard) const {
  const int64_t at = place_.head_column(shard);
  return s.mb[size_t(m)].logits.slice(1, at, at + place_.shard_rows(shard));
}

std::span<std::byte> EngineCore::saved_host(int64_t b, int64_t m) const {
  return saved_host_[size_t(m)][size_t(place_.saved_index[size_t(b)])];
}

void EngineCore::fetch_saved(Seat& s, int64_t b, int64_t m) {
  Device& dev = *s.device;
  const int slot = int(s.saved_uses++ % 2);
  dev.wait(StreamId::kH2D, *s.saved_free[size_t(slot)]);              // its last reader is done
  dev.wait(StreamId::kH2D, *saved_out_[size_t(place_.saved_index[size_t(b)])]);  // the forward's copy has landed
  dev.copy_h2d(StreamId::kH2D, s.saved_dev[size_t(slot)].data_ptr(), saved_host(b, m).data(), place_.saved_bytes,
               {"h2d activations", int32_t(b)});
  auto ready = dev.make_event();
  dev.record(*ready, StreamId::kH2D);
  s.saved_in.push_back({b, m, slot, std::move(ready)});
}

void EngineCore::upload_batch(const int64_t* ids, const int64_t* labels, const int64_t* positions,
                              const int64_t* attention) {
  for (Seat& st : seats_) st.data_ready->synchronize();  // the previous batch's copies have left the staging
  const size_t n = ids_host_.size();
  // Each micro-batch's documents (0: every row 0..seq-1), checked before anything changes.
  const int64_t M = place_.micro_batches, S = place_.seq;
  const size_t per_mb = n / size_t(M);
  std::vector<int64_t> longest(size_t(M), 0);
  // A refused batch changes nothing (BatchRefused): the caller may go on.
  try {
    if (positions != nullptr)
      for (int64_t m = 0; m < M; ++m) {
        longest[size_t(m)] = packed_longest({positions + size_t(m) * per_mb, per_mb}, S, size_t(m) * per_mb);
        STRIDER_CHECK(longest[size_t(m)] == 0 || takes_positions_,
                      "positions: micro-batch {} packs several documents in a row (positions that restart, or do not "
                      "count 0..seq-1), but the engine was made without packed_documents; set packed_documents "
                      "(--packed-documents) so that attention stays within each document", m);
      }
    for (size_t i = 0; i < n; ++i) {
      STRIDER_CHECK(ids[i] >= 0 && ids[i] < spec_.dims.vocab, "token id {} at position {} is outside the vocabulary [0, {})",
                    ids[i], i, spec_.dims.vocab);
      STRIDER_CHECK(labels[i] == -100 || (labels[i] >= 0 && labels[i] < spec_.dims.vocab),
                    "label {} at position {} is neither -100 nor a token id < {}", labels[i], i, spec_.dims.vocab);
    }
    if (attention != nullptr) check_attention_mask({attention, n}, {labels, n}, S);
  } catch (const Error& e) {
    throw BatchRefused(e.what());
  }
  batch_valid_ = 0;
  for (size_t i = 0; i < n; ++i) batch_valid_ += labels[i] != -100;
  // Every rank scales its loss by the global batch's count, so the ranks'
  // gradients sum to the global mean's.
  dist_->all_reduce_sum(std::span<int64_t>(&batch_valid_, 1));
  std::memcpy(ids_host_.data(), ids, n * 8);
  std::memcpy(labels_host_.data(), labels, n * 8);
  // Packed documents' positions go with every batch that has them (the same
  // bytes each step), whether or not one of its micro-batches packs.
  const bool packed = positions != nullptr && takes_positions_;
  if (packed) std::memcpy(positions_host_.data(), positions, n * 8);
  if (spec_.router_aux_coef > 0) count_router_rows(attention);
  const bool padded = std::any_of(router_rows_.padded.begin(), router_rows_.padded.end(), [](char p) { return p != 0; });
  for (Seat& st : seats_) {  // every device of a pool: the embedding needs the ids, the head the labels
    st.device->copy_h2d(StreamId::kH2D, st.ids.data_ptr(), ids_host_.data(), n * 8, {"h2d batch"});
    st.device->copy_h2d(StreamId::kH2D, st.labels.data_ptr(), labels_host_.data(), n * 8, {"h2d batch"});
    if (packed)  // the layers' attention needs them
      st.device->copy_h2d(StreamId::kH2D, st.positions.data_ptr(), positions_host_.data(), n * 8, {"h2d batch"});
    if (padded)  // the sparse layers' routing statistics need it
      st.device->copy_h2d(StreamId::kH2D, st.token_valid.data_ptr(), valid_host_.data(), n * 4, {"h2d batch"});
    for (int64_t m = 0; m < M; ++m) {
      MicroBatch& x = st.mb[size_t(m)];
      x.positions = longest[size_t(m)] > 0 ? BatchPositions{x.position_rows, longest[size_t(m)]} : BatchPositions{};
    }
    st.device->record(*st.data_ready, StreamId::kH2D);
    st.device->wait(StreamId::kCompute, *st.data_ready);
    if (st.moe_stats.defined()) {  // this batch's routing statistics start from 0, before its first forward
      at::Tensor stats = st.moe_stats;
      st.device->launch(StreamId::kCompute, {"routing statistics reset", -1, 0.0},
                        [stats](const LaunchContext&) { stats.zero_(); });
    }
  }
}

void EngineCore::upload_objective(const ObjectiveInputs& in) {
  // After upload_batch, which waited for the previous batch's copies to leave the staging.
  const int64_t B = place_.batch(), S = place_.seq;
  float* row = objective_host_.data();
  float* old = row + B;
  float* ref = old + B * S;
  std::fill(objective_host_.begin(), objective_host_.end(), 0.0f);
  if (in.row) std::copy(in.row, in.row + in.rows, row);
  if (in.old_logps) std::copy(in.old_logps, in.old_logps + in.rows * S, old);
  if (in.ref_logps) std::copy(in.ref_logps, in.ref_logps + in.rows * S, ref);
  Seat& st = seats_[size_t(place_.last_head_device())];
  st.device->copy_h2d(StreamId::kH2D, st.objective_in.data_ptr(), objective_host_.data(), objective_host_.size_bytes(),
                      {"h2d objective inputs"});
  st.device->record(*st.data_ready, StreamId::kH2D);
  st.device->wait(StreamId::kCompute, *st.data_ready);
  at::Tensor all = st.objective_in;
  ObjectiveBatch& b = objective_batch_;
  b.row = all.slice(0, 0, B);
  b.old_logp = in.old_logps ? all.slice(0, B, B + B * S).view({B, S}) : at::Tensor();
  b.ref_logp = in.ref_logps ? all.slice(0, B + B * S, B + 2 * B * S).view({B, S}) : at::Tensor();
  b.rows = in.rows;
  b.rank_share = 1.0 / double(dist_->ranks().world);
  b.global_tokens = double(batch_valid_);  // over every rank (upload_batch)
}

void EngineCore::count_router_rows(const int64_t* attention) {
  const size_t n = ids_host_.size();
  router_rows_ = strider::count_router_rows(attention ? std::span<const int64_t>(attention, n)
                                                      : std::span<const int64_t>(),
                                            n, place_.micro_batches, spec_.sparse_layer_count());
  if (attention != nullptr)
    for (size_t i = 0; i < n; ++i) valid_host_[i] = float(attention[i]);
  // A micro-batch of padding only has no load-balancing loss (transformers'
  // 0/0); the mean is over the others, every rank's (rank order: the same
  // bits on every rank).
  dist_->all_reduce_sum(std::span<double>(&router_rows_.with_inputs, 1));
}

void EngineCore::read_compute(const StepOp& r) {
  ComputeSlot& slot = compute_slots_[size_t(r.as<SlotArgs>().slot)];
  const int d = r.device;
  std::vector<int64_t> mine;  // the visit's pieces whose compute copy is on NVMe
  uint64_t bytes = 0;
  for (int64_t p : visit_segments(r))
    if (compute_on_nvme(p)) {
      mine.push_back(p);
      bytes += piece(p).elems() * place_.compute_bytes;
    }
  host_->read_compute(slot, mine, bytes, r, *seats_[size_t(d)].device);
}

void EngineCore::load_visit(const StepOp& v, const std::vector<UnitRun>& layout) {
  const std::vector<int64_t> segs = visit_segments(v);
  Seat& st = seat(v);
  Device& dev = *st.device;
  for (int64_t p : segs)  // the kept reference copy waits for no update of the compute copy
    if (updates(p) && !(reference_pass_ && !store_->block(size_t(piece(p).block)).reference.empty()))
      host_->after_update(p, dev);
  if (const int k = v.as<SlotArgs>().slot; k >= 0) {
    ComputeSlot& slot = compute_slots_[size_t(k)];
    STRIDER_CHECK(slot.block == v.block, "internal: visit {} loads block {} from compute staging slot {}, which "
                  "holds block {}", v.visit, v.block, k, slot.block);
    host_->await_compute(slot, v, dev);
  }
  const CacheUnit& u = st.pool->acquire(StreamId::kH2D);
  // Each range from the block's compute copy to its place in the unit
  // (StepProgram::layouts), ranges adjacent in both as one copy; or, where
  // the compute copy lives on NVMe, range by range from the load staging its
  // read filled (each piece there in its own coordinates).
  for (size_t i = 0; i < layout.size();) {
    const UnitRun& r = layout[i];
    const int64_t block = piece(r.piece).block;
    const size_t unit_at = r.unit_at, from = r.run.block;
    const bool quantized = piece(r.piece).quantized;
    std::byte* to = static_cast<std::byte*>(u.params_bf16) + unit_at * place_.compute_bytes;
    const BlockState& s = store_->block(size_t(block));
    // A reference pass in full training streams the kept starting weights instead.
    const bool reference = reference_pass_ && !s.reference.empty();
    if (!s.compute_on_host) {
      // The piece's runs adjacent in its coordinates (the staging's) and in
      // the unit go as one copy: a sub-layer MLP slice's rows of down_proj.
      const std::byte* src = compute_slots_[size_t(v.as<SlotArgs>().slot)].bytes.data() + place_.at(r.piece).compute_staging_at +
                             r.run.at * place_.compute_bytes;
      size_t n = r.run.n;
      for (++i; i < layout.size() && layout[i].piece == r.piece && layout[i].unit_at == unit_at + n &&
                layout[i].run.at == r.run.at + n;
           ++i)
        n += layout[i].run.n;
      dev.copy_h2d(StreamId::kH2D, to, src, n * place_.compute_bytes, {"h2d params", int32_t(block)});
      continue;
    }
    size_t n = r.run.n;
    for (++i; !quantized && i < layout.size() && piece(layout[i].piece).block == block &&
              !piece(layout[i].piece).quantized && layout[i].unit_at == unit_at + n && layout[i].run.block == from + n;
         ++i)
      n += layout[i].run.n;
    if (quantized) {  // its base bytes, dequantized by the visit's first operation
      STRIDER_CHECK(u.staging_bytes >= s.base.size(), "internal: {} base bytes of block {} and {} of unit staging",
                    s.base.size(), block, u.staging_bytes);
      dev.copy_h2d(StreamId::kH2D, u.staging, s.base.data(), s.base.size(), {"h2d base", int32_t(block)});
      continue;
    }
    // Runs of one piece as long as this one, back to back in the unit and a
    // fixed stride apart in the block (a sub-layer MLP slice's columns of
    // down_proj, one run per row), go as one copy of rows.
    size_t rows = 1, stride = 0;
    if (n == r.run.n)
      for (; i < layout.size() && layout[i].piece == r.piece && layout[i].run.n == n &&
             layout[i].unit_at == unit_at + rows * n && layout[i].run.block > from + n &&
             (rows == 1 || layout[i].run.block == from + rows * stride);
           ++i, ++rows)
        if (rows == 1) stride = layout[i].run.block - from;
    if (rows > 1) {
      auto bytes = reference ? s.reference_range(from, stride * (rows - 1) + n)
                             : s.compute_range(from, stride * (rows - 1) + n);
      dev.copy_h2d_rows(StreamId::kH2D, to, n * place_.compute_bytes, bytes.data(), stride * place_.compute_bytes,
                        n * place_.compute_bytes, rows, {"h2d params", int32_t(block)});
      continue;
    }
    auto bytes = reference ? s.reference_range(from, n) : s.compute_range(from, n);
    dev.copy_h2d(StreamId::kH2D, to, bytes.data(), bytes.size(), {"h2d params", int32_t(block)});
  }
  if (v.as<SlotArgs>().slot >= 0) {  // the slot may be read into again once these copies are done
    ComputeSlot& slot = compute_slots_[size_t(v.as<SlotArgs>().slot)];
    dev.record(*slot.copied[size_t(v.device)], StreamId::kH2D);
    slot.copied_on = v.device;
  }
  auto ready = dev.make_event();
  dev.record(*ready, StreamId::kH2D);
  loaded_[size_t(v.visit)] = {&u, std::move(ready), &layout, place_.shards().grad_base(layout)};
}

const std::byte* EngineCore::grads_to_send(Seat& s, const CacheUnit& u, size_t elems, int64_t block) {
  const std::byte* out = reinterpret_cast<const std::byte*>(u.grads_fp32);
  if (place_.grad_bytes == 2) {
    at::Tensor acc = grads_view(s, u).slice(0, 0, int64_t(elems));
    at::Tensor dst = at::from_blob(u.params_bf16, {int64_t(elems)},
                                   at::TensorOptions().dtype(at::kBFloat16).device(s.aten));
    s.device->launch(StreamId::kCompute, {"grads to bf16", int32_t(block), 0.0},
                     [acc, dst](const LaunchContext&) { dst.copy_(acc); });
    out = static_cast<const std::byte*>(u.params_bf16);
  }
  stream_after(s, StreamId::kD2H, StreamId::kCompute);
  return out;
}

void EngineCore::stream_after(Seat& s, StreamId waiter, StreamId done) {
  Event& e = *s.mark[int(done)];
  s.device->record(e, done);
  s.device->wait(waiter, e);
}

std::span<std::byte> EngineCore::grad_host(int64_t p) {
  const int r = place_.at(p).ring_slot;
  if (r >= 0) return grad_ring_[size_t(r)];
  const Piece& pc = piece(p);
  return store_->block(size_t(pc.block)).grad.subspan(place_.at(p).staging_at * place_.grad_bytes,
                                                      pc.elems() * place_.grad_bytes);
}

void EngineCore::copy_grads_out(int64_t p, const StepOp& visit, const std::byte* src) {
  Device& dev = *seat(visit).device;
  const int r = place_.at(p).ring_slot;
  if (r >= 0) {
    // The slot's n-th use waits for n consumptions: the previous gradients in
    // it were updated with (or spilled to NVMe). The updater gets there on its
    // own, from gradients already enqueued, so waiting here cannot deadlock.
    host_->after_ring(r, ring_uses_[size_t(r)]++, dev);
  }
  // Each of its ranges from its place in the unit to the piece's coordinates on the host.
  std::byte* host = grad_host(p).data();
  for (const UnitRun& u : *loaded_[size_t(visit.visit)].layout)
    if (u.piece == p)
      dev.copy_d2h(StreamId::kD2H, host + u.run.at * place_.grad_bytes, src + (u.unit_at - grad_base(visit)) * place_.grad_bytes,
                   u.run.n * place_.grad_bytes, {"d2h grads", int32_t(piece(p).block)});
  dev.record(*grads_ready_[size_t(p)], StreamId::kD2H);
  host_->landed(p, *grads_ready_[size_t(p)]);
}

EngineCore::Moved EngineCore::collect_device_spans() {
  Moved moved;
  for (int d = 0; d < int(seats_.size()); ++d) {
    const Seat& st = seats_[size_t(d)];
    std::vector<OpSpan> spans;
    st.device->drain_spans(spans);
    for (const OpSpan& o : spans) {
      Lane lane = o.stream == StreamId::kCompute ? Lane::kCompute : o.stream == StreamId::kH2D ? Lane::kH2D : Lane::kD2H;
      // A pool's hand-offs (device_ops.cpp, hand_name) have a lane of their own.
      if (std::string_view(o.tag.name).find("hand-off") != std::string_view::npos) lane = Lane::kHandOff;
      Span sp{lane, o.tag.name, o.tag.block, -1, steps_, o.begin_us + st.origin_us, o.end_us + st.origin_us,
              o.tag.flops, o.tag.bytes, o.work_peak_bytes};
      sp.device = seats_.size() > 1 ? d : -1;
      timeline_.add(std::move(sp));
      if (o.kind == OpKind::kCopyH2D) moved.h2d_bytes += o.tag.bytes;
      if (o.kind == OpKind::kCopyD2H) moved.d2h_bytes += o.tag.bytes;
    }
  }
  return moved;
}

void EngineCore::synchronize_devices(StreamId s) {
  for (Seat& st : seats_) st.device->synchronize(s);
}

void EngineCore::run_pass(const StepProgram& program, int64_t fault_op) {
  for (Seat& st : seats_) {
    st.device->prepare_driver_thread();
    st.saved_in.clear();  // a pass that threw left nothing to wait for in order
  }
  loaded_.clear();
  loaded_.resize(size_t(program.visits));
  PassCursor at;
  at.program = &program;
  for (size_t i = 0; i < program.ops.size(); ++i) {
    const StepOp& op = program.ops[i];
    if (!op.on_device()) continue;
    if (int64_t(i) == fault_op)  // as a failed launch or copy would (settle_after_failure's tests)
      throw Error(fmt::format("injected device fault: {} of block {}", op_name(op.kind), op.block));
    // A visit's first operation waits on the compute stream for its load.
    if (op.first_of_visit) seat(op).device->wait(StreamId::kCompute, *loaded_[size_t(op.visit)].ready);
    run_device_op(op, at);
  }
}

}  // namespace strider
