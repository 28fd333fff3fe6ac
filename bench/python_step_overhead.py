#!/usr/bin/env python3
"""What strider.Engine.step costs in Python and the binding, beyond the engine's own step.

Each step's wall time around engine.step(...) (the Python call, the binding's checks and its report) against the
step time the engine measured itself (StepResult.step_s, the baseline in the same call): the difference is the
per-step overhead of the Python path. A tiny Llama on the CPU device, so that the step is short and the overhead
shows; steps alternate with nothing else. Prints the median and quartiles over --steps steps, then one JSON line.

    .venv/bin/python bench/python_step_overhead.py [--steps 200]
"""
import argparse
import json
import statistics
import time

import torch
import transformers

import strider


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    config = strider.EngineConfig(seq=16, micro_batch=1, accumulation=1, dtype="fp32", device="cpu",
                                  total_steps=args.steps + args.warmup)
    engine = strider.Engine(model, config)
    ids = torch.randint(0, 256, (1, 16))
    over = []
    for s in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        r = engine.step(ids, ids.clone())
        wall = time.perf_counter() - t0
        if s >= args.warmup:
            over.append((wall - r.step_s) * 1e6)
    engine.finish()
    q = statistics.quantiles(over, n=4)
    print(f"python step overhead: median {q[1]:.0f} us (quartiles {q[0]:.0f} .. {q[2]:.0f} us) over {args.steps} "
          f"steps; the engine's own step {r.step_s * 1e3:.2f} ms")
    print(json.dumps({"bench": "python_step_overhead", "steps": args.steps, "median_us": round(q[1], 1),
                      "q1_us": round(q[0], 1), "q3_us": round(q[2], 1), "engine_step_ms": round(r.step_s * 1e3, 3)}))


if __name__ == "__main__":
    main()
