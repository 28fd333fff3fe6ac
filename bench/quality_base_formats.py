#!/usr/bin/env python3
"""LoRA over a quantized base on quality: `strider finetune --lora --base-format int8|nf4` against the same
run over the exact base and against PEFT + torch.optim.AdamW over the exact base, over seeds.

A base worth quantizing is a trained one: a Hugging Face Llama (hidden 256, 4 layers, ~4M parameters) is
first trained from scratch with torch AdamW on half of CPython's documentation topics (`pydoc_data.topics`,
tokenized with a byte-level BPE tokenizer trained on them here; nothing comes from a hub). LoRA r=16 on every
linear module then adapts it to the other half: `strider finetune` with the base in the compute dtype
(`compute`), `int8` and `nf4`, seeds 1..--seeds each, bf16 compute, clipping at 1.0; and PEFT + torch
AdamW (bf16 autocast) over the exact fp32 base, on the same batches in the same order as strider's loader
gives them (io/token_data.h's shuffled windows), seeds 1..--seeds. The seed sets the adapters' start and
the data order. Each run's figure is the held-out loss after its last step, on the same windows of the
second half that no run trains on, and the base's own held-out loss before any training in each format
(what quantization alone costs), by strider.torch_reference.quantized_round_trip.

The quality line of a format: the mean over its seeds inside the exact base's band (min..max over seeds)
or within 1% of the exact base's mean, whichever is wider. A benchmark, not a test: it never fails on a
figure. Prints the table and writes --out/quality_base.json.

    .venv/bin/python bench/quality_base_formats.py --out /tmp/qbase
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "python_shim"))
from quality_formats import corpus_tokens  # noqa: E402
from strider.data import window_order  # noqa: E402

BASE_MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=2048, max_position_embeddings=256, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, rope_theta=10000.0)
FORMATS = ["compute", "int8", "nf4"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="quality-base-out")
    p.add_argument("--build", default=str(REPO / "build"))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--base-steps", type=int, default=600, help="the base's training from scratch (torch)")
    p.add_argument("--steps", type=int, default=150, help="LoRA steps of each run")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-batches", type=int, default=4)
    return p.parse_args(argv)


def loader_batches(ids, batch, seq, seed, steps):
    """What `strider finetune --seed seed` trains on, step by step: [batch, seq + 1] windows."""
    windows = (len(ids) - 1) // seq
    out, epoch, cursor, order = [], 0, 0, window_order(windows, seed, 0)
    for _ in range(steps):
        rows = []
        for _ in range(batch):
            if cursor == windows:
                epoch, cursor = epoch + 1, 0
                order = window_order(windows, seed, epoch)
            s = order[cursor] * seq
            cursor += 1
            rows.append(ids[s:s + seq + 1])
        out.append(np.stack(rows))
    return out


def heldout_loss(model, eval_ids, args):
    """Mean cross-entropy over the eval file's first eval_batches x batch windows, as the engine scores them."""
    import torch
    n = args.eval_batches * args.micro_batch * args.accumulation
    w = np.stack([eval_ids[k * args.seq:k * args.seq + args.seq + 1] for k in range(n)])
    x, y = torch.from_numpy(w[:, :-1]).long(), torch.from_numpy(w[:, 1:]).long()
    with torch.no_grad():
        logits = model(input_ids=x).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()


def train_base(args, ids, out):
    """The base: trained from scratch on the first half with torch AdamW (fp32, resident), then saved."""
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE_MODEL)).float()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    batch = args.micro_batch * args.accumulation
    for step, b in enumerate(loader_batches(ids, batch, args.seq, 1234, args.base_steps)):
        for g in opt.param_groups:
            g["lr"] = 3e-3 * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / args.base_steps))
        x = torch.from_numpy(b).long()
        loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss  # (labels shift inside: next-token)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.save_pretrained(out / "base")
    return model


def strider_run(args, out, fmt, seed):
    metrics = out / f"{fmt}-seed{seed}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [str(Path(args.build) / "strider"), "finetune", "--device", "cpu", "--model", str(out / "base"),
           "--data", str(out / "ft.tokens"), "--eval-data", str(out / "eval.tokens"), "--eval-batches",
           str(args.eval_batches), "--eval-every", str(args.steps), "--lora", "r=16,alpha=32,targets=all-linear",
           "--base-format", fmt, "--seed", str(seed), "--steps", str(args.steps), "--seq", str(args.seq),
           "--micro-batch", str(args.micro_batch), "--accumulation", str(args.accumulation), "--lr", str(args.lr),
           "--warmup", "10", "--schedule", "cosine", "--clip", "1", "--metrics", str(metrics), "--work-dir",
           str(out / "work"), "--out", str(out / f"adapter-{fmt}-{seed}")]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [x["eval_loss"] for x in rows if "eval_loss" in x]
    print(f"  strider {fmt} seed {seed}: {time.time() - t0:.0f} s, held-out {evals[-1]:.4f}", flush=True)
    return evals[-1]


def peft_run(args, ft_ids, eval_ids, seed, out):
    """PEFT + torch AdamW over the exact base, bf16 autocast, on strider's batches of the same seed."""
    import peft
    import torch
    import transformers
    from strider.torch_reference import adamw_param_groups
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                      lora_dropout=0.0))
    opt = torch.optim.AdamW(adamw_param_groups(model, 0.01), lr=args.lr)
    m, acc = args.micro_batch, args.accumulation
    for step, b in enumerate(loader_batches(ft_ids, m * acc, args.seq, seed, args.steps)):
        lr = args.lr * step / 10 if step < 10 else \
            args.lr * 0.5 * (1 + math.cos(math.pi * (step - 10) / max(1, args.steps - 10)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = torch.from_numpy(b).long()
        for k in range(acc):
            chunk = x[k * m:(k + 1) * m]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=chunk[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
            (loss / acc).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    loss = heldout_loss(model.eval(), eval_ids, args)
    print(f"  peft+torch seed {seed}: held-out {loss:.4f}", flush=True)
    return loss


def quantized_copy(out, fmt):
    """The base as each format computes with it (tests/python/test_lora_base.py's definition)."""
    import torch
    import transformers
    from strider.torch_reference import quantized_round_trip
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    if fmt != "compute":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".layers." in name and p.dim() == 2:
                    p.copy_(torch.from_numpy(quantized_round_trip(p.numpy(), fmt)))
    return model.eval()


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("STRIDER_BUILD_DIR", args.build)
    from strider.data import write_token_file
    ids, chars = corpus_tokens(out, BASE_MODEL["vocab_size"])
    ids = np.asarray(ids, dtype=np.int64)
    half = len(ids) // 2
    base_ids, rest = ids[:half], ids[half:]
    eval_n = args.eval_batches * args.micro_batch * args.accumulation * args.seq + 1
    eval_ids, ft_ids = rest[:eval_n], rest[eval_n:]
    write_token_file(out / "ft.tokens", ft_ids, vocab_size=BASE_MODEL["vocab_size"])
    write_token_file(out / "eval.tokens", eval_ids, vocab_size=BASE_MODEL["vocab_size"])
    print(f"corpus: pydoc_data.topics, {chars} characters, {len(ids)} tokens: {len(base_ids)} for the base, "
          f"{len(ft_ids)} to adapt to, {len(eval_ids)} held out", flush=True)
    t0 = time.time()
    train_base(args, base_ids, out)
    print(f"base: {args.base_steps} steps from scratch in {time.time() - t0:.0f} s", flush=True)
    before = {f: heldout_loss(quantized_copy(out, f), eval_ids, args) for f in FORMATS}
    print("held-out loss of the base before adapting: " + ", ".join(f"{f} {v:.4f}" for f, v in before.items()))
    runs = {f: [strider_run(args, out, f, s) for s in range(1, args.seeds + 1)] for f in FORMATS}
    runs["peft+torch"] = [peft_run(args, ft_ids, eval_ids, s, out) for s in range(1, args.seeds + 1)]

    exact = runs["compute"]
    lo, hi, mean = min(exact), max(exact), sum(exact) / len(exact)
    rows = []
    print(f"\n| method | held-out loss, seeds 1..{args.seeds} | mean | vs exact base's mean | line |")
    print("| --- | --- | --- | --- | --- |")
    for name, xs in runs.items():
        m = sum(xs) / len(xs)
        ok = lo <= m <= hi or abs(m - mean) <= 0.01 * mean
        rows.append({"method": name, "losses": xs, "mean": m, "vs_exact": m / mean - 1, "within_line": ok,
                     "before": before.get(name)})
        print(f"| {name} | {', '.join(f'{x:.4f}' for x in xs)} | {m:.4f} | {100 * (m / mean - 1):+.2f}% | "
              f"{'inside' if ok else 'outside'} |")
    result = {"args": vars(args), "command": " ".join(sys.argv), "before": before, "rows": rows,
              "exact_band": [lo, hi], "exact_mean": mean}
    (out / "quality_base.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out / 'quality_base.json'}")


if __name__ == "__main__":
    main()
