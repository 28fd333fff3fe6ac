#!/usr/bin/env python3
"""The figures half of bench/readme_figures.sh: reads the log folder that the
script filled (one NAME.log per command, commands.tsv with each command's exit
status and wall time, machine.json), extracts every figure the pages quote
(bench/readme_extract.py: which commands make up each part, and how each one's
figures are read), prints the figures report and, on request, rewrites the
figure blocks that bench/figure_blocks.py finds in README.md and docs/*.md.

    readme_figures.py LOGS [--parts P1,P2] [--check] [--update-readme README]

Figures come from the JSON the tools print (the benches' last line, `strider
plan --json`, `strider profile --json`, `strider finetune --metrics`), but for
four demo figures that `strider finetune` prints only as text (readme_extract's
demo_text_figures) and the predict scripts' blocks, taken whole from their logs.
BLOCKS renders each block this script writes; figure_blocks.COMMANDS names the
command of every other.
"""
import argparse
import json
import math
import sys
import textwrap
from pathlib import Path

from figure_blocks import COMMANDS, blocks, pages, replace_block
from readme_extract import EXTRACT, PARTS, PLAN_8B, PLAN_LORA, PLAN_Q8, PREDICT_BLOCKS

# ---- reading the log folder ---------------------------------------------------------


class Logs:
    def __init__(self, folder: Path):
        self.folder = folder
        self.commands = {}  # name -> {cmd, rc, expected_rc, wall_s}
        tsv = folder / "commands.tsv"
        if tsv.exists():
            for line in tsv.read_text().splitlines():
                name, rc, expected, wall, cmd = line.split("\t", 4)
                self.commands[name] = {"cmd": cmd, "rc": int(rc), "expected_rc": int(expected),
                                       "wall_s": float(wall)}
        m = folder / "machine.json"
        self.machine = json.loads(m.read_text()) if m.exists() else {}

    def text(self, name):
        p = self.folder / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else None

    def last_json(self, name, key=None):
        """The last line of NAME.log that is a JSON object (holding `key`, if given)."""
        text = self.text(name)
        if text is None:
            return None
        for line in reversed(text.splitlines()):
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and (key is None or key in obj):
                return obj
        return None

    def json_lines(self, path):
        p = self.folder / path
        if not p.exists():
            return []
        return [json.loads(l) for l in p.read_text().splitlines() if l.strip().startswith("{")]


class Figures:
    """Figures by name, each with the command (a name in Logs.commands) that printed it."""

    def __init__(self):
        self.values = {}
        self.source = {}

    def put(self, name, value, command):
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return
        self.values[name] = value
        self.source[name] = command

    def __getitem__(self, name):
        return self.values[name]

    def __contains__(self, name):
        return name in self.values


# ---- the README's blocks ------------------------------------------------------------------


def slash(xs):
    return "/".join(str(x) for x in xs)


def prose(text):
    """A paragraph wrapped as the README's own prose is (at whitespace only:
    `--clip 0` stays whole)."""
    return textwrap.fill(text, width=80, break_long_words=False, break_on_hyphens=False)


def block_machine(f, logs):
    m = logs.machine
    return prose(f"Figures of one run of `bench/readme_figures.sh` on {m['date']}, at commit {m['commit']}, on "
                 f"{m['nproc']} cores (`nproc`) of an {m['cpu_model']} (AdamW kernel: {f['adam.isa']}), "
                 f"{m['mem_gib']:.0f} GiB of RAM, {m['tmp_disk']}, {m.get('gpu') or 'no GPU'}.")


def block_demo_model(f, logs):
    return f"a {f['profile.params'] / 1e6:.1f}M-parameter"


def block_demo_plan(f, logs):
    return f"a window of K = {f['demo.window']} cache units over {f['demo.blocks']} blocks"


def block_profile(f, logs):
    crit = f["profile.critical_lane"]
    lanes = ", ".join(f"{lane} {f[f'profile.{lane}_pct']:.1f}%{' (critical)' if lane == crit else ''}"
                      for lane in ("compute", "h2d", "d2h", "optimizer"))
    if crit not in ("compute", "h2d", "d2h", "optimizer"):
        lanes += f", critical lane {crit}"
    return prose(f"On the built-in model (`{cmd(logs, 'profile')}`): step {f['profile.step_s']:.3f} s, "
                 f"{lanes}, overlap efficiency {f['profile.overlap_efficiency']:.3f}, "
                 f"{f['profile.model_gflops']:.3g} GFLOP/s by 6·N·tokens, "
                 f"{f['profile.executed_gflops']:.3g} GFLOP/s executed.")


def block_measured(f, logs):
    rows = [
        ("CPU AdamW vs the memory roofline (best of a STREAM triad, an in-place update and our own access "
         f"pattern with trivial arithmetic), {slash(f['adam.params_m'])}M params, {slash(f['adam.threads'])} "
         "threads",
         "bench_adam",
         f"{f['adam.roofline_ratio_min']:.3f}-{f['adam.roofline_ratio_max']:.3f} of the roofline"),
        ("CPU AdamW (fp32 grad in, bf16 copy out: torch's work) vs torch `_fused_adamw_` + bf16 cast, same threads",
         "bench_adam",
         f"{f['adam.vs_torch_min']:.2f}-{f['adam.vs_torch_max']:.2f}x torch's speed"),
        ("CPU AdamW (the same fp32 work) vs DeepSpeed's CPUAdam (`DeepSpeedCPUAdam`, its AVX kernel on OpenMP) + "
         "bf16 cast, same threads",
         "bench_adam",
         f"{f['adam.vs_deepspeed_min']:.2f}-{f['adam.vs_deepspeed_max']:.2f}x DeepSpeed {f['adam.deepspeed']}'s speed"
         if "adam.deepspeed" in f else f"not run: {f['adam.deepspeed_error']}"),
        ("CPU AdamW in the q8 optimizer-state format (bf16 grad in; 12.1 B per parameter moved), same sizes and "
         "threads",
         "bench_adam",
         f"{f['adam.q8_mparams_min']:.0f}-{f['adam.q8_mparams_max']:.0f} M params/s (fp32 format: "
         f"{f['adam.fp32_mparams_min']:.0f}-{f['adam.fp32_mparams_max']:.0f}), {f['adam.q8_roofline_min']:.2f}-"
         f"{f['adam.q8_roofline_max']:.2f} of the roofline: compute-bound on this CPU; "
         f"{f['adam.q8_speedup_min']:.2f}-{f['adam.q8_speedup_max']:.2f}x the kernel it replaced (its loops as the "
         f"compiler vectorizes them: {f['adam.q8_loops_mparams_min']:.0f}-{f['adam.q8_loops_mparams_max']:.0f} M "
         f"params/s), {f['adam.isa']}"),
        ("NvmeStore vs fio (io_uring, O_DIRECT, fixed buffers, both on huge pages with fio-sized buffer memory, "
         "the store's caller resubmitting from completion callbacks as fio does), "
         f"{f['nvme.size_gib']:g} GiB, chunks {slash(f['nvme.chunks_mib'])} MiB x depths "
         f"{slash(f['nvme.depths'])}, median of {f['nvme.pairs']} interleaved store/fio pairs per "
         "configuration, every byte XXH3-checksummed by the store",
         "bench_nvme",
         f"lowest median over the {f['nvme.configs']} configurations: write {f['nvme.write_vs_fio']:.3f}, "
         f"read {f['nvme.read_vs_fio']:.3f} (highest: write {f['nvme.write_median_max']:.3f}, read "
         f"{f['nvme.read_median_max']:.3f}); fio against itself varies up to "
         f"{max(f['nvme.fio_write_max_over_min'], f['nvme.fio_read_max_over_min']):.2f}x between passes"),
        ("NvmeStore vs fio on compute copies' pattern: extents of "
         f"{f['nvme_extents.extent_mib']:.0f} MiB (a layer's), {f['nvme_extents.inflight']} in flight (one visit "
         f"ahead), chunks {f['nvme_extents.chunk_mib']} MiB x depth {f['nvme_extents.depth']}, median of "
         f"{f['nvme_extents.pairs']} pairs",
         "bench_nvme_extents",
         f"read {f['nvme_extents.read_vs_fio']:.3f} of fio ({f['nvme_extents.store_read_gbs']:.2f} against "
         f"{f['nvme_extents.fio_read_gbs']:.2f} GB/s), write {f['nvme_extents.write_vs_fio']:.3f}"),
        (f"strider vs plain PyTorch (transformers, resident, autocast bf16, fused AdamW, exact clipping) on the "
         f"same {f['torch.params_m']:.0f}M Llama (vocabulary 49152) and batches: micro-batch "
         f"{f['torch.micro_batch']} x accumulation {f['torch.accumulation']} x seq {f['torch.seq']}, bf16, "
         f"{f['torch.threads']} threads; strider at K = {f['torch.window']} on the CPU device, its default "
         f"activation choice; median of {f['torch.rounds']} interleaved rounds",
         "bench_vs_torch",
         f"strider/torch tokens/s {f['torch.strider_over_torch']:.3f} ({f['torch.ratio_min']:.2f}-"
         f"{f['torch.ratio_max']:.2f} over the rounds; {f['torch.strider_tokens_per_s']:.1f} vs "
         f"{f['torch.torch_tokens_per_s']:.1f}); every step's loss within {f['torch.loss_max_rel_diff']:.1e} "
         f"relative over {f['torch.steps']} steps; peak RSS {f['torch.strider_rss_gib']:.2f} vs "
         f"{f['torch.torch_rss_gib']:.2f} GiB"),
        ("Diagnostic, not a comparison with a peer: the offloaded step (K=2 of 8 blocks, host checkpoints) vs "
         "strider itself with every block resident (the same copies and schedule), CPU device",
         "bench_step",
         f"{f['step.offload_over_resident']:.3f}x the resident step; overlap efficiency "
         f"{f['step.overlap_efficiency']:.2f} ({f['step.critical_lane']} the critical lane)"),
        ("The simulator fed with the CPU device's isolated costs (compute per op kind, copies, AdamW) vs the CPU "
         f"device's measured step, built-in model offloaded, accumulation {slash(f['calibrate.accumulations'])}",
         "bench_calibrate",
         f"predicted/measured {f['calibrate.ratio']:.3f} (accumulation {f['calibrate.accumulations'][0]}), "
         f"{f['calibrate.ratio_min']:.2f}-{f['calibrate.ratio_max']:.2f} over the {len(f['calibrate.accumulations'])} "
         "(target: within 15%)"),
        (f"The demo: built-in model, {f['demo.steps']} steps",
         "demo",
         f"train loss {f['demo.train_loss_first']:.2f} -> {f['demo.train_loss_last']:.2f}, held-out "
         f"{f['demo.eval_loss_before']:.2f} -> {f['demo.eval_loss_last']:.2f}, {f['demo.wall_s']:.0f} s, "
         f"{f['demo.tokens_per_s_min']:.0f}-{f['demo.tokens_per_s_max']:.0f} tokens/s (median "
         f"{f['demo.tokens_per_s_median']:.0f}), peak device {f['demo.peak_device_mib']:.1f} MiB of a "
         f"{f['demo.device_budget_mib']:g} MiB budget"),
    ]
    out = ["| what | command | figure |", "| --- | --- | --- |"]
    for what, c, fig in rows:
        shown = f"`scripts/demo.sh` (`{cmd(logs, c)}`)" if c == "demo" else f"`{cmd(logs, c)}`"
        out.append(f"| {what} | {shown} | {fig} |")
    return "\n".join(out)


# SlideFormer's records of DeepSpeed ZeRO-3 offload on an RTX 4090 (tokens/s),
# and SlideFormer's own figure (Qwen3-8B, batch 64, one RTX 4090): published
# comparisons, not figures of ours, so they are quoted as they stand.
DEEPSPEED_4090 = {8: 914, 16: 1373, 32: 1791}
SLIDEFORMER_4090 = {64: 2398}


def block_predict_8b(f, logs):
    out = ["| batch | strider predicted tokens/s | compute-bound limit (the lower bound) | kept activations "
           "(`--activations auto`) | DeepSpeed ZeRO-3 offload, RTX 4090 (SlideFormer's records) | SlideFormer, "
           "RTX 4090 (Qwen3-8B) |", "| --- | --- | --- | --- | --- | --- |"]
    for b in PLAN_8B:
        p = f"predict.8b.b{b}"
        kept = (f"{f[p + '.saved_layers']} of {f['predict.8b.layers']} layers "
                f"({f[p + '.saved_host_gib']:.0f} of {f[p + '.host_gib']:.0f} GiB host RAM)"
                if f[p + '.saved_layers'] else "none: every layer recomputes")
        out.append(f"| {b} | {f[p + '.tokens_per_s']:.0f} | {f[p + '.bound_tokens_per_s']:.0f} "
                   f"({f[p + '.lower_bound_s']:.2f} s/step) | {kept} | {DEEPSPEED_4090.get(b, '—')} | "
                   f"{SLIDEFORMER_4090.get(b, '—')} |")
    out.append("")
    out.append(prose(
        "These are predictions from an assumed sustained fraction of peak (50%), not measurements; no GPU was "
        "available to calibrate them. They say where strider loses: at batch 8 the optimizer "
        f"({f['predict.8b.b8.optimizer_s']:.1f} s of CPU AdamW after the clipping norm) is not hidden behind "
        f"the next forward (overlap efficiency {f['predict.8b.b8.overlap_efficiency']:.2f}; with `--clip 0` the "
        f"prediction is {f['predict.8b.b8.clip0.tokens_per_s']:.0f} tokens/s, overlap "
        f"{f['predict.8b.b8.clip0.overlap_efficiency']:.2f}). Each cache unit holds one layer, "
        f"{f['predict.8b.unit_params'] / 1e6:.0f}M parameters and their fp32 gradients "
        f"({f['predict.8b.unit_gib']:.2f} GiB): the embedding and the LM head move in "
        f"{f['predict.8b.vocab_shards']} vocabulary shards each, and gradients cross PCIe in bf16."))
    out.append("")
    out.append(prose(
        "Kept activations: with `--activations auto` (the default) the plan prices, per layer, recomputing its "
        "forward in backward against keeping its projections' outputs (q, k, v, the attention core's output "
        "and log-sum-exp, the residual between the halves, the MLP's gate and up) in pinned host RAM, copied "
        "out in forward and back in backward on the otherwise idle link; a kept layer's backward recomputes no matmul and no attention core. The "
        "column says what it chose; the host RAM they take grows with the batch, and a `--ram` limit keeps "
        "as many layers as fit after the optimizer state (never pushing state to NVMe). SlideFormer's "
        "2398 tokens/s is Qwen3-8B at batch 64, quoted from its paper, not run here."))
    return "\n".join(out)


def block_predict_precision(f, logs):
    rows = (("", "bf16, fp32 accumulation (the default)", "SlideFormer: 2398 (Qwen3-8B, bf16, batch 64)"),
            (".fp16", "fp16 + loss scaling, fp32 accumulation (`--dtype fp16`)", "—"),
            (".fp16acc", "fp16 + loss scaling, fp16 accumulation (`--matmul-accumulate fp16`)",
             "RoundPipe: 3142 (Llama-3.1-8B, fp16 accumulation, full recompute)"))
    out = ["| precision | " + " | ".join(f"batch {b}" for b in PLAN_8B) + " | a peer on one RTX 4090, measured |",
           "| --- | " + " | ".join("---" for _ in PLAN_8B) + " | --- |"]
    for key, label, peer in rows:
        cells = [f"{f[f'predict.8b.b{b}{key}.tokens_per_s']:.0f} ({f[f'predict.8b.b{b}{key}.critical_lane']})"
                 for b in PLAN_8B]
        out.append(f"| {label} | " + " | ".join(cells) + f" | {peer} |")
    out.append("")
    out.append(prose(
        "Each cell is predicted tokens/s with the busiest lane (the critical one) in brackets. The rows differ only in "
        "the GPU's rate: bf16 and fp16 with fp32 accumulation run at the card's 165 dense TFLOP/s, fp16 "
        "accumulation at its 330 (`fp16_accumulate_tflops` of the preset, from NVIDIA's Ada whitepaper), each at "
        "the same assumed 50% sustained; fp16 moves the same bytes as bf16 (its gradients cross in bf16). Every "
        "row rests on that assumed fraction of peak until a GPU measures it, and fp16 accumulation's effect on "
        "the loss is unmeasured (the GPU check is to compare it with fp32 accumulation). Commands: the table "
        "above's, with `--dtype fp16` and `--dtype fp16 --matmul-accumulate fp16`."))
    return "\n".join(out)


def block_predict_nvme(f, logs):
    out = ["| model | RAM | clip 1.0: blocks on NVMe | host / NVMe | clip 1.0: tokens/s (step, bound) | clip 0 | "
           "clip 1.0: critical |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for model, name, ram in (("70b", "Llama-3.1-70B", "256 GiB"), ("123b", "Mistral-Large-123B", "384 GiB")):
        p, q = f"predict.{model}.nvme.clip1", f"predict.{model}.nvme.clip0"
        out.append(f"| {name} | {ram} | {f[p + '.nvme_blocks']} of {f[p + '.blocks']} | "
                   f"{f[p + '.host_gib']:.0f} GiB / {f[p + '.nvme_gib']:.0f} GiB | "
                   f"{f[p + '.tokens_per_s']:.0f} ({f[p + '.step_s']:.0f} s; {f[p + '.lower_bound_s']:.0f} s) | "
                   f"{f[q + '.tokens_per_s']:.0f} ({f[q + '.step_s']:.0f} s) | "
                   f"{f[p + '.critical_lane']}; NVMe write {f[p + '.nvme_write_s']:.0f} s |")
    out.append("")
    out.append(prose(
        "Without `--nvme` both are refused, naming the RAM needed at batch 1 "
        f"({f['refused.70b.ram_needed_gib']:.0f} GiB for 70B, {f['refused.123b.ram_needed_gib']:.0f} GiB for "
        "123B). With clipping the updates must wait for the norm, and on NVMe each one reads 14 and writes 14 "
        "bytes per parameter, so they no longer hide behind the next forward: overlap efficiency "
        f"{f['predict.70b.nvme.clip1.overlap_efficiency']:.2f} (70B) and "
        f"{f['predict.123b.nvme.clip1.overlap_efficiency']:.2f} (123B) against "
        f"{f['predict.70b.nvme.clip0.overlap_efficiency']:.2f} and "
        f"{f['predict.123b.nvme.clip0.overlap_efficiency']:.2f} without clipping."))
    return "\n".join(out)


def block_predict_lora(f, logs):
    out = ["| model, RAM (batch 16 x 1024, rtx4090 preset) | LoRA r=16, every linear module: tokens/s (s/step) | "
           "host RAM (of it kept activations) | cache unit | full training: tokens/s (s/step) | host RAM (NVMe) |",
           "| --- | --- | --- | --- | --- | --- |"]
    rows = (("8b", "lora", "Llama-3.1-8B, 128 GiB, bf16 base", True),
            ("8b", "lora-nf4", "Llama-3.1-8B, 128 GiB, NF4 base (`--base-format nf4`)", False),
            ("70b", "lora", "Llama-3.1-70B, 256 GiB, bf16 base", True),
            ("70b", "lora-nf4", "Llama-3.1-70B, 128 GiB, NF4 base (`--base-format nf4`)", False))
    for model, kind, name, full in rows:
        a, b = f"predict.{model}.{kind}", f"predict.{model}.full"
        nvme = f" ({f[b + '.nvme_gib']:.0f} GiB)" if f[b + ".nvme_gib"] else ""
        whole = (f"{f[b + '.tokens_per_s']:.0f} ({f[b + '.step_s']:.2f}) | {f[b + '.host_gib']:.1f} GiB{nvme}" if full
                 else "— | —")
        out.append(f"| {name} | {f[a + '.tokens_per_s']:.0f} ({f[a + '.step_s']:.2f}) | "
                   f"{f[a + '.host_gib']:.1f} GiB ({f[a + '.saved_host_gib']:.1f} GiB) | {f[a + '.unit_gib']:.2f} GiB | "
                   f"{whole} |")
    out.append("")
    out.append(prose(
        f"Predicted by `{cmd(logs, PLAN_LORA[('8b', 'lora')])}` and the same for the other rows (full training "
        "without `--lora`, 70B with `--nvme`, NF4 with `--base-format nf4`). A frozen base has no gradient to "
        "send, no optimizer state and a backward of input gradients only, and its cache units carry fp32 "
        "gradients of the adapters alone; the plan gives the RAM the base leaves to kept activations "
        "(`--activations auto`). With a bf16 base, Llama-3.1-70B LoRA in 128 GiB of RAM is refused: it needs "
        f"{f['refused.70b.lora.ram_needed_gib']:.0f} GiB, {f['refused.70b.lora.base_gib']:.0f} GiB of it the bf16 "
        "base's compute copy. An NF4 base holds the layers' weight matrices in 0.5625 bytes per parameter and "
        "sends those bytes to the GPU, which dequantizes them at each forward and backward visit with ATen ops. "
        "The simulator prices that at 2 FLOPs per element and leaves its memory traffic out: unfused, the ops "
        "move about 23 bytes per element (code bytes widened to int32, fp32 level pairs looked up, scaled, "
        "rounded), some 5 ms per Llama-3.1-8B layer at 1 TB/s: about 0.3 s of the 8B step above and 3 s of the "
        "70B one (19 ms per layer), unmeasured until a GPU runs it."))
    return "\n".join(out)


def block_formats(f, logs):
    p8, p70 = "predict.8b.q8", "predict.70b.q8"
    return "\n".join([
        "| | optimizer state | pinned training state | bytes per parameter | NVMe blocks | tokens/s (rtx4090 preset) |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| Llama-3.1-8B, 256 GiB RAM, batch 8 x 1024 (`{cmd(logs, PLAN_Q8['8b'])}`) | q8 | "
        f"{f[p8 + '.host_gib']:.1f} GiB | {f[p8 + '.host_bytes_per_param']:.2f} (fp32: "
        f"{f[p8 + '.fp32_host_bytes_per_param']:.2f}) | {f[p8 + '.nvme_blocks']} | "
        f"{f[p8 + '.tokens_per_s']:.0f} (fp32: {f['predict.8b.b8.tokens_per_s']:.0f}) |",
        f"| Llama-3.1-70B, 256 GiB RAM + NVMe, batch 32 x 1024 (`{cmd(logs, PLAN_Q8['70b'])}`) | q8 | "
        f"{f[p70 + '.host_gib']:.1f} GiB | {f[p70 + '.host_bytes_per_param']:.2f} | "
        f"{f[p70 + '.nvme_blocks']} (fp32: {f[p70 + '.fp32_nvme_blocks']}) | "
        f"{f[p70 + '.tokens_per_s']:.0f} (fp32: {f['predict.70b.nvme.clip1.tokens_per_s']:.0f}); critical lane "
        f"{f[p70 + '.critical_lane']}, NVMe write {f[p70 + '.nvme_write_s']:.0f} s (fp32: "
        f"{f['predict.70b.nvme.clip1.nvme_write_s']:.0f} s) |"])


def block_ram_8b(f, logs):
    return (f"Llama-3.1-8B: {f['predict.8b.b8.clip0.host_gib']:.1f} instead of "
            f"{f['predict.8b.b8.host_gib']:.1f} GiB of host RAM")


BLOCKS = {"machine": block_machine, "demo-model": block_demo_model, "demo-plan": block_demo_plan,
          "profile": block_profile, "measured": block_measured, "predict-8b": block_predict_8b,
          "predict-precision": block_predict_precision, "predict-nvme": block_predict_nvme, "ram-8b": block_ram_8b,
          "formats": block_formats, "predict-lora": block_predict_lora}
# The predict scripts' blocks, as each printed it.
BLOCKS |= {name: (lambda f, logs, name=name: f[f"block.{name}"]) for name in PREDICT_BLOCKS}
# The parts whose figures each block quotes: --check renders those whose parts ran, and a figure a block
# asks for that no command printed is missing.
_PLAN = {"plan"}
BLOCK_PARTS = {"machine": {"adam"}, "demo-model": {"profile"}, "demo-plan": {"demo"}, "profile": {"profile"},
               "measured": {"adam", "nvme", "torch", "step", "calibrate", "demo"}, "predict-8b": _PLAN,
               "predict-precision": _PLAN, "predict-nvme": _PLAN, "ram-8b": _PLAN, "formats": _PLAN,
               "predict-lora": _PLAN} | {name: {"predict"} for name in PREDICT_BLOCKS}


def cmd(logs, name):
    return logs.commands.get(name, {}).get("cmd", f"<{name} did not run>")


def update_readme(readme: Path, f, logs):
    """Rewrites every block in BLOCKS; True if one changed. Every block of COMMANDS must be in the pages, and
    no other."""
    found = {name for page in pages(readme) for name in blocks(page.read_text())}
    unknown, missing = sorted(found - set(COMMANDS)), sorted(set(COMMANDS) - found)
    if unknown or missing:
        raise SystemExit(f"readme_figures: blocks not in bench/figure_blocks.py's COMMANDS: {unknown or 'none'}; "
                         f"blocks in no page: {missing or 'none'} (pages: {', '.join(map(str, pages(readme)))})")
    changed = [name for name in BLOCKS if replace_block(name, BLOCKS[name](f, logs), readme)]
    return bool(changed)


# ---- the report ---------------------------------------------------------------------------


def show(v):
    if isinstance(v, str) and "\n" in v:
        return f"<block of {v.count(chr(10)) + 1} lines>"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    if isinstance(v, list):
        return "/".join(str(x) for x in v)
    return str(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", type=Path)
    ap.add_argument("--parts", default=",".join(PARTS), help="the parts that ran (comma-separated)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a command failed or a figure is missing")
    ap.add_argument("--update-readme", type=Path, metavar="README")
    a = ap.parse_args()
    logs = Logs(a.logs)
    parts = [p for p in a.parts.split(",") if p]  # bench/readme_figures.sh --only checked them

    f = Figures()
    for p in parts:
        EXTRACT[p](logs, f)
    failed, missing = [], []
    for p in parts:
        for c in PARTS[p]:
            r = logs.commands.get(c)
            if r is None:
                failed.append(f"{c}: did not run")
            elif r["rc"] != r["expected_rc"]:
                failed.append(f"{c}: exit status {r['rc']} (expected {r['expected_rc']}), see {a.logs}/{c}.log")
    for name, render in BLOCKS.items():
        if BLOCK_PARTS[name] <= set(parts):
            try:
                render(f, logs)
            except KeyError as e:  # the first figure the block quotes that no command printed
                missing.append(f"{e.args[0]} (block {name})")

    width = max((len(n) for n in f.values), default=0)
    print("figures (name: value    # the command that printed it):")
    for n, v in f.values.items():
        print(f"  {n + ':':<{width + 1}} {show(v):<12}  # {cmd(logs, f.source[n])}")
    print("commands (exit status, wall time):")
    for p in parts:
        for c in PARTS[p]:
            r = logs.commands.get(c)
            if r:
                print(f"  {c:<22} rc {r['rc']}{'' if r['rc'] == r['expected_rc'] else ' FAILED'}"
                      f"  {r['wall_s']:8.1f} s  {r['cmd']}")
    wall = {p: round(sum(logs.commands.get(c, {}).get("wall_s", 0) for c in PARTS[p]), 1) for p in parts}
    for x in failed:
        print(f"FAILED  {x}")
    for n in missing:
        print(f"MISSING {n}")
    summary = {"machine": logs.machine, "parts": parts, "part_wall_s": wall, "figures": f.values,
               "commands": {n: logs.commands[n] for p in parts for n in PARTS[p] if n in logs.commands},
               "failed": failed, "missing": missing, "logs": str(a.logs)}
    print(json.dumps(summary))

    bad = bool(failed or missing)
    if a.update_readme:
        if bad or set(parts) != set(PARTS):
            print(f"readme_figures: README not updated: {'a command failed or a figure is missing' if bad else 'not every part ran'}",
                  file=sys.stderr)
            return 1
        changed = update_readme(a.update_readme, f, logs)
        print(f"readme_figures: {a.update_readme} {'updated' if changed else 'already holds these figures'}",
              file=sys.stderr)
    if a.check and bad:
        print(f"readme_figures: check failed: {len(failed)} command(s) failed, {len(missing)} figure(s) missing",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
