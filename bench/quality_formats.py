#!/usr/bin/env python3
"""The optimizer-state formats on quality: loss curves of each compressed format
against fp32's noise band and against the peers a user would pick instead.

Part 1, the built-in model: `strider finetune` on its generated data, fp32 with
seeds 1..--seeds (the noise band: the seed sets the initial weights and the
data order) and each compressed format with seeds 1..--format-seeds.

Part 2, a small Hugging Face Llama built from a config and trained from scratch
on real text: CPython's own documentation (the `pydoc_data.topics` module every
Python ships), tokenized with a byte-level BPE tokenizer that the `tokenizers`
library trains on it here (nothing comes from a hub). A seed sets the initial
weights and the order of the batches; every run of one seed sees the same
batches in the same order:
  - strider.Engine, fp32 with seeds 1..--seeds, each compressed format with
    seeds 1..--format-seeds;
  - torch.optim.AdamW: the model resident in fp32, bf16 autocast, fused AdamW;
  - bitsandbytes' AdamW8bit (upstream's blockwise 8-bit Adam) in the same loop,
    when `import bitsandbytes` works (say where with --bnb-path), else the
    reason it did not is printed and recorded.
  The peers run seeds 1..--format-seeds too.
All runs use bf16 compute, exact global-norm clipping at 1.0, AdamW.

For each run: the final loss and the mean loss of the last 50 steps, and its
difference from the fp32 run of the same seed. The acceptance line of a format
(or peer), for both figures: the mean over its seeds inside the fp32 runs' band
(min..max over seeds) or within 1% of the fp32 mean over the same seeds,
whichever is wider (one run alone: inside the band or within 1% of the fp32
run of its seed). The mean over seeds, because one run's figure moves by more
than 1% with any change of rounding (runs that differ only in their last bits
drift apart within 100 steps): each single run's place against the line is
printed too. Prints the tables, writes --out/quality.json and --out/quality.png
(per method the mean curve over its seeds, fp32's band shaded; smoothed over 10
steps). A benchmark, not a test: it never fails on a figure.

    bench/quality_formats.py --out /tmp/quality              # both parts, 300 steps
    bench/quality_formats.py --part hf --steps 300 --bnb-path /tmp/bnb/site
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from figure_blocks import find_block, replace_block  # bench/ is the script's folder: on sys.path

REPO = Path(__file__).resolve().parents[1]
FORMATS = ["q8"]  # the compressed formats (host/state_format.h)

# The Hugging Face model of part 2: a Llama of ~1.4M parameters.
HF_MODEL = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=2048, max_position_embeddings=256, rms_norm_eps=1e-5,
                tie_word_embeddings=False, rope_theta=10000.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="quality-out", help="directory for quality.json, quality.png and the runs' logs")
    p.add_argument("--part", choices=["both", "builtin", "hf"], default="both")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3, help="fp32 runs (seeds 1..N) that make the noise band")
    p.add_argument("--format-seeds", type=int, default=0,
                   help="runs (seeds 1..N) of each compressed format and peer (0: --seeds; at most --seeds)")
    p.add_argument("--build", default=str(REPO / "build"), help="the build directory (strider, libstrider_ops)")
    p.add_argument("--bnb-path", default="", help="a directory to put on sys.path for bitsandbytes")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all)")
    # Part 2's shape and optimizer.
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--render-from", metavar="DIR", default="",
                   help="run nothing: rewrite --update-readme's block from DIR/quality.json (an earlier run's, "
                        "which records its own command line) and DIR/quality.png")
    p.add_argument("--update-readme", nargs="?", const="", metavar="README",
                   help="rewrite the <!-- figures:begin quality --> block from this run (both parts, 300+ steps), "
                        "where it is: in README.md (or README) or a docs/*.md beside it, and copy the plot to "
                        "bench/figures/quality_formats.png")
    return p.parse_args(argv)


def summary(losses):
    tail = losses[-50:]
    return {"final": losses[-1], "last50": sum(tail) / len(tail)}


def run_name(method, seed):
    return f"{method} seed {seed}"


# ---- part 1: the built-in model through the command line --------------------

def builtin_run(args, out, fmt, seed):
    metrics = out / f"builtin-{fmt}-seed{seed}.jsonl"
    metrics.unlink(missing_ok=True)  # --metrics appends
    cmd = [str(Path(args.build) / "strider"), "finetune", "--model", "builtin", "--device", "cpu", "--steps",
           str(args.steps), "--seed", str(seed), "--optimizer-state", fmt, "--eval-batches", "0", "--metrics",
           str(metrics), "--work-dir", str(out / "work"), "--out", str(out / f"builtin-{fmt}-seed{seed}")]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr}")
    losses = [json.loads(l)["loss"] for l in metrics.read_text().splitlines()]
    print(f"  builtin {fmt} seed {seed}: {len(losses)} steps in {time.time() - t0:.0f} s, final {losses[-1]:.4f}",
          flush=True)
    return losses


# ---- part 2: a Hugging Face model on real text -------------------------------

def corpus_tokens(out, vocab):
    """CPython's documentation topics, tokenized by a BPE tokenizer trained on them here."""
    import pydoc_data.topics
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    text = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    ids = []
    for t in text:
        ids.extend(tok.encode(t).ids)
    return ids, sum(len(t) for t in text)


def batches(ids, args, seed):
    """--steps batches of [micro_batch * accumulation, seq] windows of the token stream, in an order set by seed."""
    import torch
    n = args.micro_batch * args.accumulation
    windows = (len(ids) - 1) // args.seq
    stream = torch.tensor(ids[:windows * args.seq], dtype=torch.long).view(windows, args.seq)
    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(windows, generator=g) for _ in range(math.ceil(args.steps * n / windows) + 1)])
    return [stream[order[s * n:(s + 1) * n]] for s in range(args.steps)]


def make_model(seed):
    import torch
    import transformers
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_MODEL)).float()


def lr_at(args, step):
    """Linear warm-up, then cosine to 0 at --steps: strider's schedule (engine/config/lr_schedule.cpp), step from 0."""
    if step < args.warmup:
        return args.lr * step / max(1, args.warmup)
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * max(0.0, 0.5 * (1 + math.cos(math.pi * t)))


def strider_run(args, data, fmt, seed):
    import strider
    model = make_model(seed)
    cfg = strider.EngineConfig(seq=args.seq, micro_batch=args.micro_batch, accumulation=args.accumulation,
                               dtype="bf16", lr=args.lr, schedule="cosine", warmup_steps=args.warmup,
                               total_steps=args.steps, weight_decay=args.weight_decay, clip_norm=1.0,
                               device="cpu", optimizer_state=fmt, activations="recompute")
    engine = strider.Engine(model, cfg)
    losses = [engine.step(ids, ids.clone()).loss for ids in data]
    engine.finish()
    return losses


def torch_run(args, data, seed, optimizer):
    import torch
    from strider.torch_reference import adamw_param_groups
    model = make_model(seed)
    opt = optimizer(adamw_param_groups(model, args.weight_decay))  # the groups' decay wins over the optimizer's
    losses = []
    m = args.micro_batch
    for step, ids in enumerate(data):
        for group in opt.param_groups:
            group["lr"] = lr_at(args, step)
        total = 0.0
        for k in range(args.accumulation):
            chunk = ids[k * m:(k + 1) * m]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=chunk, labels=chunk).loss
            (loss / args.accumulation).backward()
            total += loss.item() / args.accumulation
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def hf_part(args, out):
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO / "python_shim"))
    os.environ.setdefault("STRIDER_BUILD_DIR", args.build)
    ids, chars = corpus_tokens(out, HF_MODEL["vocab_size"])
    print(f"  corpus: pydoc_data.topics, {chars} characters, {len(ids)} tokens (BPE, {HF_MODEL['vocab_size']} "
          f"vocabulary)", flush=True)
    runs = {}

    def timed(name, fn):
        t0 = time.time()
        runs[name] = fn()
        print(f"  hf {name}: {len(runs[name])} steps in {time.time() - t0:.0f} s, final {runs[name][-1]:.4f}",
              flush=True)

    data = {seed: batches(ids, args, seed) for seed in range(1, args.seeds + 1)}
    for seed in range(1, args.seeds + 1):
        timed(run_name("strider fp32", seed), lambda: strider_run(args, data[seed], "fp32", seed))
    for fmt in FORMATS:
        for seed in range(1, args.format_seeds + 1):
            timed(run_name(f"strider {fmt}", seed), lambda: strider_run(args, data[seed], fmt, seed))
    adamw = lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=args.weight_decay, fused=True)
    for seed in range(1, args.format_seeds + 1):
        timed(run_name("torch AdamW", seed), lambda: torch_run(args, data[seed], seed, adamw))
    peer = {"bitsandbytes": None}
    try:
        if args.bnb_path:
            sys.path.insert(0, args.bnb_path)
        import bitsandbytes as bnb
        peer["bitsandbytes"] = bnb.__version__
        adam8 = lambda ps: bnb.optim.AdamW8bit(ps, lr=args.lr, weight_decay=args.weight_decay)
        for seed in range(1, args.format_seeds + 1):
            timed(run_name("bitsandbytes AdamW8bit", seed), lambda: torch_run(args, data[seed], seed, adam8))
    except Exception as e:  # noqa: BLE001  (any failure to import or run is the reason to report)
        peer["bitsandbytes_error"] = f"{type(e).__name__}: {e}"
        print(f"  bitsandbytes not run: {peer['bitsandbytes_error']}", flush=True)
    return runs, peer


# ---- the verdicts ----------------------------------------------------------------

def methods(runs):
    """{method: [seeds]} of the run names, in order of first appearance."""
    out = {}
    for name in runs:
        method, seed = name.rsplit(" seed ", 1)
        out.setdefault(method, []).append(int(seed))
    return out


def mean(xs):
    return sum(xs) / len(xs)


def verdicts(runs, fp32="strider fp32"):
    """Per method other than fp32: the mean over its seeds of the final and last-50 losses, against fp32's band
    (min..max over all fp32 seeds) widened to 1% either side of fp32's mean over the same seeds; each run's
    difference from fp32's run of its seed; and each run's own place against the line."""
    by = methods(runs)
    fs = {seed: summary(runs[run_name(fp32, seed)]) for seed in by[fp32]}
    out = {"band": {k: (min(f[k] for f in fs.values()), max(f[k] for f in fs.values())) for k in ("final", "last50")},
           "methods": {}}
    for method, seeds in by.items():
        if method == fp32:
            continue
        if any(s not in fs for s in seeds):
            raise SystemExit(f"{method}: seeds {seeds}, but fp32 ran only {sorted(fs)}")
        sums = {s: summary(runs[run_name(method, s)]) for s in seeds}

        def line(k, value, ref_seeds=seeds):
            """(inside the line, relative to fp32's mean over ref_seeds, below the line: a lower loss than the
            line allows). A method's mean is held against fp32's mean over its seeds, one run against the fp32
            run of its own seed."""
            ref = mean([fs[s][k] for s in ref_seeds])
            lo, hi = out["band"][k]
            lo, hi = min(lo, ref * 0.99), max(hi, ref * 1.01)
            return lo <= value <= hi, value / ref - 1, value < lo

        agg = {k: mean([sums[s][k] for s in seeds]) for k in ("final", "last50")}
        inside = {k: line(k, agg[k])[0] for k in agg}
        out["methods"][method] = {
            "seeds": seeds, **agg, "inside": inside, "passes": all(inside.values()),
            "below": {k: line(k, agg[k])[2] for k in agg}, "vs_fp32": {k: line(k, agg[k])[1] for k in agg},
            "runs": {s: {**sums[s], "vs_fp32_same_seed": {k: sums[s][k] / fs[s][k] - 1 for k in sums[s]},
                         "inside": {k: line(k, sums[s][k], [s])[0] for k in sums[s]},
                         "below": {k: line(k, sums[s][k], [s])[2] for k in sums[s]}} for s in seeds}}
    return out


def line_text(inside, below=None):
    """'inside', or which of the two figures fell outside the line, and on which side: the line is two-sided (as
    the issue states it), but a loss below it is better than fp32's, not worse."""
    if all(inside.values()):
        return "inside"
    below = below or {}
    return ", ".join(f"{'final' if k == 'final' else 'last 50'} "
                     f"{'inside' if ok else ('outside (lower)' if below.get(k) else '**outside**')}"
                     for k, ok in inside.items())


def table(title, runs, v):
    print(f"\n{title}")
    print(f"  {'run':<36} {'final':>8} {'last 50':>8} {'vs fp32 of the seed':>22}  against the line")
    for name, losses in runs.items():
        s = summary(losses)
        method, seed = name.rsplit(" seed ", 1)
        r = v["methods"].get(method, {}).get("runs", {}).get(int(seed))
        rel = "" if r is None else "{final:+.2f}% / {last50:+.2f}%".format(
            **{k: x * 100 for k, x in r["vs_fp32_same_seed"].items()})
        print(f"  {name:<36} {s['final']:>8.4f} {s['last50']:>8.4f} {rel:>22}  "
              f"{'' if r is None else line_text(r['inside'], r['below']).replace('**', '')}")
    for method, m in v["methods"].items():
        print(f"  {method + ', mean of ' + str(len(m['seeds'])) + ' seeds':<36} {m['final']:>8.4f} {m['last50']:>8.4f}"
              f" {m['vs_fp32']['final'] * 100:+11.2f}% / {m['vs_fp32']['last50'] * 100:+.2f}%  "
              f"{'INSIDE the line' if m['passes'] else 'OUTSIDE the line: ' + line_text(m['inside'], m['below'])}")
    b = v["band"]
    print(f"  fp32 band: final {b['final'][0]:.4f}..{b['final'][1]:.4f}, last 50 {b['last50'][0]:.4f}..{b['last50'][1]:.4f}")


def smooth(losses, k=10):
    return [mean(losses[max(0, i - k + 1):i + 1]) for i in range(len(losses))]


def plot(parts, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(parts), figsize=(7 * len(parts), 4.5), squeeze=False)
    for ax, (title, runs) in zip(axes[0], parts):
        lows, highs = [], []
        for method, seeds in methods(runs).items():
            curves = [smooth(runs[run_name(method, s)]) for s in seeds]
            steps = range(1, len(curves[0]) + 1)
            avg = [mean(c) for c in zip(*curves)]
            if method == "strider fp32":
                ax.fill_between(steps, [min(c) for c in zip(*curves)], [max(c) for c in zip(*curves)],
                                color="0.8", label=f"fp32, min..max of {len(seeds)} seeds")
            ax.plot(steps, avg, "-", label=f"{method}, mean of {len(seeds)} seeds", linewidth=1.2)
            lows.append(min(min(c[len(c) // 3:]) for c in curves))
            highs.append(max(max(c[len(c) // 3:]) for c in curves))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (mean of 10 steps)")
        ax.legend(fontsize=8)
        ax.set_ylim(min(lows) - 0.05, max(highs) + 0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def readme_block(result, argv, image="bench/figures/quality_formats.png"):
    """The quality block: the command, then per part the table of each run's final and last-50 losses and
    each method's mean over its seeds against the line, then the plot (`image`: its path from the page)."""
    lines = [f"`.venv/bin/python bench/quality_formats.py {' '.join(argv)}` ({result['steps']} steps each; fp32 "
             f"seeds 1..{result['seeds']} give the band; each format and peer runs seeds 1..{result['format_seeds']}; "
             "the line: the mean over a method's seeds inside the band or within 1% of fp32's mean over the same "
             "seeds, whichever is wider; a run's difference is from the fp32 run of its seed):", ""]
    for part, title in (("builtin", "built-in model, generated data (`strider finetune`)"),
                        ("hf", "Hugging Face Llama from a config ("
                         f"{result.get('hf', {}).get('model', {}).get('num_hidden_layers', '?')} layers, hidden "
                         f"{result.get('hf', {}).get('model', {}).get('hidden_size', '?')}) on CPython's "
                         "documentation, BPE tokenizer trained here")):
        if part not in result:
            continue
        r = result[part]
        v = r["verdicts"]
        lines += [f"| {title} | final loss | mean of the last 50 | vs fp32 (final / last 50) | the line |",
                  "| --- | --- | --- | --- | --- |"]
        for name, losses in r["runs"].items():
            sm = summary(losses)
            method, seed = name.rsplit(" seed ", 1)
            per_seed = v["methods"].get(method, {}).get("runs", {})
            run = per_seed.get(seed, per_seed.get(int(seed)))  # read back from JSON, the keys are strings
            rel = "" if run is None else " / ".join(f"{run['vs_fp32_same_seed'][k] * 100:+.2f}%"
                                                    for k in ("final", "last50"))
            where = "" if run is None else f"(this run alone: {line_text(run['inside'], run['below'])})"
            lines.append(f"| {name} | {sm['final']:.4f} | {sm['last50']:.4f} | {rel} | {where} |")
        for method, m in v["methods"].items():
            lines.append(f"| **{method}, mean of seeds {', '.join(map(str, m['seeds']))}** | **{m['final']:.4f}** | "
                         f"**{m['last50']:.4f}** | {m['vs_fp32']['final'] * 100:+.2f}% / "
                         f"{m['vs_fp32']['last50'] * 100:+.2f}% | **{line_text(m['inside'], m['below'])}** |")
        b = v["band"]
        lines += ["", f"fp32's band: final {b['final'][0]:.4f}..{b['final'][1]:.4f}, last 50 "
                  f"{b['last50'][0]:.4f}..{b['last50'][1]:.4f}.", ""]
    peers = result.get("hf", {}).get("peers", {})
    if peers.get("bitsandbytes"):
        lines.append(f"bitsandbytes {peers['bitsandbytes']} (its CPU build, `AdamW8bit`) ran in the same loop as "
                     "torch's AdamW.")
    elif "bitsandbytes_error" in peers:
        lines.append(f"bitsandbytes did not run: {peers['bitsandbytes_error']}.")
    lines += ["", f"![loss curves of the formats]({image})"]
    return "\n".join(lines)


def plot_path(readme):
    """The plot's path as the page holding the quality block links it (from docs/*.md: ../bench/...)."""
    page, _ = find_block("quality", readme or None)
    return os.path.relpath(REPO / "bench" / "figures" / "quality_formats.png", page.parent)


def main(argv=None):
    args = parse_args(argv)
    if args.render_from:
        if args.update_readme is None:
            raise SystemExit("--render-from needs --update-readme README")
        src = Path(args.render_from)
        result = json.loads((src / "quality.json").read_text())
        for part in ("builtin", "hf"):  # the verdicts as this script draws the line (the runs are the record)
            if part in result:
                result[part]["verdicts"] = verdicts(result[part]["runs"])
        (REPO / "bench" / "figures").mkdir(exist_ok=True)
        (REPO / "bench" / "figures" / "quality_formats.png").write_bytes((src / "quality.png").read_bytes())
        replace_block("quality", readme_block(result, result["argv"], plot_path(args.update_readme)),
                      args.update_readme or None)
        return
    args.format_seeds = args.format_seeds or args.seeds
    if not 1 <= args.format_seeds <= args.seeds:
        raise SystemExit(f"--format-seeds {args.format_seeds}: between 1 and --seeds ({args.seeds}), so each run "
                         "has an fp32 run of its seed")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"bench": "quality_formats", "steps": args.steps, "seeds": args.seeds,
              "format_seeds": args.format_seeds, "formats": FORMATS,
              "argv": sys.argv[1:] if argv is None else list(argv)}
    parts = []
    if args.part in ("both", "builtin"):
        print(f"part 1: the built-in model, {args.steps} steps (strider finetune)", flush=True)
        runs = {}
        for seed in range(1, args.seeds + 1):
            runs[run_name("strider fp32", seed)] = builtin_run(args, out, "fp32", seed)
        for fmt in FORMATS:
            for seed in range(1, args.format_seeds + 1):
                runs[run_name(f"strider {fmt}", seed)] = builtin_run(args, out, fmt, seed)
        verdict = verdicts(runs)
        table("built-in model", runs, verdict)
        result["builtin"] = {"runs": runs, "verdicts": verdict}
        parts.append(("built-in model (generated data)", runs))
    if args.part in ("both", "hf"):
        print(f"part 2: a {HF_MODEL['num_hidden_layers']}-layer Llama from a config on CPython's documentation, "
              f"{args.steps} steps", flush=True)
        runs, peer = hf_part(args, out)
        verdict = verdicts(runs)
        table("Hugging Face Llama on real text", runs, verdict)
        result["hf"] = {"runs": runs, "verdicts": verdict, "peers": peer, "model": HF_MODEL,
                        "shape": {"seq": args.seq, "micro_batch": args.micro_batch,
                                  "accumulation": args.accumulation, "lr": args.lr, "warmup": args.warmup}}
        parts.append(("HF Llama on CPython docs", runs))
    (out / "quality.json").write_text(json.dumps(result))
    try:
        plot(parts, out / "quality.png")
        print(f"\nwrote {out / 'quality.json'} and {out / 'quality.png'}")
    except ImportError as e:
        print(f"\nwrote {out / 'quality.json'} (no plot: {e})")
    if args.update_readme is not None:
        if args.part != "both" or args.steps < 300:
            raise SystemExit("--update-readme: the README quotes both parts at 300 steps or more")
        (REPO / "bench" / "figures").mkdir(exist_ok=True)
        (REPO / "bench" / "figures" / "quality_formats.png").write_bytes((out / "quality.png").read_bytes())
        replace_block("quality", readme_block(result, result["argv"], plot_path(args.update_readme)),
                      args.update_readme or None)
        print("updated bench/figures/quality_formats.png")
    print(json.dumps({k: v for k, v in result.items() if k in ("bench", "steps")} |
                     {p: {n: v["passes"] for n, v in result[p]["verdicts"]["methods"].items()}
                      for p in ("builtin", "hf") if p in result}))


if __name__ == "__main__":
    main()
