#!/usr/bin/env python3
"""DeepSpeed's CPUAdam on bench_adam's work, for bench_adam to print beside its own figures.

bench_adam runs this once, before its own measurements (so the two never hold
memory at the same time), and reads the last line of its output: one JSON object,
  {"deepspeed": "0.19.8", "runs": [{"params": n, "threads": t, "seconds": s}, ...]}
or {"deepspeed": null, "error": "why it did not run"}.

The work is torch's row of bench_adam, exactly: AdamW over n fp32 parameters with
fp32 gradients and fp32 m and v (DeepSpeedCPUAdam, adamw_mode, one parameter
tensor), then the parameters cast to bf16 into a preallocated tensor (the compute
copy an offload engine sends to the GPU). Threads: DeepSpeed's kernel runs on
OpenMP, set with torch.set_num_threads (torch's OpenMP runtime is the one loaded).
Each figure is the best of --reps steps after one warm-up step. DeepSpeed builds
its CPU Adam op on first use (torch's cpp_extension, cached under
~/.cache/torch_extensions); DS_ACCELERATOR defaults to cpu here so a machine
without a GPU builds the CPU op.

    bench/adam_deepspeed.py --sizes 16 256 --threads 1 2 --reps 5 [--path DIR]
"""
import argparse
import json
import os
import sys
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[16, 256], help="parameter counts in millions")
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--path", default="", help="a directory to put on sys.path first (where deepspeed is installed)")
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.path:
        sys.path.insert(0, args.path)
        os.environ["PATH"] = os.path.join(args.path, "bin") + os.pathsep + os.environ.get("PATH", "")  # its ninja
    try:
        import torch
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        probe = torch.nn.Parameter(torch.zeros(16))
        probe.grad = torch.zeros(16)
        DeepSpeedCPUAdam([probe], lr=1e-3).step()  # builds (or loads) the op: a failure here is 'not run'
    except Exception as e:  # noqa: BLE001  (any failure to import or build is the reason to report)
        print(json.dumps({"deepspeed": None, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}))
        return
    runs = []
    for sm in args.sizes:
        n = int(sm * 1e6)
        reps = max(2, args.reps // 2) if n > (64 << 20) else args.reps  # bench_adam's rule
        param = torch.nn.Parameter(torch.full((n,), 0.5))
        param.grad = torch.full((n,), 1e-3)
        out = torch.empty(n, dtype=torch.bfloat16)
        opt = DeepSpeedCPUAdam([param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw_mode=True)
        for t in args.threads:
            torch.set_num_threads(t)

            def step():
                opt.step()
                out.copy_(param.data)

            step()
            best = 1e30
            for _ in range(reps):
                t0 = time.perf_counter()
                step()
                best = min(best, time.perf_counter() - t0)
            runs.append({"params": n, "threads": t, "seconds": best})
        del opt, param, out
    print(json.dumps({"deepspeed": deepspeed.__version__, "runs": runs}))


if __name__ == "__main__":
    main()
