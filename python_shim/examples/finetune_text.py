"""Fine-tune a transformers causal LM on a text file with strider, then save_pretrained.

    python python_shim/examples/finetune_text.py --model <hf dir> --data corpus.txt --out finetuned \
        --seq 1024 --micro-batch 2 --accumulation 8 --steps 500 --lr 1e-5 --device-budget 20GiB

The text is tokenized with the model's tokenizer (or --tokenizer) into a token
file next to --out (python -m strider.data does the same from the shell), the
model is loaded on the CPU, and strider trains every parameter with the GPU as
a sliding window over its blocks. Every --eval-every steps the mean loss over
--eval-batches batches of --eval-data (or, without it, of the training text in
file order) is printed. strider trains the model's own parameters in place
(in the compute dtype), so at the end model.save_pretrained /
tokenizer.save_pretrained write the trained model to --out. The last
line printed is a JSON summary.
"""
import argparse
import itertools
import json
import sys
import time
from pathlib import Path

try:
    import strider
except ImportError:  # run from a source checkout: the package is in python_shim/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import strider
import torch
from strider.data import TokenBatches, TokenDataset, prepare
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory (or hub name, if cached)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    p.add_argument("--data", required=True, help="text file, one document per line")
    p.add_argument("--eval-data", help="held-out text file (default: the training text, in file order)")
    p.add_argument("--out", required=True, help="where the fine-tuned model is saved")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--window", type=int, default=2, help="cache units on the device")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="compute dtype")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--schedule", default="cosine", choices=["constant", "linear", "cosine"])
    p.add_argument("--warmup", type=int, default=0, help="warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--device-budget", default="0", help="device memory strider may use, e.g. 20GiB (0: default)")
    p.add_argument("--seed", type=int, default=0, help="data order")
    p.add_argument("--trace", help="write the timeline as Chrome trace JSON (Perfetto)")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(a.tokenizer or a.model)
    train_file = prepare(tokenizer, a.data, out / "train.tokens", fmt="lines")["output"]
    eval_file = prepare(tokenizer, a.eval_data, out / "eval.tokens", fmt="lines")["output"] if a.eval_data \
        else train_file

    # fp32 compute wants fp32 weights to start from; bf16 compute keeps the checkpoint's dtype.
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32 if a.dtype == "fp32" else "auto")
    config = strider.EngineConfig(seq=a.seq, micro_batch=a.micro_batch, accumulation=a.accumulation,
                                  window=a.window, dtype=a.dtype, lr=a.lr, schedule=a.schedule,
                                  warmup_steps=a.warmup, total_steps=a.steps if a.schedule != "constant" else 0,
                                  weight_decay=a.weight_decay, clip_norm=a.clip, device=a.device,
                                  device_budget=a.device_budget,
                                  # Lines are documents: where they start inside a window, each attends only to
                                  # itself (the batches' position_ids restart at each).
                                  packed_documents=any(TokenDataset(f, a.seq).packs_documents
                                                       for f in (train_file, eval_file)))
    engine = strider.Engine(model, config)
    train = iter(TokenBatches(train_file, config.batch, a.seq, seed=a.seed, positions=True))

    def evaluate():
        batches = TokenBatches(eval_file, config.batch, a.seq, shuffle=False, positions=True)
        losses = [engine.evaluate(x, y, position_ids=p) for x, y, p in itertools.islice(batches, a.eval_batches)]
        return sum(losses) / len(losses)

    evals = [(0, evaluate())]
    tqdm.write(f"eval loss before training: {evals[0][1]:.4f}")
    losses = []
    start = time.perf_counter()
    with tqdm(total=a.steps, desc="fine-tuning", unit="step") as bar:
        for _ in range(a.steps):
            x, y, p = next(train)
            r = engine.step(x, y, position_ids=p)
            losses.append(r.loss)
            bar.set_postfix(loss=f"{r.loss:.4f}", lr=f"{r.lr:.2e}", tok_s=f"{r.tokens_per_s:.0f}")
            bar.update(1)
            if a.eval_every > 0 and (r.step % a.eval_every == 0 or r.step == a.steps):
                evals.append((r.step, evaluate()))
                tqdm.write(f"step {r.step}: eval loss {evals[-1][1]:.4f}")
    elapsed = time.perf_counter() - start
    if a.trace:
        engine.trace(a.trace)

    engine.finish()  # the model's parameters are the engine's compute copy: wait for the last updates
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(json.dumps(dict(out=str(out), steps=len(losses), first_loss=losses[0] if losses else None,
                          last_loss=losses[-1] if losses else None, evals=evals, seconds=round(elapsed, 3))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
