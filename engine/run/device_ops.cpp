// The device executor's table (engine/program/step_program.h): one handler per kind
// of device operation, each enqueuing its work on its stream. The events that
// order the streams are the handlers' own (a checkpoint ring set free, a kept
// activation slot free, a unit's load done); which operations exist, and in
// what order, is the program's.
#include "engine/run/collectives.h"
#include "engine/run/engine_core.h"
#include "gpu/blocks/base_dequant.h"
#include "host/error.h"

namespace strider {

namespace {

// A hand-off's span name, by what it carries (the trace's and the profile's lanes).
const char* hand_name(const StepOp& op, bool out) {
  const HandArgs& h = op.as<HandArgs>();
  switch (h.hand) {
    case Hand::kBlock:
      if (h.grads) return out ? "d2h hand-off gradient" : "h2d hand-off gradient";
      return out ? "d2h hand-off" : "h2d hand-off";
    case Hand::kHeadState: return out ? "d2h hand-off head state" : "h2d hand-off head state";
    case Hand::kLse: return out ? "d2h hand-off log-sum-exp" : "h2d hand-off log-sum-exp";
    case Hand::kHeadGrad: return out ? "d2h hand-off head gradient" : "h2d hand-off head gradient";
  }
  return "hand-off";
}

}  // namespace

double EngineCore::op_flops(const StepOp& op) const {
  const double tokens = double(place_.micro_batch * place_.seq), H = double(spec_.dims.hidden);
  switch (op.kind) {
    case StepOpKind::kHeadLse:
    case StepOpKind::kHeadGrad: {
      const Piece& rows = piece(place_.shards().lm_piece[size_t(op.shard)]);
      const double logits = 2.0 * tokens * H * double(rows.row_end - rows.row_begin);
      // Pass 1: the logits; pass 2: the logits again and both gradients
      // (frozen rows: the hidden state's only). With kept logits, pass 2
      // computes only the gradients.
      if (op.kind == StepOpKind::kHeadLse) return logits;
      return (op.as<ComputeArgs>().keep ? 2.0 : 3.0) * logits - (rows.frozen ? logits : 0.0);
    }
    case StepOpKind::kForward:
    case StepOpKind::kBackward: {
      const int64_t b = piece(op.piece).block;
      if (spec_.block(b).kind != BlockKind::kLayer) return 0;  // an embedding shard: a gather or a scatter
      const BlockCost c = spec_.cost(b, place_.micro_batch, place_.seq, compute_.vocab_chunk,
                                     int(place_.compute_bytes), 0, WorkCoefficients::analytic(),
                                     op.as<ComputeArgs>().packed);
      const Piece& pc = piece(op.piece);
      if (pc.sub_layer) {
        // Its share of the layer's: an MLP slice's three GEMMs over its
        // rows (a group's experts: their share of the top_k experts' each
        // token runs), the attention half the rest; backward (with the
        // recompute) in the same proportion.
        const BlockDims ld = spec_.layer_dims(spec_.block(b).layer);
        const bool sparse = ld.moe.sparse();
        const double I = double(sparse ? ld.moe.intermediate * ld.moe.top_k : ld.intermediate);
        const double mlp = 6.0 * tokens * H * I, whole = double(sparse ? ld.moe.experts : ld.intermediate);
        const double mine = pc.mlp_slice() ? mlp * double(pc.mlp_end - pc.mlp_begin) / whole : c.forward_flops - mlp;
        const double share = c.forward_flops > 0 ? mine / c.forward_flops : 0.0;
        return share * (op.kind == StepOpKind::kForward ? c.forward_flops : c.forward_flops + c.backward_flops);
      }
      if (op.kind == StepOpKind::kForward) return c.forward_flops;
      if (!op.as<ComputeArgs>().keep) return c.forward_flops + c.backward_flops;  // recompute + backward
      // Kept activations: backward, and what it computes again (a layer's experts, a soft-capped core).
      return c.backward_flops + c.backward_recompute_flops;
    }
    case StepOpKind::kDequantize:  // a multiply per element (and a level's lookup for NF4): memory-bound
      return 2.0 * double(piece(op.piece).elems());
    default:
      return 0;
  }
}

// Before a visit's first copy into what its compute reads: that device's
// compute so far (the last reader) done, and (`ring`) block b's checkpoint
// ring set free (its copy out has left).
void EngineCore::first_copy_in(Seat& st, int64_t b, bool ring) {
  stream_after(st, StreamId::kH2D, StreamId::kCompute);
  if (ring) st.device->wait(StreamId::kH2D, *st.ring_free[size_t(b % 2)]);
}

void EngineCore::op_checkpoint_out(const StepOp& op, Seat& st) {
  Device& dev = *st.device;
  const int64_t m = op.micro_batch;
  const CopyArgs& c = op.as<CopyArgs>();
  // Block op.block's inputs out; their ring set is free again once they left.
  if (c.first) stream_after(st, StreamId::kD2H, StreamId::kCompute);
  at::Tensor a = act(st, op.block, m);
  dev.copy_d2h(StreamId::kD2H, host_ckpt_[size_t(m)][size_t(op.block)].data(), a.data_ptr(), a.nbytes(),
               {"d2h checkpoint", int32_t(op.block)});
  if (c.last) dev.record(*st.ring_free[size_t(op.block % 2)], StreamId::kD2H);
}

void EngineCore::op_checkpoint_in(const StepOp& op, Seat& st) {
  Device& dev = *st.device;
  const int64_t m = op.micro_batch;
  const CopyArgs& c = op.as<CopyArgs>();
  // Block op.block's inputs back into ring set block % 2, once its last
  // reader is done and the forward's copy-out of this checkpoint has
  // landed (the set's latest copy-out is at or after it on the d2h
  // stream: this device's, or in a pool the device that made it).
  if (c.first) {
    first_copy_in(st, op.block, true);
    if (c.peer >= 0) dev.wait(StreamId::kH2D, *seats_[size_t(c.peer)].ring_free[size_t(op.block % 2)]);
  }
  at::Tensor a = act(st, op.block, m);
  dev.copy_h2d(StreamId::kH2D, a.data_ptr(), host_ckpt_[size_t(m)][size_t(op.block)].data(), a.nbytes(),
               {"h2d checkpoint", int32_t(op.block)});
  if (c.last) stream_after(st, StreamId::kCompute, StreamId::kH2D);
}

void EngineCore::op_hand_out(const StepOp& op, Seat& st) {
  Device& dev = *st.device;
  const int64_t m = op.micro_batch;
  const HandArgs& h = op.as<HandArgs>();
  // A pool: micro-batch m of what the next device takes, out to its
  // hand-off buffer once this device's compute wrote it (the compute of
  // the next micro-batch goes on meanwhile). The buffer's previous
  // readers come before this compute in the chain of hand-offs: each
  // reader's compute waited for its copy, and handed on what this
  // device's compute waited for.
  stream_after(st, StreamId::kD2H, StreamId::kCompute);
  at::Tensor a = handed(st, op);
  std::byte* host = hand_host_[size_t(h.hand)][size_t(m)].data();
  dev.copy_d2h(StreamId::kD2H, host, a.data_ptr(), a.nbytes(), {hand_name(op, true), int32_t(op.block)});
  if (h.hand == Hand::kBlock && place_.hand_stats_bytes > 0)  // the routing statistics ride along
    dev.copy_d2h(StreamId::kD2H, host + place_.hand_stats_at, st.moe_stats[m].data_ptr(), place_.hand_stats_bytes,
                 {"d2h hand-off routing statistics", int32_t(op.block)});
  dev.record(*st.handed[size_t(h.hand)][size_t(m)], StreamId::kD2H);
}

void EngineCore::op_hand_in(const StepOp& op, Seat& st) {
  Device& dev = *st.device;
  const int64_t m = op.micro_batch;
  const HandArgs& h = op.as<HandArgs>();
  // ...and in on this visit's device once the other's copy of it landed
  // (and, before the visit's first, once this device's compute so far,
  // the last reader of what it fills, is done); its compute of
  // micro-batch m waits for it.
  if (h.first) first_copy_in(st, op.block, h.wait_ring);
  dev.wait(StreamId::kH2D, *seats_[size_t(h.peer)].handed[size_t(h.hand)][size_t(m)]);
  at::Tensor a = handed(st, op);
  const std::byte* host = hand_host_[size_t(h.hand)][size_t(m)].data();
  dev.copy_h2d(StreamId::kH2D, a.data_ptr(), host, a.nbytes(), {hand_name(op, false), int32_t(op.block)});
  if (h.hand == Hand::kBlock && place_.hand_stats_bytes > 0)  // this device's running sum becomes the sender's
    dev.copy_h2d(StreamId::kH2D, st.moe_stats[m].data_ptr(), host + place_.hand_stats_at, place_.hand_stats_bytes,
                 {"h2d hand-off routing statistics", int32_t(op.block)});
  stream_after(st, StreamId::kCompute, StreamId::kH2D);
}

void EngineCore::run_device_op(const StepOp& op, PassCursor& at) {
  const int64_t m = op.micro_batch;
  Seat& st = seat(op);
  Device& dev = *st.device;
  switch (op.kind) {
    case StepOpKind::kReadCompute: read_compute(op); return;
    case StepOpKind::kLoad: load_visit(op, at.program->layouts[size_t(op.visit)]); return;
    case StepOpKind::kFetchSaved: fetch_saved(st, op.block, m); return;
    case StepOpKind::kForward: forward_op(op, at); return;
    case StepOpKind::kSaveOut: {
      // What the kept forward wrote into its slot, out to the layer's host copy.
      dev.wait(StreamId::kD2H, *at.saved_done);
      dev.copy_d2h(StreamId::kD2H, saved_host(op.block, m).data(), st.saved_dev[size_t(at.saved_slot)].data_ptr(),
                   place_.saved_bytes, {"d2h activations", int32_t(op.block)});
      dev.record(*st.saved_free[size_t(at.saved_slot)], StreamId::kD2H);
      if (op.as<CopyArgs>().last) dev.record(*saved_out_[size_t(place_.saved_index[size_t(op.block)])], StreamId::kD2H);
      return;
    }
    case StepOpKind::kCheckpointOut: op_checkpoint_out(op, st); return;
    case StepOpKind::kCheckpointIn: op_checkpoint_in(op, st); return;
    case StepOpKind::kHandOut: op_hand_out(op, st); return;
    case StepOpKind::kHandIn: op_hand_in(op, st); return;
    case StepOpKind::kHeadLse:
    case StepOpKind::kHeadGrad:
    case StepOpKind::kHeadNormBackward:
      head_op(op);
      return;
    case StepOpKind::kObjective: objective_op(op); return;
    case StepOpKind::kLossOut: {
      // The loss's D2H precedes every head gradient's on the d2h stream: the
      // updater checks it when the first gradients land.
      stream_after(st, StreamId::kD2H, StreamId::kCompute);
      dev.copy_d2h(StreamId::kD2H, head_stats_host_.data(), st.head_stats.data_ptr(), head_stats_host_.size_bytes(),
                   {"d2h loss", int32_t(place_.head)});
      if (st.objective_stats.defined())  // a training pass of an objective past SFT: its figures too
        dev.copy_d2h(StreamId::kD2H, objective_stats_host_.data(), st.objective_stats.data_ptr(),
                     objective_stats_host_.size_bytes(), {"d2h objective figures", int32_t(place_.head)});
      dev.record(*head_stats_ready_, StreamId::kD2H);
      return;
    }
    case StepOpKind::kDequantize: {
      // The base's bytes came with the load into the unit's staging; the
      // layer's parameters from them, where the piece lies in the unit.
      const BlockState& s = store_->block(size_t(op.block));
      const CacheUnit& u = unit(op);
      size_t at = 0;
      for (const UnitRun& r : *loaded_[size_t(op.visit)].layout)
        if (r.piece == op.piece) at = r.unit_at;
      const BaseLayout* l = s.base_layout;
      const std::byte* src = u.staging;
      void* dst = static_cast<std::byte*>(u.params_bf16) + at * place_.compute_bytes;
      const at::ScalarType dtype = compute_.dtype;
      const c10::Device aten = st.aten;
      dev.launch(StreamId::kCompute, {"dequantize base", int32_t(op.block), op_flops(op)},
                 [l, src, dst, dtype, aten](const LaunchContext&) { dequantize_base_on_device(*l, src, dst, dtype, aten); });
      return;
    }
    case StepOpKind::kZeroGrads: {
      at::Tensor grads = grads_view(st, unit(op)).slice(0, 0, int64_t(visit_elems(op) - grad_base(op)));
      dev.launch(StreamId::kCompute, {"zero grads", int32_t(op.block)}, [grads](const LaunchContext&) { grads.zero_(); });
      return;
    }
    case StepOpKind::kTiedGradIn: {
      // The embedding's gradient starts from the head's share, so the sum runs
      // in the same order as in the resident reference.
      const Piece& pc = piece(op.piece);  // an embedding shard: one range
      for (const auto& e : tied_grad_ready_) dev.wait(StreamId::kH2D, *e);  // in a pool, the head's devices
      dev.copy_h2d(StreamId::kH2D, unit(op).grads_fp32, tied_grad_host_.data() + pc.ranges[0].begin, pc.elems() * 4,
                   {"h2d tied gradient", 0});
      stream_after(st, StreamId::kCompute, StreamId::kH2D);
      return;
    }
    case StepOpKind::kBackward: backward_op(op); return;
    case StepOpKind::kGradsToSend:
      at.send = grads_to_send(st, unit(op), visit_elems(op) - grad_base(op), op.block);
      return;
    case StepOpKind::kGradsOut: copy_grads_out(op.piece, op, at.send); return;
    case StepOpKind::kTiedGradOut: {
      // Kept in fp32 so that the embedding's sum is the resident reference's.
      const Piece& rows = piece(op.piece);
      const size_t norm = piece(place_.shards().norm_piece).elems() - grad_base(op);  // the rows' accumulators
      dev.copy_d2h(StreamId::kD2H, tied_grad_host_.data() + rows.ranges[0].begin, unit(op).grads_fp32 + norm,
                   rows.elems() * 4, {"d2h tied grads", int32_t(place_.head)});
      dev.record(*tied_grad_ready_[size_t(op.shard)], StreamId::kD2H);
      return;
    }
    case StepOpKind::kRelease:
      if (op.as<ReleaseArgs>().d2h) st.pool->release(unit(op), {StreamId::kCompute, StreamId::kD2H});
      else st.pool->release(unit(op), {StreamId::kCompute});
      return;
    STRIDER_HOST_OP_KINDS:  // every kind is named (-Werror=switch): a new one needs its handler here or in run_host_op
      break;
  }
  throw Error(fmt::format("the device executor was given the host operation '{}'", op_name(op.kind)));
}

const CacheUnit& EngineCore::unit(const StepOp& op) const { return *loaded_[size_t(op.visit)].unit; }

size_t EngineCore::visit_elems(const StepOp& op) const {
  size_t n = 0;
  for (const UnitRun& u : *loaded_[size_t(op.visit)].layout) n += u.run.n;
  return n;
}

void EngineCore::forward_op(const StepOp& op, PassCursor& at) {
  const Piece& pc = piece(op.piece);
  const int64_t b = pc.block, m = op.micro_batch;
  Seat& st = seat(op);
  Device& dev = *st.device;
  BlockRunner* runner = st.runner.get();
  // The visit's unit: an embedding shard, or a layer in its block's layout (all its pieces).
  at::Tensor params = params_view(st, unit(op), 0, visit_elems(op));
  // Block b writes ring set (b+1)%2, whose checkpoint copy-out (two blocks ago) must be done.
  if (op.as<ComputeArgs>().wait_ring) dev.wait(StreamId::kCompute, *st.ring_free[size_t((b + 1) % 2)]);
  const double flops = op_flops(op);
  at::Tensor in = b == 0 ? st.mb[size_t(m)].ids : act(st, b, m);
  at::Tensor out = act(st, b + 1, m);
  if (b == 0) {
    at::Tensor rows = rows_view(params, 0, pc);
    const int64_t v0 = pc.row_begin;
    const double scale = embedding_scale(spec_.dims, rows.scalar_type());
    dev.launch(StreamId::kCompute, {"embedding shard", int32_t(b), flops},
               [rows, v0, in, out, scale](const LaunchContext&) { embedding_shard_forward(rows, v0, in, out, scale); });
    return;
  }
  const BatchPositions pos = st.mb[size_t(m)].positions;  // its rows' documents, if they pack several
  if (pc.sub_layer) {  // a sub-layer piece: between its layer's visits, what the layer keeps (CutBuffers)
    const MicroBatch& x = st.mb[size_t(m)];
    const CutBuffers cut{x.cut_x1, x.cut_h2, x.cut_sum, x.cut_top, x.cut_scores, x.cut_dscores};
    const Piece* p = &pc;
    const bool again = op.as<ComputeArgs>().recompute;
    const MoeStep moe = moe_step(st, b, m, /*backward=*/false);  // the attention half's routing adds its statistics
    // (LoRA is refused with sub-layer pieces: a reference pass has no adapters to drop here.)
    dev.launch(StreamId::kCompute, {again ? "recompute" : "forward", int32_t(b), flops},
               [runner, p, params, in, out, cut, pos, again, moe](const LaunchContext&) {
                 if (again) runner->recompute_mlp_input(*p, params, in, cut, &pos);
                 else runner->forward_piece(*p, params, in, out, cut, &pos, &moe);
               });
    return;
  }
  const MoeStep moe = moe_step(st, b, m, /*backward=*/false);
  // A reference pass (Engine::logprobs) runs the frozen base alone: its layers without their adapters.
  if (op.as<ComputeArgs>().keep) {
    // Keep what backward needs: written into a device slot (once its last
    // reader is done); kSaveOut copies it out to the layer's host copy.
    at.saved_slot = int(st.saved_uses++ % 2);
    at::Tensor save = st.saved_dev[size_t(at.saved_slot)];
    dev.wait(StreamId::kCompute, *st.saved_free[size_t(at.saved_slot)]);
    const bool adapters = !reference_pass_;
    dev.launch(StreamId::kCompute, {"forward", int32_t(b), flops},
               [runner, b, params, in, out, save, pos, moe, adapters](const LaunchContext&) {
                 out.copy_(runner->forward(b, params, in, save, &pos, &moe, adapters));
               });
    at.saved_done = dev.make_event();
    dev.record(*at.saved_done, StreamId::kCompute);
    return;
  }
  const bool adapters = !reference_pass_;
  dev.launch(StreamId::kCompute, {"forward", int32_t(b), flops},
             [runner, b, params, in, out, pos, moe, adapters](const LaunchContext&) {
               out.copy_(runner->forward(b, params, in, {}, &pos, &moe, adapters));
             });
}

void EngineCore::head_op(const StepOp& op) {
  const int64_t m = op.micro_batch;
  Seat& st = seat(op);
  Device& dev = *st.device;
  const Sharding& sh = place_.shards();
  const Piece& norm_pc = piece(sh.norm_piece);
  const Piece& rows_pc = piece(sh.lm_piece[size_t(op.shard)]);
  const bool first = op.shard == 0, last = op.shard + 1 == sh.shards;
  const size_t used = norm_pc.elems() + rows_pc.elems();
  at::Tensor params = params_view(st, unit(op), 0, used);
  at::Tensor norm = params.slice(0, 0, spec_.dims.hidden);
  at::Tensor rows = rows_view(params, norm_pc.elems(), rows_pc);
  const BlockDims dims = spec_.dims;
  const int64_t chunk = sh.chunk, tile = compute_.token_tile, v0 = rows_pc.row_begin;
  at::Tensor in = act(st, place_.head, m);
  const MicroBatch& x = st.mb[size_t(m)];
  if (op.kind == StepOpKind::kHeadLse) {
    at::Tensor labels = x.labels, lse = x.head_lse, loss_sum = x.loss_sum, valid_tokens = x.valid_tokens;
    HeadState hs = x.head;
    const at::Tensor keep = op.as<ComputeArgs>().keep ? kept_logits(st, m, op.shard) : at::Tensor();
    dev.launch(StreamId::kCompute, {"head log-sum-exp", int32_t(place_.head), op_flops(op)},
               [dims, norm, rows, v0, in, labels, chunk, tile, hs, lse, loss_sum, valid_tokens, first, last,
                keep](const LaunchContext&) mutable {
                 if (first) head_state_reset(hs);
                 head_lse_shard(dims, norm, in.reshape({-1, dims.hidden}), rows, v0, labels, chunk, tile, hs, keep);
                 if (!last) return;
                 lse.copy_(head_lse(hs));
                 head_loss_sums(hs, lse, labels, loss_sum, valid_tokens);
               });
    return;
  }
  // A frozen norm or frozen rows have no accumulator (undefined): their
  // gradients are not computed. The gradient area starts at the first trained.
  const size_t base = grad_base(op);
  at::Tensor grads = grads_view(st, unit(op)).slice(0, 0, int64_t(used - base));
  at::Tensor grad_h = x.grad_h;
  if (op.kind == StepOpKind::kHeadNormBackward) {
    at::Tensor grad_norm = norm_pc.frozen ? at::Tensor() : grads.slice(0, 0, spec_.dims.hidden), gout = x.grad_out;
    dev.launch(StreamId::kCompute, {"head norm backward", int32_t(place_.head), 0.0},
               [dims, norm, in, grad_h, grad_norm, gout, tile](const LaunchContext&) {
                 head_norm_backward(dims, norm, in.reshape({-1, dims.hidden}), grad_h, grad_norm, tile,
                                    gout.view({-1, dims.hidden}));
               });
    return;
  }
  at::Tensor grad_rows = rows_pc.frozen ? at::Tensor() : rows_view(grads, norm_pc.elems() - base, rows_pc);
  at::Tensor labels = x.labels, lse = x.head_lse;
  const double loss_scale = pass_scale_ / double(batch_valid_);  // the mean over the batch's valid tokens, scaled (fp16)
  const at::Tensor kept = op.as<ComputeArgs>().keep ? kept_logits(st, m, op.shard) : at::Tensor();
  const at::Tensor coef = x.coef;  // an objective's (kObjective's), which replace loss_scale; else undefined
  dev.launch(StreamId::kCompute, {"head backward", int32_t(place_.head), op_flops(op)},
             [dims, norm, rows, v0, in, labels, chunk, tile, lse, grad_h, grad_rows, loss_scale, first, kept, coef](
                 const LaunchContext&) {
               if (first) grad_h.zero_();
               head_grad_shard(dims, norm, in.reshape({-1, dims.hidden}), rows, v0, labels, chunk, tile, lse,
                               loss_scale, grad_h, grad_rows, kept, coef);
             });
}

void EngineCore::objective_op(const StepOp& op) {
  // After the last shard's pass 1 of every micro-batch: each token's
  // log-probability (target logit - log-sum-exp) over the whole step, mapped
  // by the objective to its loss (this rank's share, into the first
  // micro-batch's loss figure: the figures' sum is the share) and to each
  // token's coefficient for pass 2 (-d(loss)/d(log p), times the loss scale).
  Seat& st = seat(op);
  std::vector<at::Tensor> target, lse, labels, coef;
  for (const MicroBatch& x : st.mb) {
    target.push_back(x.head.target);
    lse.push_back(x.head_lse);
    labels.push_back(x.labels);
    coef.push_back(x.coef);
  }
  const ObjectiveSettings o = objective_;
  const ObjectiveBatch in = objective_batch_;
  const int64_t B = place_.batch(), S = place_.seq;
  const double scale = pass_scale_;
  const at::Tensor stats = st.objective_stats, loss_sums = st.head_stats[0];
  st.device->launch(StreamId::kCompute, {"objective", int32_t(place_.head), 0.0},
                    [o, in, B, S, scale, target, lse, labels, coef, stats, loss_sums](const LaunchContext&) {
                      const at::Tensor mask = (at::cat(labels) != -100).view({B, S});
                      const at::Tensor logp = (at::cat(target) - at::cat(lse)).view({B, S}).masked_fill(~mask, 0.0f);
                      const at::Tensor g = objective_grad(o, logp, mask, in, stats).view({-1}).mul(-scale);
                      const int64_t T = g.numel() / int64_t(coef.size());
                      for (size_t m = 0; m < coef.size(); ++m)
                        coef[m].copy_(g.slice(0, int64_t(m) * T, int64_t(m + 1) * T));
                      loss_sums.zero_();
                      loss_sums[0].copy_(stats[kStatLoss]);
                    });
}

void EngineCore::backward_op(const StepOp& op) {
  const Piece& pc = piece(op.piece);
  const int64_t b = pc.block, m = op.micro_batch;
  Seat& st = seat(op);
  Device& dev = *st.device;
  BlockRunner* runner = st.runner.get();
  const size_t n = visit_elems(op), base = grad_base(op);  // as in forward_op; the gradients from `base` on
  at::Tensor params = params_view(st, unit(op), 0, n);
  at::Tensor grads = grads_view(st, unit(op)).slice(0, 0, int64_t(n - base));
  const double flops = op_flops(op);
  at::Tensor in = b == 0 ? st.mb[size_t(m)].ids : act(st, b, m);
  at::Tensor gout = st.mb[size_t(m)].grad_out;
  if (b == 0) {
    at::Tensor grad_rows = rows_view(grads, 0, pc);
    const int64_t v0 = pc.row_begin;
    const double scale = embedding_scale(spec_.dims, params.scalar_type());
    const int64_t pad = spec_.dims.pad_token;
    dev.launch(StreamId::kCompute, {"embedding shard backward", int32_t(b), flops},
               [in, v0, gout, grad_rows, scale, pad](const LaunchContext&) {
                 embedding_shard_backward(in, v0, gout, grad_rows, scale, pad);
               });
    return;
  }
  const BatchPositions pos = st.mb[size_t(m)].positions;  // its rows' documents, if they pack several
  if (pc.sub_layer) {  // as forward_op's
    const MicroBatch& x = st.mb[size_t(m)];
    const CutBuffers cut{x.cut_x1, x.cut_h2, x.cut_sum, x.cut_top, x.cut_scores, x.cut_dscores};
    const Piece* p = &pc;
    const MoeStep moe = moe_step(st, b, m, /*backward=*/true);
    dev.launch(StreamId::kCompute, {"recompute+backward", int32_t(b), flops},
               [runner, p, params, grads, in, gout, cut, pos, moe](const LaunchContext&) {
                 runner->backward_piece(*p, params, in, gout, grads, cut, &pos, &moe);
               });
    return;
  }
  const MoeStep moe = moe_step(st, b, m, /*backward=*/true);
  if (op.as<ComputeArgs>().keep) {
    // Its kept activations came in ahead (kFetchSaved), in order.
    STRIDER_CHECK(!st.saved_in.empty(), "kept activations: block {} micro-batch {} expected, none came", b, m);
    SavedIn got = std::move(st.saved_in.front());
    st.saved_in.pop_front();
    STRIDER_CHECK(got.block == b && got.m == m, "kept activations: block {} micro-batch {} expected, {} {} came", b, m,
                  got.block, got.m);
    dev.wait(StreamId::kCompute, *got.ready);
    at::Tensor saved = st.saved_dev[size_t(got.slot)];
    dev.launch(StreamId::kCompute, {"backward", int32_t(b), flops},
               [runner, b, params, grads, in, gout, saved, base, pos, moe](const LaunchContext&) {
                 gout.copy_(runner->backward(b, params, in, gout, grads, saved, base, &pos, &moe));
               });
    dev.record(*st.saved_free[size_t(got.slot)], StreamId::kCompute);
    return;
  }
  dev.launch(StreamId::kCompute, {"recompute+backward", int32_t(b), flops},
             [runner, b, params, grads, in, gout, base, pos, moe](const LaunchContext&) {
               at::Tensor gin = runner->backward(b, params, in, gout, grads, {}, base, &pos, &moe);
               if (gin.defined()) gout.copy_(gin);
             });
}

}  // namespace strider
