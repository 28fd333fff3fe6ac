"""Data parallel on machines we do not have: `strider plan --gpus N --link L --predict P` for
Llama-3.1-8B at sequence 1024, next to the published figures a user would compare with. Every
prediction runs the unchanged engine schedule of one rank on SimDevice (its slice of the
optimizer, its collectives on the updater, its GPU's link; on one machine its 1/N of the host's
memory bus, which its copies and its optimizer's slice share) and multiplies by the ranks.

    .venv/bin/python bench/predict_dp.py                       # print the table
    .venv/bin/python bench/predict_dp.py --update-readme

Writes the `<!-- figures:begin predict-dp -->` block, in README.md or the docs/ page that holds it
(bench/figure_blocks.py); bench/readme_figures.sh runs it and writes the block it prints.
"""
import argparse
import json
import subprocess
from pathlib import Path

from figure_blocks import marked, replace_block

REPO = Path(__file__).resolve().parent.parent

# Published, quoted (not run here): tokens/s, Llama-3.1-8B, RTX 4090s on PCIe.
PEERS = [("RoundPipe, 8 x RTX 4090 (PCIe)", 24275), ("RoundPipe, 1 x RTX 4090", 3142),
         ("FSDP with CPU offload, 8 x RTX 4090", 4071)]

# (label, --gpus, --link, --predict): the machine each row describes.
ROWS = [
    ("1 x RTX 4090, workstation host (70 GB/s memory)", 1, "pcie4", "rtx4090"),
    ("8 x RTX 4090 on PCIe 4.0, the same workstation host", 8, "pcie4", "rtx4090"),
    ("8 x RTX 4090 on PCIe 4.0, a server host (300 GB/s memory)", 8, "pcie4", "rtx4090,cpu_mem_gbps=300"),
    ("8 machines of 1 x RTX 4090, 100 GbE", 8, "eth100", "rtx4090"),
]


def plan(binary, gpus, link, machine, accumulation, ram):
    cmd = [str(binary), "plan", "--model", "llama-3.1-8b", "--gpu", "24GiB", "--ram", ram, "--seq", "1024",
           "--micro-batch", "1", "--accumulation", str(accumulation), "--gpus", str(gpus), "--link", link,
           "--predict", machine, "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    return " ".join(cmd[1:-1]), json.loads(r.stdout)


def gib(b):
    return f"{b / 2**30:.0f} GiB"


def render(results, accumulation):
    lines = [f"Llama-3.1-8B, sequence 1024, {accumulation} sequences per rank and step (micro-batch 1), fp32 "
             "optimizer state, clipping on; each row printed by `build/strider plan --model llama-3.1-8b --gpu "
             f"24GiB --ram R --seq 1024 --micro-batch 1 --accumulation {accumulation} --gpus N --link L --predict "
             "P --json` (`.venv/bin/python bench/predict_dp.py` runs them all):", "",
             "| machine | `--gpus`, `--link`, `--predict` | predicted tokens/s | per rank: s/step, critical lane | "
             "host RAM of a machine |",
             "| --- | --- | --- | --- | --- |"]
    for (label, gpus, link, machine), (_, out) in results:
        lines.append(f"| {label} | {gpus}, {link}, `{machine}` | {out['tokens_per_s']:.0f} | "
                     f"{out['step_s']:.2f} s, {out['critical_lane']} | {gib(out.get('machine_host_bytes', out['host_peak_bytes']))} |")
    lines += ["", "Published, for comparison (quoted from their papers, not run here): " +
              "; ".join(f"{name}: {tps:,} tokens/s" for name, tps in PEERS) + "."]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=str(REPO / "build" / "strider"))
    ap.add_argument("--accumulation", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--ram", default="512GiB", help="host RAM of a machine")
    ap.add_argument("--update-readme", nargs="?", const="", metavar="README",
                    help="rewrite its predict-dp block where it is: in README.md (or README) or a docs/*.md beside it")
    args = ap.parse_args()
    results = []
    for row in ROWS:
        label, gpus, link, machine = row
        cmd, out = plan(args.binary, gpus, link, machine, args.accumulation, args.ram)
        print(f"{label}: {out['tokens_per_s']:.0f} tokens/s ({out['step_s']:.3f} s/step per rank, critical "
              f"{out['critical_lane']})\n  {cmd}")
        results.append((row, (cmd, out)))
    block = render(results, args.accumulation)
    print(marked("predict-dp", block))
    if args.update_readme is not None:
        replace_block("predict-dp", block, args.update_readme or None)


if __name__ == "__main__":
    main()
