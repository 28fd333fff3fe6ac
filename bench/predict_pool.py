"""A pool of devices in one process on machines we do not have: `strider plan --devices N --predict P`
for Llama-3.1-8B at sequence 1024, 8 sequences per device and step, next to data parallel at the same
per-GPU batch (`--gpus N --link pcie4`) and the published figures a user would compare with. A pool's
prediction runs the unchanged engine schedule on N SimDevices, each on its own x16 link, their copies
sharing the host's memory bus with the optimizer's AdamW and norm (gpu/device/sim_device.h, SimHostMemory), and at
16 sequences per GPU on the workstation host, keeping activations and recomputing them.

    .venv/bin/python bench/predict_pool.py                       # print the table
    .venv/bin/python bench/predict_pool.py --update-readme

Writes the `<!-- figures:begin predict-pool -->` block, in README.md or the docs/ page that holds it
(bench/figure_blocks.py); bench/readme_figures.sh runs it and writes the block it prints.
"""
import argparse
import json
import subprocess
from pathlib import Path

from figure_blocks import marked, replace_block

REPO = Path(__file__).resolve().parent.parent

# Published, quoted (not run here): tokens/s, Llama-3.1-8B, RTX 4090s on PCIe 4.0.
PEERS = [("RoundPipe, 1 x RTX 4090", 3142), ("RoundPipe, 8 x RTX 4090", 24275)]
HOSTS = [("workstation host (70 GB/s memory)", "rtx4090"), ("server host (300 GB/s)", "rtx4090,cpu_mem_gbps=300")]
PER_DEVICE = 8  # sequences per device (or rank) and step


def plan(binary, n, machine, pool, per_device=PER_DEVICE, activations="auto"):
    cmd = [str(binary), "plan", "--model", "llama-3.1-8b", "--gpu", "24GiB", "--ram", "512GiB", "--seq", "1024",
           "--micro-batch", "1", "--predict", machine, "--activations", activations, "--json"]
    cmd += (["--accumulation", str(per_device * n), "--devices", str(n)] if pool
            else ["--accumulation", str(per_device), "--gpus", str(n), "--link", "pcie4"])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=str(REPO / "build" / "strider"))
    ap.add_argument("--update-readme", nargs="?", const="", metavar="README",
                    help="rewrite its predict-pool block where it is: in README.md (or README) or a docs/*.md beside it")
    args = ap.parse_args()
    lines = ["Predictions, unmeasured (no machine with several GPUs has run strider). Llama-3.1-8B, sequence "
             f"1024, {PER_DEVICE} sequences per GPU and step (micro-batch 1), fp32 optimizer state, clipping on. "
             "Pool: `build/strider plan --model llama-3.1-8b --gpu 24GiB --ram 512GiB --seq 1024 --micro-batch 1 "
             f"--accumulation {PER_DEVICE}N --devices N --predict P --activations auto --json`; data parallel: the same with "
             f"`--accumulation {PER_DEVICE} --gpus N --link pcie4`. `.venv/bin/python bench/predict_pool.py` runs "
             "them all. A pool's lanes are unions over its devices (its compute lane: some device computes).", "",
             "| RTX 4090s | host (`--predict`) | pool: tokens/s, critical lane | per GPU vs one | pool: step, h2d busy, "
             "optimizer busy (s) | vocabulary shards | data parallel: tokens/s, critical lane |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, machine in HOSTS:
        one = None
        for n in (1, 2, 4, 8):
            pool, dp = plan(args.binary, n, machine, True), plan(args.binary, n, machine, False)
            one = one or pool["tokens_per_s"]
            busy = pool["lane_busy_s"]
            lines.append(f"| {n} | {label}, `{machine}` | {pool['tokens_per_s']:.0f}, {pool['critical_lane']} | "
                         f"{pool['tokens_per_s'] / (n * one):.2f} | {pool['step_s']:.2f}, {busy['h2d']:.2f}, "
                         f"{busy['optimizer']:.2f} | {pool['vocab_shards']} | "
                         f"{dp['tokens_per_s']:.0f}, {dp['critical_lane']} |")
            print(lines[-1], flush=True)
    # What a bigger batch per GPU does to the per-step costs (the one optimizer, the step's start), and what
    # recomputing instead of keeping activations does to a shared bus of 70 GB/s.
    lines += ["", f"The workstation host with 16 sequences per GPU (`--accumulation 16N`), the same commands:", "",
              "| RTX 4090s | `--activations` | pool: tokens/s, critical lane | per GPU vs one | pool: step, h2d busy, "
              "optimizer busy (s) |", "| --- | --- | --- | --- | --- |"]
    for activations in ("auto", "recompute"):
        one = None
        for n in (1, 8):
            r = plan(args.binary, n, "rtx4090", True, per_device=16, activations=activations)
            one = one or r["tokens_per_s"]
            busy = r["lane_busy_s"]
            lines.append(f"| {n} | {activations} | {r['tokens_per_s']:.0f}, {r['critical_lane']} | "
                         f"{r['tokens_per_s'] / (n * one):.2f} | {r['step_s']:.2f}, {busy['h2d']:.2f}, "
                         f"{busy['optimizer']:.2f} |")
            print(lines[-1], flush=True)
    lines += ["", "Published, measured on their machines (quoted, not run here): " +
              "; ".join(f"{name}: {tps:,} tokens/s" for name, tps in PEERS) + "."]
    block = "\n".join(lines)
    print(marked("predict-pool", block))
    if args.update_readme is not None:
        replace_block("predict-pool", block, args.update_readme or None)


if __name__ == "__main__":
    main()
