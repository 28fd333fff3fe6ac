"""`strider score` (issue 62): every window of a token file scored by a saved transformers checkpoint, forward
only, one JSON line per window in the file's order, held to transformers' log_softmax of the same window in
fp32 (a masked prompt's tokens no target); the lines are the same at another batch; --out is written whole, and
an --out over an input is refused before anything runs."""
import json
import subprocess

import numpy as np
import pytest
import torch
import transformers

from test_cli_faults import strider  # noqa: F401  (the fixture)
from test_token_data import write_tokens

SEQ, VOCAB = 16, 256


@pytest.fixture
def inputs(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, 10 * SEQ + 1)
    mask = np.ones(len(ids), np.uint8)
    mask[SEQ + 1: SEQ + 6] = 0  # window 1's first five targets are a prompt's
    write_tokens(tmp_path / "d.tokens", ids, mask=mask, vocab=VOCAB)
    return tmp_path / "model", tmp_path / "d.tokens", ids, mask


def score(strider, tmp_path, model, data, *extra):
    r = subprocess.run([str(strider), "score", "--model", str(model), "--data", str(data), "--seq", str(SEQ),
                        "--device", "cpu", "--dtype", "fp32", "--work-dir", str(tmp_path / "work"), *extra],
                       capture_output=True, text=True, timeout=120)
    return r


def test_each_window_is_scored_as_transformers_scores_it(strider, tmp_path, inputs):  # noqa: F811
    model_dir, data, ids, mask = inputs
    r = score(strider, tmp_path, model_dir, data, "--micro-batch", "2", "--accumulation", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["window"] for x in lines] == list(range(10))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for x in lines:
        first = x["first_token"]
        assert first == x["window"] * SEQ
        window = torch.as_tensor(ids[first: first + SEQ + 1]).unsqueeze(0)
        with torch.no_grad():
            logits = model(window[:, :-1]).logits.float()
        lp = torch.log_softmax(logits, -1).gather(-1, window[:, 1:].unsqueeze(-1)).squeeze()
        counts = torch.as_tensor(mask[first + 1: first + SEQ + 1] == 1)
        assert x["targets"] == int(counts.sum())
        assert x["logprob"] == pytest.approx(float(lp[counts].double().sum()), rel=1e-5)
        assert x["mean_logprob"] == pytest.approx(x["logprob"] / x["targets"])
    assert lines[1]["targets"] == SEQ - 5
    # Another batch, and a file: the same lines, written whole.
    r = score(strider, tmp_path, model_dir, data, "--micro-batch", "3", "--accumulation", "1",
              "--out", str(tmp_path / "s.jsonl"))
    assert r.returncode == 0, r.stderr[-2000:]
    again = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [x["window"] for x in again] == list(range(10))
    for a, b in zip(lines, again):
        assert a["targets"] == b["targets"] and a["logprob"] == pytest.approx(b["logprob"], rel=1e-6)


def test_an_out_over_an_input_is_refused_before_anything_runs(strider, tmp_path, inputs):  # noqa: F811
    model_dir, data, _, _ = inputs
    before = data.read_bytes()
    for target in (data, model_dir / "model.safetensors"):
        r = score(strider, tmp_path, model_dir, data, "--out", str(target))
        assert r.returncode != 0 and "--out" in r.stderr and "loaded model" not in r.stdout, r.stderr[-1000:]
    assert data.read_bytes() == before
    conf = tmp_path / "c.toml"
    conf.write_text("seq = 16\n")
    r = score(strider, tmp_path, model_dir, data, "--out", str(conf), "--config", str(conf))
    assert r.returncode != 0 and "--config" in r.stderr and conf.read_text() == "seq = 16\n", r.stderr[-1000:]
    r = score(strider, tmp_path, model_dir, data, "--out", str(tmp_path))
    assert r.returncode != 0 and "--out" in r.stderr
