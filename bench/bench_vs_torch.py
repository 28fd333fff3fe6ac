#!/usr/bin/env python3
"""strider against plain PyTorch: the same Hugging Face model, the same batches
and hyper-parameters, trained two ways in one run, interleaved.

- torch: the model resident in fp32, forward and backward under autocast to
  the compute dtype, exact global-norm clipping, torch.optim.AdamW(fused=True).
- strider: strider.Engine on a copy of the same model, offloaded to a window
  of K cache units on the device (the CPU device by default: its copies are
  real memcpys), CPU AdamW on fp32 masters, the same clipping.

With --device cuda the torch side's model, batches and optimizer live on the
GPU (autocast on CUDA, fused AdamW on the GPU) and strider runs on the CUDA
device; both still use the same thread count on the host.

Each side lives in its own worker process (so each has its own peak RSS and
neither's memory or threads disturb the other), with the same thread count.
The parent runs rounds: in each, one side runs `--steps-per-round` steps, then
the other (the order alternating round by round), so that the machine's noise
falls on both. Both sides see the same batch at the same step, so their
losses compare step by step.

Prints each round's tokens/s for both, both peak RSS, each step's loss for
both, and one JSON line: strider_over_torch is the median over rounds of
strider's tokens/s divided by torch's in the same round; loss_max_rel_diff the
largest relative difference of a step's loss. A figure, never pass/fail.

    bench/bench_vs_torch.py                        # the default: ~135M Llama, 49152 vocabulary
    bench/bench_vs_torch.py --model DIR --cli --window 0   # a real checkpoint, the command line on it too,
                                                           # both at the window the plan chooses
    bench/bench_vs_torch.py --rounds 5 --window 2 --activations auto
    bench/bench_vs_torch.py --device cuda          # on a GPU (gpu_check/gpu_check.sh runs it there)
    bench/bench_vs_torch.py --arch qwen3_moe --layers 8                # a ~92M mixture of experts
    bench/bench_vs_torch.py --arch qwen2_moe --layers 8                # the same with a shared expert

With --model DIR both sides train that Hugging Face checkpoint's weights (a
real one: bench/smollm2_finetune.py --prepare-only makes SmolLM2-135M-Instruct).
--cli adds a side in the same rounds: `strider profile` on DIR in a process of
its own (random tokens from a token file, the same shape, window and thread
count), timed by its own measured steps; cli_over_torch is the median over
rounds of its tokens/s over torch's.

With --lora R both sides train LoRA adapters of rank R (alpha 2R, every decoder
layer's linear modules) over a frozen base: torch is PEFT + torch.optim.AdamW
over the adapters, strider is strider.Engine on the same PEFT model. A third
side, strider training every parameter of the same model on the same batches,
runs in the same rounds: lora_over_full is the median over rounds of the LoRA
step's time divided by the full step's.

With --docs N each row packs N documents (random cuts; position_ids restart at
each, a document's first token is no target): strider trains with
packed_documents, transformers with the same packed position_ids (its SDPA
path then gets a block-diagonal mask), so both keep documents apart.
"""
import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A SmolLM-135M-shaped Llama (hidden 576, 30 layers, GQA 9/3, tied, vocabulary 49152).
MODEL_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, rope_theta=10000.0)


# --arch: each architecture's config class, and what its shape adds to the Llama one (transformers'
# defaults otherwise: Gemma 2's soft-capping at 50 and 30, Gemma's sliding windows of 4096). The
# mixtures of experts route without the load-balancing loss (output_router_logits off, their
# default): Qwen3-MoE 16 experts of intermediate 256, top 4 renormalised (--layers 8: ~92M
# parameters, 35M active); Mixtral 8 experts of --intermediate, top 2 (--layers 4: ~113M); Qwen2-MoE
# Qwen3-MoE's experts, top 4 not renormalised, and a shared expert of 1024.
ARCHS = {"llama": ("LlamaConfig", {}), "olmo2": ("Olmo2Config", {}),
         "gemma2": ("Gemma2Config", {"query_pre_attn_scalar": 64}),
         "gemma3": ("Gemma3TextConfig", {"query_pre_attn_scalar": 64}),
         "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
                                          "norm_topk_prob": True, "output_router_logits": False}),
         "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2,
                                       "output_router_logits": False}),
         "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
                                          "shared_expert_intermediate_size": 1024, "output_router_logits": False})}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (>= 5 for a median worth quoting)")
    p.add_argument("--steps-per-round", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=1, help="steps each side runs before the first round")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--window", type=int, default=2, help="strider's K (cache units); 0: the plan chooses, as "
                   "strider.Engine and strider finetune do by default")
    p.add_argument("--activations", default=None,
                   help="strider's activation mode (recompute, saved, auto); default: the engine's default")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where both sides compute: the CPU (strider's CPU device) or the GPU")
    p.add_argument("--threads", type=int, default=0, help="intra-op and optimizer threads, both sides; 0: all cores")
    p.add_argument("--layers", type=int, default=MODEL_135M["num_hidden_layers"], help="decoder layers")
    p.add_argument("--hidden", type=int, default=MODEL_135M["hidden_size"])
    p.add_argument("--intermediate", type=int, default=MODEL_135M["intermediate_size"])
    p.add_argument("--vocab", type=int, default=MODEL_135M["vocab_size"])
    p.add_argument("--model", default="",
                   help="a Hugging Face checkpoint folder (config.json and safetensors): its weights and shape "
                        "instead of a random model of --arch (--layers, --hidden, --intermediate, --vocab are read "
                        "from it)")
    p.add_argument("--cli", action="store_true",
                   help="with --model: a third side, `strider profile` on the same checkpoint in each round (its "
                        "own process, random tokens from a token file, the same shape, window and threads; its "
                        "measured steps after one untimed)")
    p.add_argument("--arch", choices=sorted(ARCHS), default="llama",
                   help="the architecture of the same shape (torch's attention: SDPA, or eager for gemma2)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--device-budget", default="8GiB", help="strider's device budget (the CPU device's memory)")
    p.add_argument("--lora", type=int, default=0,
                   help="rank of LoRA adapters on every linear module of the decoder layers (PEFT on both sides), "
                        "and a third side training the full model; 0: full training only")
    p.add_argument("--docs", type=int, default=0,
                   help="rows pack this many documents of random lengths (position_ids restarting at each): "
                        "strider with packed_documents, transformers with the same packed position_ids; 0: one "
                        "sequence a row")
    p.add_argument("--json-out", default="", help="also write the JSON line to this file")
    p.add_argument("--toy", action="store_true",
                   help="a 1-layer, 78K-parameter cut (seq 32, 1 step per round): checks the bench itself in seconds")
    a = p.parse_args(argv)
    if a.toy:
        a.layers, a.hidden, a.intermediate, a.vocab, a.seq, a.steps_per_round = 1, 72, 128, 512, 32, 1
    if a.model:
        if a.toy:
            p.error("--model and --toy: --toy cuts a random model")
        config = Path(a.model) / "config.json"
        if not config.is_file():
            p.error(f"--model {a.model}: no config.json there")
        c = json.loads(config.read_text())
        c = c.get("text_config", c)
        a.arch = c.get("model_type", a.arch)
        a.layers, a.hidden = c["num_hidden_layers"], c["hidden_size"]
        a.intermediate, a.vocab = c.get("intermediate_size", 0), c["vocab_size"]
    if a.cli and not a.model:
        p.error("--cli needs --model: the command line trains a checkpoint folder")
    if a.cli and (a.lora or a.docs):
        p.error("--cli: full training of unpacked rows only")
    return a


def model_config(a):
    import transformers
    cls, extra = ARCHS[a.arch]
    cfg = dict(MODEL_135M, num_hidden_layers=a.layers, hidden_size=a.hidden, intermediate_size=a.intermediate,
               vocab_size=a.vocab, **extra)
    if a.arch.startswith("gemma"):  # Gemma names its head size and takes no rope_theta of the Llama shape
        cfg.update(head_dim=a.hidden // cfg["num_attention_heads"])
        cfg.pop("rope_theta")
    if a.arch == "qwen3_moe":  # Qwen3 names its head size (its default is 128)
        cfg.update(head_dim=a.hidden // cfg["num_attention_heads"])
    c = getattr(transformers, cls)(**cfg)
    c._attn_implementation = "eager" if a.arch == "gemma2" else "sdpa"  # transformers: no SDPA soft-caps
    return c


def make_batches(a, count):
    import torch
    g = torch.Generator().manual_seed(1234)
    batch = a.micro_batch * a.accumulation
    out = []
    for _ in range(count):
        ids = torch.randint(0, a.vocab, (batch, a.seq), generator=g)
        labels = ids.clone()
        if not a.docs:
            out.append((ids, labels, None))
            continue
        # a.docs documents a row, cut at random points; a document's first token is no target.
        from strider.torch_reference import packed_position_ids
        rows = []
        for _ in range(batch):
            cuts = sorted(torch.randperm(a.seq - 1, generator=g)[:a.docs - 1].add(1).tolist())
            rows.append([e - s for s, e in zip([0] + cuts, cuts + [a.seq])])
        pos = packed_position_ids(rows)
        labels[pos == 0] = -100
        out.append((ids, labels, pos))
    return out


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class TorchSide:
    """Plain PyTorch: resident fp32 model, autocast, fused AdamW, exact clipping."""

    def __init__(self, a, model):
        import torch
        self.torch, self.a, self.model = torch, a, model
        from strider.torch_reference import adamw_param_groups  # the Trainer's groups, as strider decays
        # A PEFT model: its trainable parameters only (the adapters), as PEFT + a Trainer would train them.
        groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in adamw_param_groups(model, 0.1)]
        self.trained = [p for g in groups for p in g["params"]]
        self.opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
        self.dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32

    def step(self, ids, labels, pos):
        torch, a = self.torch, self.a
        ids, labels = ids.to(a.device), labels.to(a.device)
        mb = a.micro_batch
        # The engine's loss: the mean over the batch's valid tokens (labels shifted as HF does).
        valid = int((labels[:, 1:] != -100).sum())
        total = 0.0
        for m in range(a.accumulation):
            i, l = ids[m * mb:(m + 1) * mb], labels[m * mb:(m + 1) * mb]
            # Packed rows: position_ids without a cache, so that transformers masks per document.
            docs = {} if pos is None else dict(position_ids=pos[m * mb:(m + 1) * mb].to(a.device), use_cache=False)
            with torch.autocast(a.device, dtype=self.dtype, enabled=self.dtype != torch.float32):
                logits = self.model(input_ids=i, **docs).logits
            loss_sum = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)),
                                                         l[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
            (loss_sum / valid).backward()
            total += float(loss_sum)
            del logits, loss_sum
        torch.nn.utils.clip_grad_norm_(self.trained, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total / valid

    def finish(self):
        if self.a.device == "cuda":
            self.torch.cuda.synchronize()  # the optimizer's kernels belong to the step's time


class StriderSide:
    def __init__(self, a, model):
        import strider
        over = {} if a.activations is None else {"activations": a.activations}
        cfg = strider.EngineConfig(seq=a.seq, micro_batch=a.micro_batch, accumulation=a.accumulation,
                                   window=a.window, dtype=a.dtype, lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                                   weight_decay=0.1, clip_norm=1.0, optimizer_threads=a.threads, device=a.device,
                                   device_budget=a.device_budget, packed_documents=a.docs > 0, **over)
        self.engine = strider.Engine(model, cfg)
        self.window = self.engine.plan()["window"]  # the K it runs with (the plan's, for window 0)

    def step(self, ids, labels, pos):
        return self.engine.step(ids, labels, position_ids=pos).loss

    def finish(self):
        self.engine.finish()


def worker(side, a, conn):
    import torch
    import transformers
    sys.path.insert(0, str(REPO / "python_shim"))
    threads = a.threads or os.cpu_count()
    torch.set_num_threads(threads)
    a.threads = threads
    torch.manual_seed(0)
    if a.model:  # the checkpoint's weights in fp32, as the random model's; SDPA as model_config sets it
        model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                                                  attn_implementation="sdpa")
    else:
        model = transformers.AutoModelForCausalLM.from_config(model_config(a)).float()
    params = sum(p.numel() for p in model.parameters())
    if a.lora and side != "strider_full":
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=a.lora, lora_alpha=2 * a.lora, lora_dropout=0.0,
                                                           target_modules="all-linear", task_type="CAUSAL_LM"))
    if side == "torch":
        model.to(a.device)  # strider takes the model on the CPU and streams it to the device itself
    runner = TorchSide(a, model) if side == "torch" else StriderSide(a, model)
    total_steps = a.warmup_steps + a.rounds * a.steps_per_round
    batches = make_batches(a, total_steps)
    done = 0
    conn.send({"params": params, "threads": threads, "window": getattr(runner, "window", None)})
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        n = int(msg)
        losses = []
        t0 = time.perf_counter()
        for _ in range(n):
            losses.append(runner.step(*batches[done]))
            done += 1
        runner.finish()  # the step's updates belong to its time
        elapsed = time.perf_counter() - t0
        conn.send({"seconds": elapsed, "losses": losses, "peak_rss": peak_rss_bytes()})
    conn.close()


class CliSide:
    """`strider profile` on the --model checkpoint, a process per round: the command line's own loading,
    plan and step, timed by its measured steps (after --warmup-steps untimed ones, at least 1)."""

    def __init__(self, a, threads, work):
        import numpy as np
        sys.path.insert(0, str(REPO / "python_shim"))
        from strider.data import write_token_file
        self.a, self.threads, self.work = a, threads, Path(work)
        self.tokens = self.work / "random.tokens"
        rows = (a.warmup_steps + a.rounds * a.steps_per_round + 2) * a.micro_batch * a.accumulation
        ids = np.random.default_rng(1234).integers(0, a.vocab, rows * (a.seq + 1))
        write_token_file(self.tokens, ids, vocab_size=a.vocab)  # one document: no packed rows
        self.strider = os.environ.get("STRIDER_BUILD_DIR", str(REPO / "build")) + "/strider"

    def run(self, n):
        a = self.a
        cmd = [self.strider, "profile", "--model", a.model, "--data", str(self.tokens), "--seq", str(a.seq),
               "--micro-batch", str(a.micro_batch), "--accumulation", str(a.accumulation), "--window", str(a.window),
               "--dtype", a.dtype, "--lr", str(a.lr), "--weight-decay", "0.1", "--clip", "1", "--device", a.device,
               "--device-budget", a.device_budget, "--optimizer-threads", str(self.threads),
               "--skip-steps", str(max(1, a.warmup_steps)), "--steps", str(n), "--json",
               "--out", str(self.work / "profile"), "--work-dir", str(self.work)]
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads))
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"bench_vs_torch: {' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
        d = json.loads(done.stdout)
        return {"seconds": n * d["step_s"], "losses": [], "window": d["window"]}


def main(argv=None):
    a = parse_args(argv)
    ctx = mp.get_context("spawn")
    procs, conns = {}, {}
    sides = ("torch", "strider", "strider_full") if a.lora else ("torch", "strider")
    for side in sides:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=worker, args=(side, a, child), daemon=True)
        p.start()
        procs[side], conns[side] = p, parent
    info = {side: conns[side].recv() for side in conns}
    cli_work = tempfile.TemporaryDirectory(prefix="bench-vs-torch-cli-") if a.cli else None
    cli = CliSide(a, info["torch"]["threads"], cli_work.name) if a.cli else None
    window = info["strider"]["window"]
    timed = sides + ("strider_cli",) if a.cli else sides
    tokens_per_step = a.micro_batch * a.accumulation * a.seq
    print(f"model: {a.model + ' ' if a.model else ''}{a.arch} {info['torch']['params'] / 1e6:.1f}M parameters ({a.layers} layers, hidden {a.hidden}, "
          f"vocabulary {a.vocab}); batch {a.micro_batch} x {a.accumulation} x seq {a.seq}, {a.dtype}, "
          f"{info['torch']['threads']} threads; strider K = {window}{'' if a.window else ' (the plan' + chr(39) + 's)'}, activations "
          f"{a.activations or 'default'}, {'CPU device' if a.device == 'cpu' else 'on the GPU'}"
          + (f"; LoRA rank {a.lora} (torch: PEFT), strider_full: every parameter" if a.lora else "")
          + (f"; {a.docs} documents a row (packed position_ids)" if a.docs else "")
          + ("; strider_cli: `strider profile` on the checkpoint, each round" if a.cli else ""), flush=True)

    def run(side, n):
        if side == "strider_cli":
            return cli.run(n)
        conns[side].send(n)
        return conns[side].recv()

    losses = {side: [] for side in sides}
    if a.warmup_steps:
        for side in conns:
            losses[side] += run(side, a.warmup_steps)["losses"]
    ratios, lora_full, cli_ratios, tps = [], [], [], {side: [] for side in timed}
    rss = {}
    for r in range(a.rounds):
        order = timed if r % 2 == 0 else tuple(reversed(timed))
        got = {side: run(side, a.steps_per_round) for side in order}
        for side in order:
            tps[side].append(a.steps_per_round * tokens_per_step / got[side]["seconds"])
            if side in conns:
                losses[side] += got[side]["losses"]
                rss[side] = got[side]["peak_rss"]
        ratios.append(tps["strider"][-1] / tps["torch"][-1])
        line = (f"round {r + 1}: torch {tps['torch'][-1]:.0f} tokens/s, strider {tps['strider'][-1]:.0f} tokens/s, "
                f"strider/torch {ratios[-1]:.3f}")
        if a.cli:
            cli_ratios.append(tps["strider_cli"][-1] / tps["torch"][-1])
            line += (f", strider CLI {tps['strider_cli'][-1]:.0f} tokens/s (K = {got['strider_cli']['window']}), "
                     f"CLI/torch {cli_ratios[-1]:.3f}")
        if a.lora:  # time per step: LoRA's over full training's
            lora_full.append(tps["strider_full"][-1] / tps["strider"][-1])
            line += f", strider full {tps['strider_full'][-1]:.0f} tokens/s, LoRA step / full step {lora_full[-1]:.3f}"
        print(line, flush=True)
    for side in conns:
        conns[side].send("stop")
        procs[side].join(timeout=60)

    rel = [abs(s - t) / abs(t) for s, t in zip(losses["strider"], losses["torch"])]
    for i, (t, s) in enumerate(zip(losses["torch"], losses["strider"])):
        print(f"step {i + 1}: loss torch {t:.5f} strider {s:.5f} (rel diff {rel[i]:.2e})")
    print(f"peak RSS: torch {rss['torch'] / 2**30:.2f} GiB, strider {rss['strider'] / 2**30:.2f} GiB")
    result = dict(bench="vs_torch", device=a.device, params=info["torch"]["params"], seq=a.seq, micro_batch=a.micro_batch,
                  accumulation=a.accumulation, dtype=a.dtype, window=window, window_asked=a.window, model=a.model,
                  activations=a.activations or "default", threads=info["torch"]["threads"], rounds=a.rounds,
                  torch_tokens_per_s=statistics.median(tps["torch"]),
                  strider_tokens_per_s=statistics.median(tps["strider"]),
                  strider_over_torch=statistics.median(ratios), ratios=[round(x, 4) for x in ratios],
                  torch_peak_rss_bytes=rss["torch"], strider_peak_rss_bytes=rss["strider"],
                  loss_max_rel_diff=max(rel), steps=len(rel), lora=a.lora, arch=a.arch, docs=a.docs)
    if a.lora:
        result.update(strider_full_tokens_per_s=statistics.median(tps["strider_full"]),
                      lora_over_full=statistics.median(lora_full), lora_over_full_rounds=[round(x, 4) for x in lora_full],
                      strider_full_peak_rss_bytes=rss["strider_full"])
    if a.cli:
        result.update(strider_cli_tokens_per_s=statistics.median(tps["strider_cli"]),
                      cli_over_torch=statistics.median(cli_ratios), cli_ratios=[round(x, 4) for x in cli_ratios])
    if cli_work:
        cli_work.cleanup()
    line = json.dumps(result)
    print(line)
    if a.json_out:
        Path(a.json_out).write_text(line + "\n")


if __name__ == "__main__":
    main()
