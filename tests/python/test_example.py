"""python_shim/examples/finetune_text.py, end to end on a tiny random Llama and the tiny local tokenizer:
it tokenizes, trains through strider.Engine, evaluates, and saves a model that from_pretrained loads with
the trained weights (the held-out-free eval loss on the repeated text must fall)."""
import json
import os
import subprocess
import sys

import torch

import transformers  # requirements.txt: a missing one fails here, not skips
import strider  # noqa: E402
from test_data_prep import SENTENCES, make_tiny_tokenizer  # noqa: E402

from conftest import require_op_library  # noqa: E402

require_op_library()

EXAMPLE = os.path.join(os.path.dirname(strider.__file__), os.pardir, "examples", "finetune_text.py")


def test_finetune_text_example(tmp_path):
    make_tiny_tokenizer(tmp_path / "model")
    vocab = len(transformers.AutoTokenizer.from_pretrained(tmp_path / "model"))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64)
    initial = transformers.LlamaForCausalLM(cfg)
    initial.save_pretrained(tmp_path / "model")
    (tmp_path / "corpus.txt").write_text("\n".join(SENTENCES * 8) + "\n")

    args = [sys.executable, EXAMPLE, "--model", tmp_path / "model", "--data", tmp_path / "corpus.txt",
                          "--out", tmp_path / "out", "--seq", 16, "--micro-batch", 2, "--accumulation", 2,
                          "--dtype", "fp32", "--steps", 6, "--lr", 1e-2, "--schedule", "constant",
                          "--eval-every", 3, "--eval-batches", 2, "--device", "cpu"]
    out = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 6 and [s for s, _ in summary["evals"]] == [0, 3, 6]
    assert summary["evals"][-1][1] < summary["evals"][0][1], summary["evals"]
    assert "fine-tuning" in out.stderr  # the progress bar

    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    moved = [n for n, p in trained.named_parameters() if not torch.equal(p, dict(initial.named_parameters())[n])]
    assert len(moved) == len(list(initial.parameters()))
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out")("hello")["input_ids"][0] == 2  # BOS


def test_grpo_loop_example_learns_its_reward():
    """python_shim/examples/grpo_loop.py: GRPO through strider on rollouts model.generate samples from the
    engine's own weights. Over 3 seeds the mean reward of the last 10 of 40 steps exceeds the first 10's by at
    least 0.2 (a random policy scores 0.5; the README's docs quote the run's figures)."""
    example = os.path.join(os.path.dirname(EXAMPLE), "grpo_loop.py")
    r = subprocess.run([sys.executable, example, "--seeds", "1,2,3", "--steps", "40"], capture_output=True,
                       text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    gains = [s["last10"] - s["first10"] for s in summary.values()]
    assert len(gains) == 3 and sum(gains) / 3 >= 0.2, summary
    assert all(g > 0.1 for g in gains), gains
