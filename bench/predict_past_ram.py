"""Past the RAM: `strider plan --nvme DIR --predict rtx4090` for models whose training state does not fit
the machine's RAM even with all optimizer state on NVMe, so that the plan puts layers' compute copies there
too (read before each visit of their layer, written back with the state). Batch 32 x 1024, a 24 GiB GPU,
clipping on, fp32 and q8 optimizer state. Every prediction runs the unchanged engine schedule on SimDevice;
the 180B-class model is bench/configs/llama-180b-shape.json (Llama-shaped: hidden 12288, intermediate
28672, 128 layers, 8 KV heads; 180.3B parameters), and bench/configs/llama-205b-wide-shape.json has GPT-3
175B's widths (hidden 12288, FFN 49152, 96 layers) in Llama's gated shape with 8 KV heads (205B
parameters): its layer's cache unit (12 GiB) is more than half the GPU, so the plan cuts each layer into
sub-layer pieces (its attention half and MLP slices, each a visit of its own).

    .venv/bin/python bench/predict_past_ram.py                       # print the table
    .venv/bin/python bench/predict_past_ram.py --update-readme

Writes the `<!-- figures:begin predict-past-ram -->` block, in README.md or the docs/ page that holds it
(bench/figure_blocks.py); bench/readme_figures.sh runs it and writes the block it prints.
"""
import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from figure_blocks import marked, replace_block

REPO = Path(__file__).resolve().parent.parent

# (label, --model, --ram)
ROWS = [("Llama-3.1-70B", "llama-3.1-70b", "128GiB"),
        ("Llama-shaped 180B", "bench/configs/llama-180b-shape.json", "256GiB"),
        ("205B, GPT-3 175B's widths", "bench/configs/llama-205b-wide-shape.json", "256GiB")]
FORMATS = ["fp32", "q8"]


def plan(binary, model, ram, fmt, nvme):
    cmd = [str(binary), "plan", "--model", model, "--gpu", "24GiB", "--ram", ram, "--nvme", nvme, "--seq", "1024",
           "--accumulation", "32", "--optimizer-state", fmt, "--predict", "rtx4090", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    out = json.loads(r.stdout)
    if not out["feasible"]:
        raise SystemExit(f"{' '.join(cmd)}: not feasible: {out['reason']}")
    return out


def gib(b):
    return f"{b / 2**30:.0f} GiB"


def render(results):
    lines = ["Each row by `build/strider plan --model M --gpu 24GiB --ram R --nvme DIR --seq 1024 --accumulation 32 "
             "--optimizer-state F --predict rtx4090` (clipping on; `.venv/bin/python bench/predict_past_ram.py` runs "
             "them all):", "",
             "| model | RAM + NVMe | state | MLP slices | blocks' state / layers' compute copies on NVMe | "
             "host peak / NVMe | tokens/s (s/step) | critical lane; NVMe read, write |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (label, _, ram), fmt, out in results:
        busy = out["lane_busy_s"]
        blocks = len(out["nvme_blocks"])
        slices = out["mlp_pieces"] or "whole layers"
        lines.append(f"| {label} | {ram.replace('GiB', ' GiB')} + NVMe | {fmt} | {slices} | {blocks} of {blocks} / "
                     f"{len(out['nvme_compute_blocks'])} | {gib(out['host_peak_bytes'])} / {gib(out['nvme_bytes'])} | "
                     f"{out['tokens_per_s']:.0f} ({out['step_s']:.0f} s) | {out['critical_lane']}; "
                     f"{busy['nvme read']:.0f} s, {busy['nvme write']:.0f} s |")
    lines += ["", "Published, for comparison: LoHan (arXiv 2403.06504) fine-tuned a 175B model in full on one RTX "
              "4090 with 256 GB of RAM and NVMe. Its abstract gives no tokens/s for that model, so none is quoted "
              "here."]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=str(REPO / "build" / "strider"))
    ap.add_argument("--update-readme", nargs="?", const="", metavar="README",
                    help="rewrite its predict-past-ram block where it is: in README.md (or README) or a docs/*.md beside it")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        # A folder that is not here: the plans are for machines with the drive, whatever this one's disk holds
        # (a folder here would be checked for the room the plan puts there).
        nvme = os.path.join(tmp, "elsewhere")
        for row in ROWS:
            for fmt in FORMATS:
                out = plan(args.binary, row[1], row[2], fmt, nvme)
                print(f"{row[0]}, {row[2]}, {fmt}: {out['tokens_per_s']:.0f} tokens/s, critical "
                      f"{out['critical_lane']}; {len(out['nvme_compute_blocks'])} layers' compute copies on NVMe; "
                      f"MLP slices {out['mlp_pieces']}")
                results.append((row, fmt, out))
    block = render(results)
    print(marked("predict-past-ram", block))
    if args.update_readme is not None:
        replace_block("predict-past-ram", block, args.update_readme or None)


if __name__ == "__main__":
    main()
