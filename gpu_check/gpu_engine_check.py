"""The engine on a device against the engine on the CPU device and against transformers + torch.optim.AdamW.

    python gpu_check/gpu_engine_check.py --device cuda     # on a GPU machine (gpu_check/gpu_check.sh runs it)
    python gpu_check/gpu_engine_check.py --device cpu      # the same logic on the CPU (gpu_check.sh --cpu)

A tiny Llama made from a config on the spot (4 decoder layers: 6 blocks), a window of K = 2 cache units
(fewer than the blocks, so the window slides), block inputs checkpointed to pinned host memory, micro-batch
2 x accumulation 2, exact global-norm clipping at 1.0 (it clips), warm-up + linear decay, AdamW with
weight decay; 3 optimizer steps, in fp32 and in bf16. Three runs per dtype on the same data:

  engine  strider.Engine on --device (with --device cpu: the CPU device with chaos delays, so the
          comparison with the plain CPU device below still means something: it must be bit-identical)
  cpu     strider.Engine on the CPU device
  torch   transformers + torch.optim.AdamW on --device (the reference), per micro-batch sum of token
          losses / the batch's valid tokens (HF's num_items_in_batch), clip, AdamW, scheduler
  pool    strider.Engine on a pool of two devices on the same card (devices "cuda,cuda"; on the CPU
          "cpu,cpu" with chaos, which must be bit-identical to `engine`): the cross-device path
In fp32, also `lora nf4`: a PEFT LoRA model (r=4 on every linear module) whose base the engine holds in NF4
(base_format "nf4": dequantized on the device at each visit), on --device against the same on the CPU
device (the dequantization gives the host's bits on both; the rest within fp32's 1e-5). And `packed`: rows of 2 or 3 documents (packed_documents, position_ids restarting at each), the
engine on --device against transformers given the same position_ids (block-diagonal attention; on CUDA
SDPA's memory-efficient kernel reads the engine's mask).
In both dtypes, `moe`: a tiny Qwen3-MoE (8 experts, top 2, its grouped GEMMs: ATen's grouped GEMM on CUDA
in bf16, a GEMM per expert in fp32) on --device against transformers + AdamW, and run twice: bit-identical
(each token's expert outputs are added in a fixed order, not by atomics).

Tolerances (relative; a tensor's error is its largest absolute difference over its largest magnitude):
  fp32  each step's loss and gradient norm, and every fp32 master after 3 steps: 1e-5. TF32 is off.
  bf16  the reference keeps fp32 masters and computes forward/backward with a bf16 copy of them, gradients
        accumulated in fp32, as the engine does. Different but equally valid bf16 operation orders differ
        by a few ulps per op, so: loss 1e-2, gradient norm 2e-2, parameters 5e-2 (the tolerance of
        tests/python/test_blocks_vs_hf.py's bf16 test, here after 3 steps).

Prints what it compares, and as its last line one JSON object: {"ok": bool, "device": ..., "fp32": {...},
"bf16": {...}}. Exit status 0 when every comparison holds, 1 when one does not, 2 when it could not run.
"""
import argparse
import copy
import os
import sys
import time

import torch
from gpu_check_common import require_device, run_check  # also puts this tree's strider package on sys.path

SEQ, MICRO_BATCH, ACCUMULATION, STEPS = 17, 2, 2, 3
BATCH = MICRO_BATCH * ACCUMULATION
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0
WARMUP, TOTAL = 1, 4
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=64, rms_norm_eps=1e-5)
TOL = {"fp32": dict(loss=1e-5, grad_norm=1e-5, params=1e-5),
       "bf16": dict(loss=1e-2, grad_norm=2e-2, params=5e-2)}


def make_model(seed=0):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**TINY)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms start at ones: perturb them so their updates mean something
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def make_moe(seed=0):
    """A tiny Qwen3-MoE: 8 experts, top 2 renormalised, a router that prefers some (uneven loads)."""
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(**{**TINY, "head_dim": 16}, moe_intermediate_size=32, num_experts=8,
                                      num_experts_per_tok=2, norm_topk_prob=True, output_router_logits=False)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.3)
    return model


def batches(vocab, seed=1):
    """STEPS batches of [BATCH, SEQ], HF-style labels: -100 on a prompt and on padding (a different row each step)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(STEPS):
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100
        labels[s % BATCH, 9 + s:] = -100
        out.append((ids, labels))
    return out


# Document lengths of each row of a packed batch (SEQ tokens a row).
PACKED_ROWS = [[6, 6, 5], [3, 8, 6], [12, 5], [1, 16]]


def packed(data):
    """The batches with rows that pack documents: (ids, labels, position_ids), a document's first label -100."""
    from strider.torch_reference import packed_position_ids
    pos = packed_position_ids(PACKED_ROWS)
    out = []
    for ids, labels in data:
        labels = labels.clone()
        labels[pos == 0] = -100
        out.append((ids, labels, pos))
    return out


def valid_count(labels):
    return int((labels[:, 1:] != -100).sum())


def engine_run(model, data, dtype, device, chaos=False, devices="1"):
    import strider
    cfg = strider.EngineConfig(seq=SEQ, micro_batch=MICRO_BATCH, accumulation=ACCUMULATION, window=2,
                               dtype=dtype, vocab_chunk=300, vocab_shard_rows=300, checkpoints_on_host=True, lr=LR,
                               schedule="linear",
                               warmup_steps=WARMUP, total_steps=TOTAL, weight_decay=WEIGHT_DECAY, clip_norm=CLIP,
                               betas=BETAS, eps=EPS, device=device, chaos=chaos, chaos_seed=7, devices=devices,
                               device_budget="auto" if devices == "1" else "1GiB",
                               packed_documents=len(data[0]) == 3)
    engine = strider.Engine(model, cfg)
    steps = [engine.step(ids, labels, position_ids=pos[0] if pos else None) for ids, labels, *pos in data]
    engine.finish()
    params = {n: engine.param(n) for n in engine.param_names()}
    return dict(loss=[r.loss for r in steps], grad_norm=[r.grad_norm for r in steps], params=params,
                peak_device_bytes=max(r.peak_device_bytes for r in steps))


def lora_run(model, data, device, base_format):
    """A PEFT LoRA model over a base held in `base_format`, fp32: losses, gradient norms, the adapters."""
    import peft
    import strider
    torch.manual_seed(3)  # the adapters' start: the same in every run
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                      lora_dropout=0.0))
    cfg = strider.EngineConfig(seq=SEQ, micro_batch=MICRO_BATCH, accumulation=ACCUMULATION, window=2, dtype="fp32",
                               vocab_chunk=300, lr=LR, weight_decay=WEIGHT_DECAY, clip_norm=CLIP, device=device,
                               base_format=base_format)
    engine = strider.Engine(lora, cfg)
    steps = [engine.step(ids, labels) for ids, labels, *_ in data]
    engine.finish()
    params = {n: engine.param(n) for n in engine.param_names() if ".lora_" in n}
    return dict(loss=[r.loss for r in steps], grad_norm=[r.grad_norm for r in steps], params=params)


def reference_run(model, data, dtype, device):
    """transformers + torch.optim.AdamW on `device`; bf16: fp32 masters, a bf16 compute copy, fp32 gradients."""
    import transformers
    from strider.torch_reference import adamw_param_groups
    master = model.to(device)
    compute = master if dtype == "fp32" else copy.deepcopy(master).to(torch.bfloat16)
    opt = torch.optim.AdamW(adamw_param_groups(master, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    sched = transformers.get_linear_schedule_with_warmup(opt, WARMUP, TOTAL)
    pairs = list(zip(master.parameters(), compute.parameters()))
    losses, norms = [], []
    for ids, labels, *pos in data:
        ids, labels = ids.to(device), labels.to(device)
        valid = valid_count(labels)
        opt.zero_grad(set_to_none=False)
        if compute is not master:
            with torch.no_grad():
                for m, c in pairs:
                    c.copy_(m)
                    c.grad = None
        loss = 0.0
        for k in range(ACCUMULATION):
            rows = slice(k * MICRO_BATCH, (k + 1) * MICRO_BATCH)
            # Packed rows: position_ids without a cache (with one transformers does not look for documents).
            docs = dict(position_ids=pos[0][rows].to(device), use_cache=False) if pos else {}
            part = compute(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=valid, **docs).loss
            part.backward()
            loss += part.item()
            if compute is not master:  # accumulate in fp32, as the engine's units do
                with torch.no_grad():
                    for m, c in pairs:
                        if c.grad is not None:
                            m.grad = c.grad.float() if m.grad is None else m.grad.add_(c.grad.float())
                            c.grad = None
        norms.append(torch.nn.utils.clip_grad_norm_(master.parameters(), CLIP).item())
        losses.append(loss)
        opt.step()
        sched.step()
    params = {n: p.detach().float().cpu() for n, p in master.named_parameters()}
    return dict(loss=losses, grad_norm=norms, params=params)


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def tensor_rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def compare(name, run, ref, tol):
    """Worst relative errors of `run` against `ref`, and whether each is within `tol`."""
    out = {"loss": max(rel(a, b) for a, b in zip(run["loss"], ref["loss"])),
           "grad_norm": max(rel(a, b) for a, b in zip(run["grad_norm"], ref["grad_norm"]))}
    missing = sorted(set(ref["params"]) - set(run["params"]))
    worst = max(((tensor_rel(run["params"][n], p), n) for n, p in ref["params"].items() if n in run["params"]),
                default=(float("inf"), None))
    out["params"], out["worst_param"] = worst
    out["ok"] = not missing and all(out[k] <= tol[k] for k in ("loss", "grad_norm", "params"))
    if missing:
        out["missing_params"] = missing
    print(f"  {name}: loss {out['loss']:.3g} (tol {tol['loss']:g}), grad norm {out['grad_norm']:.3g} "
          f"(tol {tol['grad_norm']:g}), params {out['params']:.3g} (tol {tol['params']:g}; worst "
          f"{out['worst_param']}) -> {'ok' if out['ok'] else 'NOT WITHIN TOLERANCE'}")
    return out


def check_dtype(dtype, device):
    base = make_model()
    data = batches(base.config.vocab_size)
    clipped = None
    chaos = device == "cpu"
    t0 = time.time()
    ours = engine_run(copy.deepcopy(base), data, dtype, device, chaos=chaos)
    cpu = engine_run(copy.deepcopy(base), data, dtype, "cpu")
    ref = reference_run(copy.deepcopy(base), data, dtype, device)
    clipped = sum(n > CLIP for n in ref["grad_norm"])
    label = "engine on cpu with chaos" if chaos else f"engine on {device}"
    print(f"{dtype}: {STEPS} steps, losses {['%.5f' % x for x in ours['loss']]} ({label}), "
          f"{['%.5f' % x for x in ref['loss']]} (transformers + AdamW on {device}); {clipped} of {STEPS} clipped")
    # A pool of two devices on this one card (two CUDA devices on the same GPU, docs/pool.md, "How the pool
    # runs"): the cross-device hand-offs and waits, the head's 4 vocabulary shards spread over both
    # (the same shards as one device's: vocab_shard_rows), against the reference and the one-device engine.
    pool = engine_run(copy.deepcopy(base), data, dtype, device, chaos=chaos, devices=f"{device},{device}")
    res = {"engine_vs_torch": compare(f"{label} vs transformers + AdamW on {device}", ours, ref, TOL[dtype]),
           "pool_vs_torch": compare(f"pool of 2 on {device} vs transformers + AdamW", pool, ref, TOL[dtype]),
           "pool_bit_identical_to_one_device": pool["loss"] == ours["loss"] and all(
               torch.equal(pool["params"][n], p) for n, p in ours["params"].items()),
           "engine_vs_cpu_engine": compare(f"{label} vs engine on cpu", ours, cpu, TOL[dtype]),
           "losses": ours["loss"], "reference_losses": ref["loss"], "clipped_steps": clipped,
           "peak_device_bytes": ours["peak_device_bytes"], "tolerance": TOL[dtype], "seconds": time.time() - t0}
    if chaos:  # offload changes nothing: chaos delays on the CPU device are bit-identical
        same = ours["loss"] == cpu["loss"] and all(torch.equal(ours["params"][n], p) for n, p in cpu["params"].items())
        res["chaos_bit_identical"] = same
        print(f"  chaos delays bit-identical to the plain CPU device: {same}")
    print(f"  pool of 2 bit-identical to one device: {res['pool_bit_identical_to_one_device']}")
    if dtype == "fp32":  # packed documents: the masked attention path on this device
        docs = packed(data)
        res["packed_vs_torch"] = compare(f"packed documents on {device} vs transformers + AdamW",
                                         engine_run(copy.deepcopy(base), docs, dtype, device, chaos=chaos),
                                         reference_run(copy.deepcopy(base), docs, dtype, device), TOL[dtype])
        res["lora_nf4_vs_cpu"] = compare(f"LoRA over an NF4 base on {device} vs on cpu",
                                         lora_run(copy.deepcopy(base), data, device, "nf4"),
                                         lora_run(copy.deepcopy(base), data, "cpu", "nf4"), TOL[dtype])
    # Data seed 2: with seed 1, embed_tokens' rows that one token updates land at 3.7e-5 in fp32 on the CPU
    # (AdamW divides a gradient by its own magnitude: tests/python/test_engine_vs_torch.py, DATA_SEED); 2 and
    # 5 hold 1e-5 with 3 of 3 steps clipped.
    moe = make_moe()
    moe_data = batches(moe.config.vocab_size, seed=2)
    first, again = (engine_run(copy.deepcopy(moe), moe_data, dtype, device, chaos=chaos) for _ in range(2))
    res["moe_vs_torch"] = compare(f"Qwen3-MoE on {device} vs transformers + AdamW", first,
                                  reference_run(copy.deepcopy(moe), moe_data, dtype, device), TOL[dtype])
    res["moe_deterministic"] = first["loss"] == again["loss"] and all(
        torch.equal(again["params"][n], p) for n, p in first["params"].items())
    print(f"  Qwen3-MoE run twice, bit-identical: {res['moe_deterministic']}")
    res["ok"] = (res["engine_vs_torch"]["ok"] and res["engine_vs_cpu_engine"]["ok"] and res["pool_vs_torch"]["ok"]
                 and res["moe_vs_torch"]["ok"] and res["moe_deterministic"]
                 and res.get("packed_vs_torch", {"ok": True})["ok"] and clipped > 0
                 and res.get("lora_nf4_vs_cpu", {"ok": True})["ok"]
                 and res.get("chaos_bit_identical", True) and (res["pool_bit_identical_to_one_device"] or not chaos))
    if clipped == 0:
        print("  no step was clipped: the clipping path went untested")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    args = ap.parse_args()
    out = {"check": "engine", "device": args.device, "torch": torch.__version__}

    def body(out):
        import transformers
        out["transformers"] = transformers.__version__
        require_device(args.device)
        if args.device.startswith("cuda"):
            torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on the reference side too
            torch.backends.cudnn.allow_tf32 = False
            out["device_name"] = torch.cuda.get_device_name(torch.device(args.device))
        import strider
        out["library"] = str(strider.load_library())
        print(f"gpu_engine_check: torch {torch.__version__}, transformers {transformers.__version__}, "
              f"{os.path.basename(out['library'])} from {os.path.dirname(out['library'])}")
        for dtype in ("fp32", "bf16"):
            out[dtype] = check_dtype(dtype, args.device)
        out["ok"] = all(out[d]["ok"] for d in ("fp32", "bf16"))

    return run_check(out, body)

if __name__ == "__main__":
    sys.exit(main())
