// The engine's device pass (DESIGN.md, "One training step", steps 1-3): the
// batch upload, each block visit's H2D (K-1 visits ahead), forward, head and
// backward on the compute stream, checkpoints and gradients out on the d2h
// stream into host staging (their own buffer or the gradient ring).
#include <cstring>

#include "engine/engine.h"
#include "engine/collectives.h"
#include "engine/plan.h"  // attention_core_flops
#include "engine/sim_updater.h"
#include "host/error.h"

namespace strider {

at::Tensor Engine::act(int64_t b, int64_t m) const {
  // b in 1..head: the input of block b (block 0's input is the ids).
  const int64_t set = config_.checkpoints_on_host ? (b % 2) : (b - 1);
  return mb_[size_t(m)].act[size_t(set)];
}

at::Tensor Engine::params_view(const CacheUnit& u, size_t offset, size_t elems) const {
  return at::from_blob(static_cast<std::byte*>(u.params_bf16) + offset * place_.compute_bytes, {int64_t(elems)},
                       at::TensorOptions().dtype(config_.compute.dtype).device(aten_device_));
}

at::Tensor Engine::grads_view(const CacheUnit& u) const {
  return at::from_blob(u.grads_fp32, {int64_t(u.capacity_elems)},
                       at::TensorOptions().dtype(at::kFloat).device(aten_device_));
}

at::Tensor Engine::rows_view(const at::Tensor& flat, size_t offset, const Piece& rows) const {
  const int64_t H = spec_.dims.hidden;
  return flat.slice(0, int64_t(offset), int64_t(offset) + (rows.row_end - rows.row_begin) * H)
      .view({rows.row_end - rows.row_begin, H});
}

std::vector<int64_t> Engine::visit_segments(const StepOp& v) const {
  if (v.shard < 0) return {v.piece};
  return {place_.shards.norm_piece, place_.shards.lm_piece[size_t(v.shard)]};
}

double Engine::visit_flops(const StepOp& v, bool train) const {
  const double tokens = double(config_.micro_batch * config_.seq), H = double(spec_.dims.hidden);
  if (v.kind == StepOpKind::kHead) {
    const Piece& rows = piece(place_.shards.lm_piece[size_t(v.shard)]);
    const double logits = 2.0 * tokens * H * double(rows.row_end - rows.row_begin);
    // Pass 1: the logits; pass 2: the logits again and both gradients.
    // With kept logits, pass 2 computes only the two gradients.
    return (v.lse ? logits : 0.0) + (v.grad && train ? (config_.keep_logits ? 2.0 : 3.0) * logits : 0.0);
  }
  const int64_t b = piece(v.piece).block;
  if (spec_.block(b).kind != BlockKind::kLayer) return 0;  // an embedding shard: a gather or a scatter
  const BlockCost c = spec_.cost(b, config_.micro_batch, config_.seq, config_.compute.vocab_chunk, int(place_.compute_bytes));
  if (v.kind == StepOpKind::kForward) return c.forward_flops;
  if (!keeps(b)) return c.backward_flops * 1.5;  // recompute + backward
  // Kept activations: backward, and the attention core recomputed.
  return c.backward_flops + attention_core_flops(spec_, config_.micro_batch, config_.seq);
}

at::Tensor Engine::kept_logits(int64_t m, const Piece& rows) const {
  return mb_[size_t(m)].logits.slice(1, rows.row_begin, rows.row_end);
}

std::span<std::byte> Engine::saved_host(int64_t b, int64_t m) const {
  return mb_[size_t(m)].saved_host[size_t(place_.saved_index[size_t(b)])];
}

void Engine::fetch_saved(int64_t b, int64_t m) {
  const int slot = int(saved_uses_++ % 2);
  device_->wait(StreamId::kH2D, *saved_free_[size_t(slot)]);              // its last reader is done
  device_->wait(StreamId::kH2D, *saved_out_[size_t(place_.saved_index[size_t(b)])]);  // the forward's copy has landed
  device_->copy_h2d(StreamId::kH2D, saved_dev_[size_t(slot)].data_ptr(), saved_host(b, m).data(), place_.saved_bytes,
                    {"h2d activations", int32_t(b)});
  auto ready = device_->make_event();
  device_->record(*ready, StreamId::kH2D);
  saved_in_.push_back({b, m, slot, std::move(ready)});
}

void Engine::wait_updated(int64_t p) {
  if (simulated()) return;  // ordered by the SimUpdater's events instead
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return updated_[size_t(p)] >= passes_ || updater_error_ || stopping_; });
  if (updater_error_) std::rethrow_exception(updater_error_);
}

void Engine::finish_updates() {
  for (int64_t p = 0; p < num_pieces(); ++p) wait_updated(p);
}

void Engine::upload_batch(const int64_t* ids, const int64_t* labels) {
  data_ready_->synchronize();  // the previous batch's copy has left the staging
  const size_t n = ids_host_.size();
  for (size_t i = 0; i < n; ++i) {
    STRIDER_CHECK(ids[i] >= 0 && ids[i] < spec_.dims.vocab, "token id {} at position {} is outside the vocabulary [0, {})",
                  ids[i], i, spec_.dims.vocab);
    STRIDER_CHECK(labels[i] == -100 || (labels[i] >= 0 && labels[i] < spec_.dims.vocab),
                  "label {} at position {} is neither -100 nor a token id < {}", labels[i], i, spec_.dims.vocab);
  }
  batch_valid_ = 0;
  for (size_t i = 0; i < n; ++i) batch_valid_ += labels[i] != -100;
  // Every rank scales its loss by the global batch's count, so the ranks'
  // gradients sum to the global mean's.
  dist_->all_reduce_sum(std::span<int64_t>(&batch_valid_, 1));
  std::memcpy(ids_host_.data(), ids, n * 8);
  std::memcpy(labels_host_.data(), labels, n * 8);
  device_->copy_h2d(StreamId::kH2D, ids_dev_.data_ptr(), ids_host_.data(), n * 8, {"h2d batch"});
  device_->copy_h2d(StreamId::kH2D, labels_dev_.data_ptr(), labels_host_.data(), n * 8, {"h2d batch"});
  device_->record(*data_ready_, StreamId::kH2D);
  device_->wait(StreamId::kCompute, *data_ready_);
}

void Engine::load_visit(const StepOp& v) {
  const std::vector<int64_t> segs = visit_segments(v);
  for (int64_t p : segs) wait_updated(p);
  const CacheUnit& u = pool_->acquire(StreamId::kH2D);
  if (simulated())
    for (int64_t p : segs) device_->wait(StreamId::kH2D, sim_updater_->update_done(p));
  size_t offset = 0;
  for (int64_t p : segs) {
    const Piece& pc = piece(p);
    auto bytes = store_->block(size_t(pc.block)).compute_bytes().subspan(pc.begin * place_.compute_bytes,
                                                                          pc.elems() * place_.compute_bytes);
    device_->copy_h2d(StreamId::kH2D, static_cast<std::byte*>(u.params_bf16) + offset * place_.compute_bytes, bytes.data(),
                      bytes.size(), {"h2d params", int32_t(pc.block)});
    offset += pc.elems();
  }
  auto ready = device_->make_event();
  device_->record(*ready, StreamId::kH2D);
  loaded_[size_t(v.visit)] = {&u, std::move(ready)};
}

void Engine::run_forward(int64_t p, const CacheUnit& u, bool train) {
  const int64_t M = config_.accumulation;
  const Piece& pc = piece(p);
  const int64_t b = pc.block;
  const bool first = p == place_.shards.first_of(b), last = p + 1 == place_.shards.end_of(b);
  at::Tensor params = params_view(u, 0, pc.elems());
  if (config_.checkpoints_on_host && first) {
    // Block b writes ring set (b+1)%2, whose checkpoint copy-out (two blocks ago) must be done.
    device_->wait(StreamId::kCompute, *ring_free_[(b + 1) % 2]);
  }
  const double flops = visit_flops({.kind = StepOpKind::kForward, .piece = p}, true);
  for (int64_t m = 0; m < M; ++m) {
    at::Tensor in = b == 0 ? mb_[size_t(m)].ids : act(b, m);
    at::Tensor out = act(b + 1, m);
    if (b == 0) {
      at::Tensor rows = rows_view(params, 0, pc);
      const int64_t v0 = pc.row_begin;
      device_->launch(StreamId::kCompute, {"embedding shard", int32_t(b), flops},
                      [rows, v0, in, out](const LaunchContext&) { embedding_shard_forward(rows, v0, in, out); });
      continue;
    }
    if (train && keeps(b)) {
      // Keep what backward needs: written into a device slot (once its last
      // reader is done), copied out to the block's host copy.
      const int slot = int(saved_uses_++ % 2);
      at::Tensor save = saved_dev_[size_t(slot)];
      device_->wait(StreamId::kCompute, *saved_free_[size_t(slot)]);
      device_->launch(StreamId::kCompute, {"forward", int32_t(b), flops},
                      [this, b, params, in, out, save](const LaunchContext&) {
                        out.copy_(runner_->forward(b, params, in, save));
                      });
      auto done = device_->make_event();
      device_->record(*done, StreamId::kCompute);
      device_->wait(StreamId::kD2H, *done);
      device_->copy_d2h(StreamId::kD2H, saved_host(b, m).data(), save.data_ptr(), place_.saved_bytes,
                        {"d2h activations", int32_t(b)});
      device_->record(*saved_free_[size_t(slot)], StreamId::kD2H);
      continue;
    }
    device_->launch(StreamId::kCompute, {"forward", int32_t(b), flops},
                    [this, b, params, in, out](const LaunchContext&) {
                      out.copy_(runner_->forward(b, params, in));
                    });
  }
  if (train && keeps(b)) device_->record(*saved_out_[size_t(place_.saved_index[size_t(b)])], StreamId::kD2H);
  if (config_.checkpoints_on_host && last && b + 1 < place_.head) {
    // Copy block b+1's inputs out; the ring set is free again once they left.
    auto done = device_->make_event();
    device_->record(*done, StreamId::kCompute);
    device_->wait(StreamId::kD2H, *done);
    for (int64_t m = 0; m < M; ++m) {
      at::Tensor a = act(b + 1, m);
      device_->copy_d2h(StreamId::kD2H, mb_[size_t(m)].host_ckpt[size_t(b + 1)].data(), a.data_ptr(),
                        a.nbytes(), {"d2h checkpoint", int32_t(b + 1)});
    }
    device_->record(*ring_free_[(b + 1) % 2], StreamId::kD2H);
  }
}

void Engine::run_head(const StepOp& v, const CacheUnit& u, bool train) {
  const int64_t M = config_.accumulation;
  const Sharding& sh = place_.shards;
  const Piece& norm_pc = piece(sh.norm_piece);
  const Piece& rows_pc = piece(sh.lm_piece[size_t(v.shard)]);
  const bool first = v.shard == 0, last = v.shard + 1 == sh.shards, grad = train && v.grad;
  const size_t used = norm_pc.elems() + rows_pc.elems();
  at::Tensor params = params_view(u, 0, used);
  at::Tensor norm = params.slice(0, 0, spec_.dims.hidden);
  at::Tensor rows = rows_view(params, norm_pc.elems(), rows_pc);
  at::Tensor grads = grads_view(u).slice(0, 0, int64_t(used));
  at::Tensor grad_norm = grads.slice(0, 0, spec_.dims.hidden);
  at::Tensor grad_rows = rows_view(grads, norm_pc.elems(), rows_pc);
  const BlockDims dims = spec_.dims;
  const int64_t chunk = sh.chunk, tile = config_.compute.token_tile, v0 = rows_pc.row_begin;
  const int64_t valid = batch_valid_;
  if (v.lse) {
    for (int64_t m = 0; m < M; ++m) {
      at::Tensor in = act(place_.head, m);
      const MicroBatch& x = mb_[size_t(m)];
      at::Tensor labels = x.labels, lse = x.head_lse, loss_sum = x.loss_sum, valid_tokens = x.valid_tokens;
      HeadState st = x.head;
      const at::Tensor keep = train && config_.keep_logits ? kept_logits(m, rows_pc) : at::Tensor();
      device_->launch(StreamId::kCompute, {"head log-sum-exp", int32_t(place_.head), visit_flops({.kind = StepOpKind::kHead, .shard = v.shard, .lse = true}, false)},
                      [dims, norm, rows, v0, in, labels, chunk, tile, st, lse, loss_sum, valid_tokens, first,
                       last, keep](const LaunchContext&) mutable {
                        if (first) head_state_reset(st);
                        head_lse_shard(dims, norm, in.reshape({-1, dims.hidden}), rows, v0, labels, chunk, tile, st,
                                       keep);
                        if (!last) return;
                        lse.copy_(head_lse(st));
                        head_loss_sums(st, lse, labels, loss_sum, valid_tokens);
                      });
    }
    if (last) {
      // The loss's D2H precedes every head gradient's on the d2h stream: the
      // updater checks it when the first gradients land.
      auto done = device_->make_event();
      device_->record(*done, StreamId::kCompute);
      device_->wait(StreamId::kD2H, *done);
      device_->copy_d2h(StreamId::kD2H, head_stats_host_.data(), head_stats_dev_.data_ptr(),
                        head_stats_host_.size_bytes(), {"d2h loss", int32_t(place_.head)});
      device_->record(*head_stats_ready_, StreamId::kD2H);
    }
  }
  if (!grad) return;
  device_->launch(StreamId::kCompute, {"zero grads", int32_t(place_.head)}, [grads](const LaunchContext&) { grads.zero_(); });
  const double flops = visit_flops({.kind = StepOpKind::kHead, .shard = v.shard, .grad = true}, true);
  for (int64_t m = 0; m < M; ++m) {
    at::Tensor in = act(place_.head, m);
    at::Tensor labels = mb_[size_t(m)].labels, lse = mb_[size_t(m)].head_lse, grad_h = mb_[size_t(m)].grad_h;
    const at::Tensor kept = config_.keep_logits ? kept_logits(m, rows_pc) : at::Tensor();
    device_->launch(StreamId::kCompute, {"head backward", int32_t(place_.head), flops},
                    [dims, norm, rows, v0, in, labels, chunk, tile, lse, grad_h, grad_rows, valid, first, kept](
                        const LaunchContext&) {
                      if (first) grad_h.zero_();
                      head_grad_shard(dims, norm, in.reshape({-1, dims.hidden}), rows, v0, labels, chunk, tile, lse,
                                      1.0 / double(valid), grad_h, grad_rows, kept);
                    });
  }
  if (last)
    for (int64_t m = 0; m < M; ++m) {
      at::Tensor in = act(place_.head, m), grad_h = mb_[size_t(m)].grad_h, gout = mb_[size_t(m)].grad_out;
      device_->launch(StreamId::kCompute, {"head norm backward", int32_t(place_.head), 0.0},
                      [dims, norm, in, grad_h, grad_norm, gout, tile](const LaunchContext&) {
                        head_norm_backward(dims, norm, in.reshape({-1, dims.hidden}), grad_h, grad_norm, tile,
                                           gout.view({-1, dims.hidden}));
                      });
    }
  const std::byte* send = grads_to_send(u, used, place_.head);
  if (last) copy_grads_out(sh.norm_piece, send);  // the order of place_.landing
  if (spec_.tie_embeddings) {
    // The embedding's gradient starts from the head's share (run_backward),
    // kept in fp32 so that the sum is the resident reference's.
    device_->copy_d2h(StreamId::kD2H, tied_grad_host_.data() + rows_pc.begin, u.grads_fp32 + norm_pc.elems(),
                      rows_pc.elems() * 4, {"d2h tied grads", int32_t(place_.head)});
    device_->record(*tied_grad_ready_, StreamId::kD2H);
  } else {
    copy_grads_out(sh.lm_piece[size_t(v.shard)], send + norm_pc.elems() * place_.grad_bytes);
  }
}

void Engine::run_backward(int64_t p, const CacheUnit& u) {
  const int64_t M = config_.accumulation;
  const Piece& pc = piece(p);
  const int64_t b = pc.block;
  at::Tensor params = params_view(u, 0, pc.elems());
  at::Tensor grads = grads_view(u).slice(0, 0, int64_t(pc.elems()));
  if (b == 0 && spec_.tie_embeddings) {
    // The embedding's gradient starts from the head's share, so the sum runs
    // in the same order as in the resident reference. (Issued here, not when
    // the unit is prefetched: the head's share must have been computed.)
    device_->wait(StreamId::kH2D, *tied_grad_ready_);
    device_->copy_h2d(StreamId::kH2D, u.grads_fp32, tied_grad_host_.data() + pc.begin, pc.elems() * 4,
                      {"h2d tied gradient", 0});
    auto in = device_->make_event();
    device_->record(*in, StreamId::kH2D);
    device_->wait(StreamId::kCompute, *in);
  } else {
    device_->launch(StreamId::kCompute, {"zero grads", int32_t(b)}, [grads](const LaunchContext&) { grads.zero_(); });
  }
  if (config_.checkpoints_on_host && b >= 1 && b < place_.head) {
    // Bring block b's inputs back into ring set b%2 once its last reader is done.
    auto reader_done = device_->make_event();
    device_->record(*reader_done, StreamId::kCompute);
    device_->wait(StreamId::kH2D, *reader_done);
    // ...and once the forward's copy-out of this checkpoint has landed (the
    // set's latest copy-out is at or after it on the d2h stream).
    device_->wait(StreamId::kH2D, *ring_free_[b % 2]);
    for (int64_t m = 0; m < M; ++m) {
      at::Tensor a = act(b, m);
      device_->copy_h2d(StreamId::kH2D, a.data_ptr(), mb_[size_t(m)].host_ckpt[size_t(b)].data(), a.nbytes(),
                        {"h2d checkpoint", int32_t(b)});
    }
    auto back = device_->make_event();
    device_->record(*back, StreamId::kH2D);
    device_->wait(StreamId::kCompute, *back);
  }
  const double flops = visit_flops({.kind = StepOpKind::kBackward, .piece = p}, true);
  for (int64_t m = 0; m < M; ++m) {
    at::Tensor in = b == 0 ? mb_[size_t(m)].ids : act(b, m);
    at::Tensor gout = mb_[size_t(m)].grad_out;
    if (b == 0) {
      at::Tensor grad_rows = rows_view(grads, 0, pc);
      const int64_t v0 = pc.row_begin;
      device_->launch(StreamId::kCompute, {"embedding shard backward", int32_t(b), flops},
                      [in, v0, gout, grad_rows](const LaunchContext&) {
                        embedding_shard_backward(in, v0, gout, grad_rows);
                      });
      continue;
    }
    if (keeps(b)) {
      // The kept activations of micro-batch m came in ahead (run_pass
      // fetched m = 0 during the previous visit); fetch m + 1's now, into the
      // other slot, once micro-batch m - 1's backward has read it.
      if (saved_in_.empty() || saved_in_.front().block != b) fetch_saved(b, m);
      if (m + 1 < M) fetch_saved(b, m + 1);
      SavedIn got = std::move(saved_in_.front());
      saved_in_.pop_front();
      STRIDER_CHECK(got.block == b && got.m == m, "kept activations: block {} micro-batch {} expected, {} {} came",
                    b, m, got.block, got.m);
      device_->wait(StreamId::kCompute, *got.ready);
      at::Tensor saved = saved_dev_[size_t(got.slot)];
      device_->launch(StreamId::kCompute, {"backward", int32_t(b), flops},
                      [this, b, params, grads, in, gout, saved](const LaunchContext&) {
                        gout.copy_(runner_->backward(b, params, in, gout, grads, saved));
                      });
      device_->record(*saved_free_[size_t(got.slot)], StreamId::kCompute);
      continue;
    }
    device_->launch(StreamId::kCompute, {"recompute+backward", int32_t(b), flops},
                    [this, b, params, grads, in, gout](const LaunchContext&) {
                      at::Tensor gin = runner_->backward(b, params, in, gout, grads);
                      if (gin.defined()) gout.copy_(gin);
                    });
  }
  copy_grads_out(p, grads_to_send(u, pc.elems(), b));
}

const std::byte* Engine::grads_to_send(const CacheUnit& u, size_t elems, int64_t block) {
  const std::byte* out = reinterpret_cast<const std::byte*>(u.grads_fp32);
  if (place_.grad_bytes == 2) {
    at::Tensor acc = grads_view(u).slice(0, 0, int64_t(elems));
    at::Tensor dst = at::from_blob(u.params_bf16, {int64_t(elems)},
                                   at::TensorOptions().dtype(at::kBFloat16).device(aten_device_));
    device_->launch(StreamId::kCompute, {"grads to bf16", int32_t(block), 0.0},
                    [acc, dst](const LaunchContext&) { dst.copy_(acc); });
    out = static_cast<const std::byte*>(u.params_bf16);
  }
  auto done = device_->make_event();
  device_->record(*done, StreamId::kCompute);
  device_->wait(StreamId::kD2H, *done);
  return out;
}

std::span<std::byte> Engine::grad_host(int64_t p) {
  const int r = place_.at(p).ring_slot;
  if (r >= 0) return grad_ring_[size_t(r)];
  const Piece& pc = piece(p);
  return store_->block(size_t(pc.block)).grad.subspan(pc.begin * place_.grad_bytes, pc.elems() * place_.grad_bytes);
}

void Engine::copy_grads_out(int64_t p, const void* src) {
  const int r = place_.at(p).ring_slot;
  if (r >= 0) {
    // The slot's n-th use waits for n consumptions: the previous gradients in
    // it were updated with (or spilled to NVMe). The updater gets there on its
    // own, from gradients already enqueued, so waiting here cannot deadlock.
    const int64_t use = ring_uses_[size_t(r)]++;
    if (simulated()) {
      device_->wait(StreamId::kD2H, sim_updater_->ring_free(r));
    } else {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return ring_released_[size_t(r)] >= use || updater_error_; });
      if (updater_error_) std::rethrow_exception(updater_error_);
    }
  }
  const size_t bytes = piece(p).elems() * place_.grad_bytes;
  device_->copy_d2h(StreamId::kD2H, grad_host(p).data(), src, bytes, {"d2h grads", int32_t(piece(p).block)});
  device_->record(*grads_ready_[size_t(p)], StreamId::kD2H);
  if (simulated()) {
    sim_updater_->landed(p, *grads_ready_[size_t(p)]);
    return;
  }
  {
    std::lock_guard lk(mu_);
    grads_recorded_[size_t(p)] = passes_ + 1;
  }
  cv_.notify_all();
}

Engine::Moved Engine::collect_device_spans() {
  std::vector<OpSpan> spans;
  device_->drain_spans(spans);
  Moved moved;
  for (const OpSpan& o : spans) {
    Lane lane = o.stream == StreamId::kCompute ? Lane::kCompute : o.stream == StreamId::kH2D ? Lane::kH2D : Lane::kD2H;
    timeline_.add({lane, o.tag.name, o.tag.block, -1, steps_, o.begin_us + device_origin_us_,
                   o.end_us + device_origin_us_, o.tag.flops, o.tag.bytes, o.work_peak_bytes});
    if (o.kind == OpKind::kCopyH2D) moved.h2d_bytes += o.tag.bytes;
    if (o.kind == OpKind::kCopyD2H) moved.d2h_bytes += o.tag.bytes;
  }
  return moved;
}

void Engine::run_pass(const StepProgram& program, bool train) {
  device_->prepare_driver_thread();
  loaded_.clear();
  loaded_.resize(size_t(program.visits));
  saved_in_.clear();  // a pass that threw left nothing to wait for in order
  for (const StepOp& op : program.ops) {
    if (!op.on_device()) continue;
    switch (op.kind) {
      case StepOpKind::kLoad: load_visit(op); break;
      // A layer that kept its activations gets its first micro-batch's in
      // while the visit before its backward computes.
      case StepOpKind::kFetchSaved: fetch_saved(op.block, 0); break;
      default: run_visit(op, train); break;
    }
  }
}

void Engine::run_visit(const StepOp& v, bool train) {
  const CacheUnit& u = *loaded_[size_t(v.visit)].unit;
  device_->wait(StreamId::kCompute, *loaded_[size_t(v.visit)].ready);
  switch (v.kind) {
    case StepOpKind::kForward: run_forward(v.piece, u, train); break;
    case StepOpKind::kHead: run_head(v, u, train); break;
    case StepOpKind::kBackward: run_backward(v.piece, u); break;
    default: throw Error(fmt::format("run_visit: '{}' is not a visit", op_name(v.kind)));
  }
  if (v.kind == StepOpKind::kForward || !train || (v.kind == StepOpKind::kHead && !v.grad)) pool_->release(u, {StreamId::kCompute});
  else pool_->release(u, {StreamId::kCompute, StreamId::kD2H});
}

}  // namespace strider
