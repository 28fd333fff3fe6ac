#include "engine/model/layer_work.h"

#include <algorithm>
#include <cmath>

#include "gpu/blocks/weight_grad.h"

namespace strider {

LayerWork layer_work(const BlockDims& d, int64_t batch, int64_t seq, int64_t token_tile, int dtype_bytes,
                     const WorkCoefficients& k, bool packed) {
  using i128 = __int128;
  const i128 n = i128{batch} * seq;
  const i128 t = token_tile == 0 || token_tile > n ? n : token_tile;
  const i128 e = dtype_bytes, h = d.hidden, inter = d.intermediate, heads = d.heads;
  const i128 q = heads * d.head_dim, kv = i128{d.kv_heads} * d.head_dim;
  // Below fp32, RMSNorm normalises an fp32 copy of its input (and autograd
  // keeps it: our own code, on every device). A GEMM may write its output in
  // fp32 first (oneDNN on CPUs without bf16 units), and silu's backward stage
  // in fp32: those two are the device's kernels' (gpu/memory/work_calibration.h,
  // in half bytes per element here).
  const i128 f32_copy = dtype_bytes < 4 ? 4 : 0;
  auto half_bytes = [&](double coef) { return dtype_bytes < 4 ? i128(std::llround(coef * 2)) : i128{0}; };
  const i128 gemm_f32_x2 = half_bytes(k.gemm_staging_bytes), silu_f32_x2 = half_bytes(k.silu_back_staging_bytes);
  auto gemm_f32 = [&](i128 elems) { return gemm_f32_x2 * elems / 2; };
  // RMSNorm of w features without grad: the fp32 copy, x * rsqrt in fp32, its
  // cast and the scaled output; mean, +eps and rsqrt per row (`rows` of them).
  auto norm = [&](i128 w, i128 rows) { return w * (8 + f32_copy) + 12 * rows; };
  // Adding an [out, in] weight gradient (gpu/blocks/weight_grad.h): in fp32, the
  // product before it is added; below, on the CPU device, fp32 copies of a
  // slice of the t tokens of dy and x (CUDA writes fp32 in place: none). The
  // bf16 GEMM writing fp32 copies twice the tokens in 16 bits: no more bytes.
  auto wgrad = [&](i128 out, i128 in) {
    return e == 4 ? out * in * 4 : std::min<i128>(t, weight_grad_slice_rows(int64_t(out), int64_t(in))) * (out + in) * 4;
  };
  // The flash kernel's blocks of scores: on a GPU they stay on chip; ATen's
  // CPU kernel allocates, per thread, an fp32 block of 256 queries (of a
  // call of 768 or more; 64 from 192, else 32) by 512 keys (and, backward,
  // one of their gradients). The model allows two threads (as the test runs).
  const i128 aq_ = attention_query_tile(d, batch, seq, token_tile);
  const i128 q_blk = aq_ >= 768 ? 256 : aq_ >= 192 ? 64 : 32, kv_blk = std::min<i128>(seq, 512);
  const i128 scores = d.attn_softcap > 0 ? 0 : 2 * q_blk * (kv_blk + d.head_dim + 2) * 4;
  const i128 small = 4096;  // scalars and shapes
  // A sliding window below the sequence: its additive [seq, seq] mask in the
  // compute dtype, alive through the attention core (and its autograd
  // graph), built beside one of the boolean masks it comes from.
  // Packed documents (gpu/blocks/blocks.h, TokenLayout): one such mask per row,
  // [batch, 1, seq, seq]; building it holds, at most, the [seq, seq] causal
  // mask with two boolean ones per row (documents compared, or-ed), then one
  // boolean with the mask. The rows' RoPE tables and documents are alive
  // through the layer.
  const bool windowed = d.sliding_window > 0 && seq > d.sliding_window && d.attn_softcap == 0;
  const bool sdpa_mask = (windowed || packed) && d.attn_softcap == 0;
  // Attention in query tiles (gpu/blocks/attention.h): aq positions a tile, T = b
  // x aq tokens; untiled, the one tile [0, seq). A tile's masks cover its aq
  // queries over the keys it sees (all before it, or a window's).
  const i128 aq = attention_query_tile(d, batch, seq, token_tile), T = i128{batch} * aq;
  const bool qtiled = aq < seq, ttiled = t < n;
  const i128 seen = windowed ? std::min<i128>(seq, aq + d.sliding_window - 1) : seq;
  const i128 rows = packed ? batch : 1, square = aq * seen;
  const i128 mask = sdpa_mask ? rows * square * e : 0;
  const i128 mask_build = !sdpa_mask ? 0
                          : packed  ? std::max(2 * rows * square + square, rows * square * (e + 1))
                                    : square * (e + 1);
  const i128 layout = packed ? n * (2 * i128{d.rope.rotary_dim(d.head_dim)} * e + 16) : 0;
  // Post-norms (OLMo 2, Gemma): beside a branch's output, its norm's
  // temporaries and the normed copy (before the sum); backward, the output
  // recomputed, the norm's fp32 graph and its backward.
  const bool post = d.norm_placement != NormPlacement::kPre;
  const i128 post_fwd = post ? norm(h, 1) : 0, post_back = post ? h * (2 * e + 8 + 2 * f32_copy) : 0;
  // Soft-capped attention (gpu/blocks/softcap_attention.h; no flash blocks, no
  // whole mask), one query tile at a time: its S scores (the keys it reads:
  // up to the tile's last query, from a window before its first) with their
  // fp32 softmax and casts, and the tile's mask; backward, the tile's
  // autograd graph (tanh's output, the softmax's, the cast probabilities)
  // and its gradients.
  const i128 tq = d.attn_softcap > 0 ? softcap_query_tile(batch, d.heads, seq) : 0;
  const i128 keys = d.sliding_window > 0 ? std::min<i128>(seq, tq + d.sliding_window - 1) : seq;
  const i128 S = i128{batch} * heads * tq * keys;
  const i128 tile_mask = packed ? rows * tq * keys * (e + 2) + tq * keys : tq * keys * (e + 1);
  const i128 capped_fwd = S > 0 ? S * (4 + 3 * e) + tile_mask : 0;
  const i128 capped_back = S > 0 ? S * (4 + 4 * e) + tile_mask : 0;
  // Granite's residual_multiplier: the backward scales each branch's gradient into a copy.
  const i128 scaled = d.residual_multiplier != 1.0 ? h * e : 0;
  // Headroom for what the count above does not see: a caching allocator's
  // rounding and fragmentation, other ATen versions' kernels. 1/8.
  auto headroom = [](i128 bytes) { return bytes + bytes / 8; };

  // Forward, no autograd: the largest of the attention half's steps, and
  // the MLP with x1 alive (the output, which each tile adds into). The
  // projections, t tokens at a time into whole buffers where tiled: the
  // input norm, then h, q, k, v. The keys' RoPE (k, k * cos, a half, with q
  // and v); with q/k norms, k's. Then the core, held: the projections' q,
  // the RoPE'd k, v and (query tiles) the output; a tile's RoPE (q * cos, a
  // half) or q norm; SDPA's output and log-sum-exp beside its q; with query
  // tiles the parts' merge (both outputs, fp32 copies below fp32, the
  // result, five [T, heads] fp32 terms). Untiled, the projections' q is
  // gone by SDPA. Last x + o_proj of the output, t tokens at a time into x1
  // where tiled.
  const i128 proj = (ttiled ? n * (q + 2 * kv) * e : 0) +
                    t * std::max(norm(h, 1), (h + q + 2 * kv) * e + gemm_f32(q));
  i128 keys_rope = n * (q + 7 * kv / 2) * e;
  if (d.qk_norm) keys_rope = std::max(keys_rope, n * (q + 2 * kv) * e + n * norm(kv, d.kv_heads));
  const i128 core_held = n * (q + 2 * kv) * e + (qtiled ? n * q * e : 0);
  i128 q_rope = core_held + 3 * T * q * e / 2;
  if (d.qk_norm) q_rope = std::max(q_rope, core_held + T * norm(q, heads));
  // Below fp32 the CPU kernel repacks a call's K and V (all keys at most).
  const i128 repack = e < 4 ? n * 2 * kv * e : 0;
  const i128 Tm = i128{batch} * std::min<i128>(aq, seq - aq);  // the queries of a tile of two parts
  const i128 merge = Tm * (q * (e < 4 ? 4 * e + 8 : 3 * e) + 20 * heads);
  const i128 kernel = qtiled ? core_held + mask + std::max({T * (2 * q * e + 4 * heads) + scores + repack,
                                                            Tm * (3 * q * e + 8 * heads) + scores + repack, merge})
                             : n * ((2 * q + 2 * kv) * e + 4 * heads) + scores + mask + repack;
  const i128 build = qtiled ? core_held + T * q * e + mask_build : n * (h + q + 2 * kv) * e + mask_build;
  const i128 residual = ttiled ? n * (q + h) * e + t * (h * e + std::max(gemm_f32(h), post_fwd))
                               : n * (q * e + h * e + std::max({gemm_f32(h), e * h, post_fwd}));
  i128 attn = std::max({proj, keys_rope, q_rope, kernel, build, residual});
  if (d.attn_softcap > 0) attn = std::max(attn, n * (2 * q + 2 * kv) * e + capped_fwd);
  i128 mlp = n * h * e + t * std::max({norm(h, 1), h * e + 2 * inter * e + gemm_f32(inter),  // gate, up
                                       inter * e + h * e + post_fwd});                      // down, post-norm
  // Experts (gpu/blocks/moe.h), a tile of t tokens: the normed input; the router's
  // fp32 probabilities, each token's choices, scores and the (token, slot)
  // groups with their sort and places (about 48 bytes a choice). The P = t x
  // top_k (token, expert) pairs' rows go through grouped GEMMs in group
  // space, G rows: P, or on the CPU below fp32 each expert's rows padded to
  // its bucket (at most 1/8 more, or 15 rows). Then, in turn: the rows
  // gathered and moved to group space; gate and up with the product; the
  // output and its move back; its weighting (fp32 for Mixtral's scores), the
  // k places per token and the output.
  const MoeDims& moe = d.moe;
  const i128 ek = moe.top_k, ei = moe.intermediate, E = moe.experts;
  const i128 route = t * (4 * E + 48 * ek);
  const i128 P = t * ek, G = e < 4 ? P + P / 8 + 15 * E : P;
  const i128 f32_scores = moe.scores_fp32 ? 4 * P * h : 0;
  // A shared expert (Qwen2-MoE) after them, beside the output: its gate, up,
  // act(gate) and their product; then the product and its output; then the
  // output and the weighted one.
  const i128 si = moe.shared_intermediate;
  if (moe.sparse())
    mlp = n * h * e + std::max(t * norm(h, 1),
                               t * h * e + route +
                                   std::max({(P + G) * h * e, G * (h + 4 * ei) * e, G * (ei + h) * e + P * h * e,
                                             3 * P * h * e + f32_scores + t * h * e,
                                             t * h * e + t * std::max(4 * si, 2 * h + si) * e}));
  LayerWork w;
  w.forward = headroom(std::max(attn, mlp) + layout + small);

  // Backward (gpu/blocks/blocks.cpp's layer_backward, recomputing: a layer whose
  // activations are kept holds less). Held through the MLP: the recomputed
  // projections q, k, v, the RoPE'd k (with its norm's graph: fp32 input
  // and normalised values), the core's output and log-sum-exp, x1 and
  // d(loss)/d(x1). Soft-capped attention (rebuilt with autograd): its graph
  // instead (RoPE'd q and k, the output, the heads' output reshaped for
  // o_proj; with q/k norms their fp32 inputs and normalised values).
  i128 held = (2 * q + 3 * kv) * e + 4 * heads + 2 * h * e;
  if (d.qk_norm) held += kv * (e + f32_copy) + 4 * d.kv_heads;
  if (d.attn_softcap > 0) {
    held = (3 * q + kv) * e + 4 * heads + (q + 2 * kv) * e + 2 * h * e;
    if (d.qk_norm) held += (q + kv) * (e + f32_copy) + 4 * (heads + d.kv_heads);
  }
  // One MLP tile: gate, up, d(act), d(up), d(gate) and silu_backward's
  // scratch (fp32 below fp32), and d(h2) with a GEMM's output; one weight
  // gradient [intermediate, hidden] being added at a time.
  i128 tile =
      n * held + t * (inter * 4 * e + silu_f32_x2 * inter / 2 + 2 * h * e + post_back + scaled) + wgrad(inter, h);
  // Experts' backward: the normed input, d(input) and the routing again with
  // its autograd graph (the logits, fp32 probabilities and their gradient);
  // the pairs' rows (group space) and output gradients, gate and up and the
  // product recomputed, then in turn: the output recomputed and d(score)'s
  // fp32 products; the weighted gradients moved to group space; the
  // gradients of the product, act and gate/up; d(rows) and its move back to
  // the k places per token. One expert's weight gradient at a time.
  // (Below fp32, d(score)'s products are three fp32 copies; in fp32 one.)
  const i128 rows_back = G * h * e + P * h * e + 3 * G * ei * e;  // the rows, their output gradients, gate/up, act
  // A shared expert's backward once the experts' rows are gone: gate, up,
  // act(gate) and the product, with its output and gy x output; then (the
  // product gone) d(output), d(product), d(up) and d(gate) with
  // silu_backward's scratch; one weight gradient at a time.
  if (moe.sparse())
    tile = n * held + t * (4 * h * e + scaled) + route + t * E * (e + 12) + 2 * ei * h * e +
           std::max({rows_back + P * h * e + std::max(G * h * e, (e < 4 ? 3 : 1) * P * h * 4),
                     rows_back + P * h * e + G * h * e + f32_scores, 2 * G * h * e + 9 * G * ei * e,
                     3 * G * h * e + 2 * G * ei * e + 2 * P * h * e,
                     t * ((5 * si + 2 * h) * e + silu_f32_x2 * si / 2) + (si > 0 ? wgrad(si, h) : 0)});
  // Before the MLP: the projections again (as forward), the core's forward
  // again with the projections' q held (untiled) beside RoPE'd k and the
  // log-sum-exp, then x1 (as forward) with the core's output.
  const i128 recompute =
      std::max({proj, n * ((3 * q + 3 * kv) * e + 4 * heads) + scores + mask + repack,
                qtiled ? kernel + n * (kv * e + 4 * heads) : 0,
                n * (held - 2 * h * e) + (residual - n * q * e)});
  // Attention's backward, x1 gone: a post-norm's backward (beside
  // d(loss)/d(x1)) and d(a), t tokens at a time into a whole buffer where
  // tiled; then the core's: d(q) for all tokens, fp32 sums of d(k) and d(v)
  // over query tiles, and a tile's: its RoPE'd q, d(out) made contiguous
  // by the kernel, d(q) of each part and their sum (below fp32 the CPU
  // kernel accumulates d(q) in fp32), the parts' d(k) and d(v) (all keys'
  // at most), the blocks of scores and their gradients (below fp32 with
  // reduced copies);
  // then the tile's queries back through RoPE and the q norm (the graph,
  // d(q), its gradient, and with a q norm its backward's fp32 temporaries),
  // the parts' d(k) and d(v) held; then the keys' back through RoPE and the
  // k norm.
  const i128 o_back = n * (held - h * e + (ttiled ? q * e : 0) + post_back + scaled) +
                      t * (q * e + gemm_f32(q)) + wgrad(h, q);
  const i128 base = n * (held - h * e + 2 * q * e) + (qtiled ? n * 2 * kv * 4 : 0);
  const i128 core_back = base + (qtiled ? T * (4 * q * e + f32_copy * q) : n * (3 * q * e + f32_copy * q)) +
                         n * 2 * kv * e + 2 * scores + (e < 4 ? scores : 0) + repack;
  const i128 q_back = base + n * 2 * kv * e + T * q * (d.qk_norm ? 4 * e + 22 : 6 * e);
  const i128 k_back = base + n * 2 * kv * e + n * kv * (d.qk_norm ? 2 * (e + f32_copy) + 12 : 3 * e);
  i128 attn_back = std::max({o_back, core_back + mask, q_back, k_back});
  if (d.attn_softcap > 0)
    attn_back = std::max(n * (held + post_back + scaled),
                         n * (held - h * e + 2 * q * e + (q + 2 * kv) * e + f32_copy * q + scaled) + capped_back);
  // Last, t tokens at a time (one tile: d(q), d(k), d(v) gone first): the
  // q/k/v GEMMs' gradients (the input norm recomputed; d(h1) a sum of
  // three), then the norm recomputed with autograd and back-propagated,
  // d(loss)/d(x1) taking d(loss)/dx: d(h1), the norm's fp32 graph and its
  // backward's fp32 temporaries. (OLMo 2 has no input norm: d(loss)/dx is a
  // sum.)
  const i128 grads_held = n * (h + q + 2 * kv) * e;
  const i128 qkv_back = grads_held + t * (std::max(norm(h, 1), 3 * h * e + gemm_f32(h))) + wgrad(q, h);
  const i128 norm_tile = d.norm_placement == NormPlacement::kPost ? h * e : h * e + h * (12 + 2 * e) + 12 * h;
  const i128 norm_back = ttiled ? grads_held + t * norm_tile : n * (h * e + norm_tile);
  w.backward = headroom(std::max({tile + (qtiled ? 0 : mask), recompute, attn_back, qkv_back, norm_back}) + layout +
                        small);
  return w;
}

}  // namespace strider
