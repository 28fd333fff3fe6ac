// The engine's device pass (DESIGN.md, "One training step", steps 1-3): the
// batch upload, each block visit's H2D (K-1 visits ahead), forward, head and
// backward on the compute stream, checkpoints and gradients out on the d2h
// stream into host staging (their own buffer or the gradient ring).
#include <cstring>

#include "engine/engine.h"
#include "host/error.h"

namespace strider {

at::Tensor Engine::act(int64_t b, int64_t m) const {
  // b in 1..head: the input of block b (block 0's input is the ids).
  const int64_t set = config_.checkpoints_on_host ? (b % 2) : (b - 1);
  return act_[size_t(set * config_.accumulation + m)];
}

at::Tensor Engine::params_view(const CacheUnit& u, int64_t b) const {
  int64_t n = int64_t(layouts_[b].total_elems());
  if (b == head_ && spec_.tie_embeddings) n += int64_t(layouts_[0].total_elems());
  return at::from_blob(u.params_bf16, {n}, at::TensorOptions().dtype(config_.compute.dtype).device(aten_device_));
}

at::Tensor Engine::grads_view(const CacheUnit& u) const {
  return at::from_blob(u.grads_fp32, {int64_t(u.capacity_elems)},
                       at::TensorOptions().dtype(at::kFloat).device(aten_device_));
}

void Engine::wait_updated(int64_t b) {
  if (simulated()) return;  // ordered by sim_update_done_ events instead
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return updated_[b] >= passes_ || updater_error_ || stopping_; });
  if (updater_error_) std::rethrow_exception(updater_error_);
}

void Engine::finish_updates() {
  for (int64_t b = 0; b < num_blocks_; ++b) wait_updated(b);
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
  std::memcpy(ids_host_.data(), ids, n * 8);
  std::memcpy(labels_host_.data(), labels, n * 8);
  device_->copy_h2d(StreamId::kH2D, ids_dev_.data_ptr(), ids_host_.data(), n * 8, {"h2d batch"});
  device_->copy_h2d(StreamId::kH2D, labels_dev_.data_ptr(), labels_host_.data(), n * 8, {"h2d batch"});
  device_->record(*data_ready_, StreamId::kH2D);
  device_->wait(StreamId::kCompute, *data_ready_);
}

void Engine::load_visit(const Visit& v, size_t i) {
  const int64_t b = v.block;
  wait_updated(b);
  if (b == head_ && spec_.tie_embeddings) wait_updated(0);
  const CacheUnit& u = pool_->acquire(StreamId::kH2D);
  if (simulated()) {
    device_->wait(StreamId::kH2D, *sim_update_done_[b]);
    if (b == head_ && spec_.tie_embeddings) device_->wait(StreamId::kH2D, *sim_update_done_[0]);
  }
  const BlockState& s = store_->block(size_t(b));
  auto bytes = s.compute_bytes();
  device_->copy_h2d(StreamId::kH2D, u.params_bf16, bytes.data(), bytes.size(), {"h2d params", int32_t(b)});
  if (b == head_ && spec_.tie_embeddings) {
    auto emb = store_->block(0).compute_bytes();
    device_->copy_h2d(StreamId::kH2D, static_cast<std::byte*>(u.params_bf16) + bytes.size(), emb.data(),
                      emb.size(), {"h2d tied embedding", int32_t(b)});
  }
  auto ready = device_->make_event();
  device_->record(*ready, StreamId::kH2D);
  loaded_[i] = {&u, std::move(ready)};
}

void Engine::run_forward(int64_t b, const CacheUnit& u) {
  const int64_t M = config_.accumulation;
  at::Tensor params = params_view(u, b);
  if (config_.checkpoints_on_host) {
    // Block b writes ring set (b+1)%2, whose checkpoint copy-out (two blocks ago) must be done.
    device_->wait(StreamId::kCompute, *ring_free_[(b + 1) % 2]);
  }
  for (int64_t m = 0; m < M; ++m) {
    at::Tensor in = b == 0 ? ids_dev_.chunk(M, 0)[m] : act(b, m);
    at::Tensor out = act(b + 1, m);
    device_->launch(StreamId::kCompute, {"forward", int32_t(b), spec_.cost(b, config_.micro_batch, config_.seq,
                                                                            config_.compute.vocab_chunk, int(compute_bytes_)).forward_flops},
                    [this, b, params, in, out](const LaunchContext&) {
                      out.copy_(runner_->forward(b, params, in));
                    });
  }
  if (config_.checkpoints_on_host && b + 1 < head_) {
    // Copy block b+1's inputs out; the ring set is free again once they left.
    auto done = device_->make_event();
    device_->record(*done, StreamId::kCompute);
    device_->wait(StreamId::kD2H, *done);
    for (int64_t m = 0; m < M; ++m) {
      at::Tensor a = act(b + 1, m);
      device_->copy_d2h(StreamId::kD2H, host_ckpt_[size_t((b + 1) * M + m)].data(), a.data_ptr(),
                        a.nbytes(), {"d2h checkpoint", int32_t(b + 1)});
    }
    device_->record(*ring_free_[(b + 1) % 2], StreamId::kD2H);
  }
}

void Engine::run_head(const CacheUnit& u, bool train) {
  const int64_t M = config_.accumulation;
  at::Tensor params = params_view(u, head_);
  at::Tensor grads = grads_view(u);
  const int64_t own = int64_t(layouts_[head_].total_elems());
  const bool tied = spec_.tie_embeddings;
  const int64_t valid = batch_valid_;
  BlockCost cost = spec_.cost(head_, config_.micro_batch, config_.seq, config_.compute.vocab_chunk, int(compute_bytes_));
  if (train) device_->launch(StreamId::kCompute, {"zero grads", int32_t(head_)}, [grads](const LaunchContext&) { grads.zero_(); });
  for (int64_t m = 0; m < M; ++m) {
    at::Tensor in = act(head_, m);
    at::Tensor labels = labels_dev_.chunk(M, 0)[m];
    at::Tensor gout = grad_out_[size_t(m)];
    at::Tensor loss_sum = head_stats_dev_[0][m], valid_tokens = head_stats_dev_[1][m];
    device_->launch(StreamId::kCompute, {train ? "head loss+backward" : "head loss", int32_t(head_),
                                         train ? cost.forward_flops + cost.backward_flops : cost.forward_flops},
                    [this, params, grads, in, labels, gout, own, tied, train, valid, loss_sum,
                     valid_tokens](const LaunchContext&) {
                      at::Tensor own_p = params.slice(0, 0, own);
                      at::Tensor tied_p = tied ? params.slice(0, own) : at::Tensor();
                      at::Tensor own_g = grads.slice(0, 0, own);
                      at::Tensor tied_g = tied ? grads.slice(0, own, own + params.numel() - own) : at::Tensor();
                      // The labels were checked on the host (upload_batch).
                      HeadResult r = train ? runner_->head_backward(own_p, own_g, tied_p, tied_g, in, labels,
                                                                    1.0 / double(valid), Scalars::kOnDevice)
                                           : runner_->head_eval(own_p, tied_p, in, labels, Scalars::kOnDevice);
                      loss_sum.copy_(r.loss_sum_dev);
                      valid_tokens.copy_(r.valid_tokens_dev);
                      if (train) gout.copy_(r.grad_input);
                    });
  }
  auto done = device_->make_event();
  device_->record(*done, StreamId::kCompute);
  device_->wait(StreamId::kD2H, *done);
  device_->copy_d2h(StreamId::kD2H, head_stats_host_.data(), head_stats_dev_.data_ptr(),
                    head_stats_host_.size_bytes(), {"d2h loss", int32_t(head_)});
  device_->record(*head_stats_ready_, StreamId::kD2H);
  if (!train) return;
  copy_grads_out(head_, u.grads_fp32);
  if (tied) {
    device_->copy_d2h(StreamId::kD2H, tied_grad_host_.data(), u.grads_fp32 + own, tied_grad_host_.size_bytes(),
                      {"d2h tied grads", int32_t(head_)});
    device_->record(*tied_grad_ready_, StreamId::kD2H);
  }
}

void Engine::run_backward(int64_t b, const CacheUnit& u) {
  const int64_t M = config_.accumulation;
  at::Tensor params = params_view(u, b);
  at::Tensor grads = grads_view(u).slice(0, 0, int64_t(layouts_[b].total_elems()));
  if (b == 0 && spec_.tie_embeddings) {
    // The embedding's gradient starts from the head's share, so the sum runs
    // in the same order as in the resident reference. (Issued here, not when
    // the unit is prefetched: the head's share must have been computed.)
    device_->wait(StreamId::kH2D, *tied_grad_ready_);
    device_->copy_h2d(StreamId::kH2D, u.grads_fp32, tied_grad_host_.data(), tied_grad_host_.size_bytes(),
                      {"h2d tied gradient", 0});
    auto in = device_->make_event();
    device_->record(*in, StreamId::kH2D);
    device_->wait(StreamId::kCompute, *in);
  } else {
    device_->launch(StreamId::kCompute, {"zero grads", int32_t(b)}, [grads](const LaunchContext&) { grads.zero_(); });
  }
  if (config_.checkpoints_on_host && b >= 1 && b < head_) {
    // Bring block b's inputs back into ring set b%2 once its last reader is done.
    auto reader_done = device_->make_event();
    device_->record(*reader_done, StreamId::kCompute);
    device_->wait(StreamId::kH2D, *reader_done);
    // ...and once the forward's copy-out of this checkpoint has landed (the
    // set's latest copy-out is at or after it on the d2h stream).
    device_->wait(StreamId::kH2D, *ring_free_[b % 2]);
    for (int64_t m = 0; m < M; ++m) {
      at::Tensor a = act(b, m);
      device_->copy_h2d(StreamId::kH2D, a.data_ptr(), host_ckpt_[size_t(b * M + m)].data(), a.nbytes(),
                        {"h2d checkpoint", int32_t(b)});
    }
    auto back = device_->make_event();
    device_->record(*back, StreamId::kH2D);
    device_->wait(StreamId::kCompute, *back);
  }
  const double flops = spec_.cost(b, config_.micro_batch, config_.seq, config_.compute.vocab_chunk, int(compute_bytes_))
                           .backward_flops * 1.5;  // recompute + backward
  for (int64_t m = 0; m < M; ++m) {
    at::Tensor in = b == 0 ? ids_dev_.chunk(M, 0)[m] : act(b, m);
    at::Tensor gout = grad_out_[size_t(m)];
    device_->launch(StreamId::kCompute, {"recompute+backward", int32_t(b), flops},
                    [this, b, params, grads, in, gout](const LaunchContext&) {
                      at::Tensor gin = runner_->backward(b, params, in, gout, grads);
                      if (gin.defined()) gout.copy_(gin);
                    });
  }
  auto done = device_->make_event();
  device_->record(*done, StreamId::kCompute);
  device_->wait(StreamId::kD2H, *done);
  copy_grads_out(b, u.grads_fp32);
}

std::span<std::byte> Engine::grad_host(int64_t b) {
  const int r = ring_slot_[size_t(b)];
  return r < 0 ? store_->block(size_t(b)).grad : grad_ring_[size_t(r)];
}

void Engine::copy_grads_out(int64_t b, const void* src) {
  const int r = ring_slot_[size_t(b)];
  if (r >= 0) {
    // The slot's n-th use waits for n consumptions: the previous gradients in
    // it were updated with (or spilled to NVMe). The updater gets there on its
    // own, from gradients already enqueued, so waiting here cannot deadlock.
    const int64_t use = ring_uses_[size_t(r)]++;
    if (simulated()) {
      device_->wait(StreamId::kD2H, *sim_ring_free_[size_t(r)]);
    } else {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return ring_released_[size_t(r)] >= use || updater_error_; });
      if (updater_error_) std::rethrow_exception(updater_error_);
    }
  }
  const size_t bytes = layouts_[size_t(b)].total_elems() * sizeof(float);
  device_->copy_d2h(StreamId::kD2H, grad_host(b).data(), src, bytes, {"d2h grads", int32_t(b)});
  device_->record(*grads_ready_[b], StreamId::kD2H);
  if (simulated()) {
    sim_landed(b);
    return;
  }
  {
    std::lock_guard lk(mu_);
    grads_recorded_[size_t(b)] = passes_ + 1;
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

void Engine::run_pass(const std::vector<Visit>& visits, bool train) {
  const size_t n = visits.size(), ahead = size_t(config_.window) - 1;
  loaded_.clear();
  loaded_.resize(n);
  size_t next = 0;
  for (size_t i = 0; i < n; ++i) {
    // Visits i .. i+K-1 hold the K units; i-1 was released last iteration.
    for (; next < n && next <= i + ahead; ++next) load_visit(visits[next], next);
    const Visit& v = visits[i];
    const CacheUnit& u = *loaded_[i].unit;
    device_->wait(StreamId::kCompute, *loaded_[i].ready);
    switch (v.kind) {
      case Visit::kForward: run_forward(v.block, u); break;
      case Visit::kHead: run_head(u, train); break;
      case Visit::kBackward: run_backward(v.block, u); break;
    }
    if (v.kind == Visit::kForward || !train) pool_->release(u, {StreamId::kCompute});
    else pool_->release(u, {StreamId::kCompute, StreamId::kD2H});
  }
}

}  // namespace strider
