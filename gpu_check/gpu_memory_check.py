"""Measured peak device memory of a training step against the plan's figure.

    python gpu_check/gpu_memory_check.py --device cuda --strider build/strider   # gpu_check/gpu_check.sh runs it
    python gpu_check/gpu_memory_check.py --device cpu --strider build/strider    # gpu_check.sh --cpu: smaller

For each case, a Llama made from a config on the spot (on CUDA: hidden 2048, vocab 32000, intermediate
5632, so a cache unit holds hundreds of MiB; on the CPU, --cpu sizes) is planned by `strider plan --json`
under a device budget, then trained for 2 steps by the engine (torch.classes.strider.Engine) on the device
with the plan's window and checkpoint placement. The weights stay at zero: the memory of a step does not
depend on their values, and initialising hundreds of millions of parameters would take most of a GPU
check's minutes.

  measured   strider's own device buffers (the engine report's peak_device_bytes: the cache units,
             checkpoints, gradients, the batch; cudaMalloc'd by CudaDevice) plus ATen's working memory
             inside the visits: the step report's work_peak_bytes, the most any one compute op held,
             as the device measured it (CUDA: the caching allocator's peak within each op; the CPU
             device: its count of ATen's CPU allocations). Not torch.cuda.max_memory_allocated():
             CudaDevice resets the peak statistics at every op, so after a step it holds only the last
             op's peak.
  plan       the plan's device_buffer_bytes (what the engine allocates), device_work_bytes (its estimate
             of ATen's working memory) and device_peak_bytes (the two together).

A measured figure above the plan's is a finding (the plan does not count all of ATen's working memory
yet; another issue owns that), reported, not a failure. The check fails only when it cannot measure, or
when strider's own buffers differ from the plan's device_buffer_bytes (the same code sizes both).
The last line printed is one JSON object.
"""
import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import torch
from gpu_check_common import require_device, run_check  # also puts this tree's strider package on sys.path

MIB = 1 << 20
# Units of realistic size: a decoder layer of 45M parameters (90 MiB bf16 + 180 MiB fp32 gradients),
# the embedding and LM head 65.5M each.
CUDA_MODEL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000, max_position_embeddings=8192)
CUDA_CASES = [dict(name="seq1024", seq=1024, micro_batch=1, accumulation=2),
              dict(name="seq8192", seq=8192, micro_batch=1, accumulation=1)]
CUDA_BUDGET = "16GiB"
# --device cpu: the same logic at a size two CPU cores step in seconds.
CPU_MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4000, max_position_embeddings=1024)
CPU_CASES = [dict(name="seq256", seq=256, micro_batch=1, accumulation=2),
             dict(name="seq1024", seq=1024, micro_batch=1, accumulation=1)]
CPU_BUDGET = "1GiB"


def model_config(dims):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", **dims}


def plan(strider, config_path, budget, case):
    cmd = [str(strider), "plan", "--model", str(config_path), "--gpu", budget, "--seq", str(case["seq"]),
           "--micro-batch", str(case["micro_batch"]), "--accumulation", str(case["accumulation"]),
           "--dtype", "bf16", "--predict", "none", "--json"]
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"strider plan failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure(model_json, case, p, device, budget_bytes):
    cuda = device.startswith("cuda")
    # The plan's engine: its window and checkpoint placement, the layers that keep their activations and
    # whether the head keeps its logits (both in its device_buffer_bytes), its token tile.
    from strider.config import engine_settings  # the package this tree's gpu_check_common put on sys.path
    settings = engine_settings(dict(seq=case["seq"], micro_batch=case["micro_batch"],
                                    accumulation=case["accumulation"], dtype="bf16", window=p["window"],
                                    checkpoints_on_host=p["checkpoints_on_host"], saved_blocks=p["saved_blocks"],
                                    keep_logits=p["keep_logits"], token_tile=p["token_tile"], clip_norm=1.0,
                                    lr=1e-5))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    t0 = time.time()
    engine = torch.classes.strider.Engine(model_json, settings, device, budget_bytes, False, 1)
    build_s = time.time() - t0
    batch = case["micro_batch"] * case["accumulation"]
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(2):  # the first step also makes ATen's lazily created handles and workspaces
        ids = torch.randint(0, json.loads(model_json)["vocab_size"], (batch, case["seq"]), generator=g)
        numbers, _, _ = engine.step(ids, ids.clone())  # the typed report: numbers, texts, lanes
        r = dict(numbers)
        steps.append({"step_s": r["step_s"], "loss": r["loss"], "peak_device_bytes": r["peak_device_bytes"],
                      "work_peak_bytes": r["work_peak_bytes"]})
    engine.finish()
    strider_peak = max(s["peak_device_bytes"] for s in steps)
    work_peak = max(s["work_peak_bytes"] for s in steps)
    out = {"engine_build_s": build_s, "steps": steps, "strider_buffer_peak_bytes": strider_peak}
    if cuda:
        torch.cuda.synchronize()
        out["aten_reserved_peak_bytes"] = torch.cuda.max_memory_reserved()  # the allocator's pool, for reference
    # 0: the device did not measure its ops (no meter), which the check reports as not measured.
    out["aten_peak_bytes"] = work_peak if work_peak > 0 else None
    out["measured_peak_bytes"] = strider_peak + work_peak if work_peak > 0 else None
    del engine
    return out


def run_case(strider, dims, case, device, budget, work):
    cfg = model_config(dims)
    path = pathlib.Path(work) / f"{case['name']}-config.json"
    path.write_text(json.dumps(cfg))
    p = plan(strider, path, budget, case)
    if not p["feasible"]:
        raise RuntimeError(f"the plan for {case} under {budget} is not feasible: {p['reason']}")
    from strider.config import parse_bytes
    m = measure(json.dumps(cfg), case, p, device, parse_bytes(budget))
    res = {**case, "budget": budget, "window": p["window"], "checkpoints_on_host": p["checkpoints_on_host"],
           "unit_bytes": p["unit_bytes"], "plan_buffer_bytes": p["device_buffer_bytes"],
           "plan_work_bytes": p["device_work_bytes"], "plan_peak_bytes": p["device_peak_bytes"], **m}
    res["buffers_match_plan"] = m["strider_buffer_peak_bytes"] == p["device_buffer_bytes"]
    findings = []
    if not res["buffers_match_plan"]:
        findings.append(f"strider's buffers peaked at {m['strider_buffer_peak_bytes']} bytes, the plan counts "
                        f"{p['device_buffer_bytes']}")
    if m["aten_peak_bytes"] is not None:
        res["aten_over_plan_work"] = m["aten_peak_bytes"] / max(p["device_work_bytes"], 1)
        res["measured_over_plan_peak"] = m["measured_peak_bytes"] / max(p["device_peak_bytes"], 1)
        if m["measured_peak_bytes"] > p["device_peak_bytes"]:
            findings.append(f"measured peak {m['measured_peak_bytes'] / MIB:.1f} MiB exceeds the plan's "
                            f"{p['device_peak_bytes'] / MIB:.1f} MiB (ATen used {m['aten_peak_bytes'] / MIB:.1f} MiB, "
                            f"the plan estimated {p['device_work_bytes'] / MIB:.1f} MiB)")
    res["findings"] = findings
    aten = "not measured" if m["aten_peak_bytes"] is None else f"{m['aten_peak_bytes'] / MIB:.1f} MiB"
    print(f"{case['name']}: K {p['window']}, checkpoints on {'host' if p['checkpoints_on_host'] else 'device'}, "
          f"unit {p['unit_bytes'] / MIB:.1f} MiB; strider buffers {m['strider_buffer_peak_bytes'] / MIB:.1f} MiB "
          f"(plan {p['device_buffer_bytes'] / MIB:.1f}), ATen {aten} (plan {p['device_work_bytes'] / MIB:.1f}), "
          f"plan peak {p['device_peak_bytes'] / MIB:.1f} MiB" + "".join(f"\n  finding: {f}" for f in findings),
          flush=True)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--strider", required=True, help="the strider binary (for `strider plan --json`)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    out = {"check": "memory", "device": args.device, "torch": torch.__version__,
           "model": CUDA_MODEL if cuda else CPU_MODEL}

    def body(out):
        require_device(args.device)
        import strider
        strider.load_library()
        with tempfile.TemporaryDirectory() as work:
            out["cases"] = [run_case(args.strider, out["model"], c, args.device, CUDA_BUDGET if cuda else CPU_BUDGET,
                                     work) for c in (CUDA_CASES if cuda else CPU_CASES)]
        out["findings"] = [f"{c['name']}: {f}" for c in out["cases"] for f in c["findings"]]
        out["ok"] = all(c["buffers_match_plan"] for c in out["cases"])

    return run_check(out, body)


if __name__ == "__main__":
    sys.exit(main())
