"""Preference training from the command line, through the real binary and the real data tool.

`python -m strider.data --mode preference` writes TRL's own sequences (TRL 1.16's DPOTrainer tokenizes the
prompt/chosen/rejected rows, its DataCollatorForPreference cuts them), each pair's chosen and rejected one in
consecutive windows. `strider finetune --objective dpo` on that file scores every sequence under the starting
weights before the first step (TRL's precompute_ref_log_probs), and trains as strider.Engine does from Python
on the same batches (to 1e-5 in fp32); killed and resumed it ends bit-identical to an uninterrupted run, in
full training and through LoRA. What the command line does not do is refused by name."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
import trl  # requirements.txt pins it (the reference): a missing one fails here, not skips
from safetensors.torch import load_file

import strider
from strider.data import read_token_file, window_order
from test_cli_faults import checkpoints, same_model, wait_for_step
from test_data_prep import make_tiny_tokenizer
from test_dpo_trainer import dpo_args, preference_data, tiny_model

SEQ = 16
PY = [sys.executable, "-m", "strider.data"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Llama and its tokenizer in one folder, TRL preference rows as JSON lines, their token file."""
    d = tmp_path_factory.mktemp("preference")
    tok = transformers.AutoTokenizer.from_pretrained(make_tiny_tokenizer(d / "tok"))
    model = d / "model"
    tiny_model(len(tok)).save_pretrained(model)
    tok.save_pretrained(model)
    preference_data().to_json(str(d / "pairs.jsonl"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run(PY + ["--tokenizer", str(model), "--input", str(d / "pairs.jsonl"), "--output",
                             str(d / "pairs.tokens"), "--mode", "preference", "--seq", str(SEQ)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["pairs"] == 12 and summary["seq"] == SEQ
    return dict(dir=d, model=model, tokens=d / "pairs.tokens", tokenizer=tok)


def test_the_preference_file_holds_trls_sequences_in_pairs(files, tmp_path):
    f = read_token_file(files["tokens"])
    assert f["pairs"] and f["example_seq"] == SEQ and len(f["doc_starts"]) == 24
    # TRL's own trainer on the same rows: its tokenized pairs, prompt then completion.
    model = tiny_model(len(files["tokenizer"]))
    trainer = trl.DPOTrainer(model=model, ref_model=tiny_model(len(files["tokenizer"])),
                             args=dpo_args(tmp_path, max_length=SEQ),
                             train_dataset=preference_data(), processing_class=files["tokenizer"])
    rows = trainer.train_dataset
    assert len(rows) == 12
    for i, row in enumerate(rows):
        for k, completion in enumerate((row["chosen_ids"], row["rejected_ids"])):
            want = (row["prompt_ids"] + completion)[:SEQ]
            at = (2 * i + k) * SEQ
            assert f["ids"][at:at + len(want)].tolist() == want
            mask = f["mask"][at:at + SEQ].tolist()
            assert mask == [0] * len(row["prompt_ids"]) + [1] * (len(want) - len(row["prompt_ids"])) + \
                [2] * (SEQ - len(want))


def cli(strider_binary, files, tmp_path, name, *args, steps=4, objective="dpo"):
    beta = ["--beta", "0.5"] if objective in ("dpo", "simpo", "orpo") else []
    cmd = [str(strider_binary("strider")), "finetune", "--model", str(files["model"]), "--data", str(files["tokens"]),
           "--objective", objective, *beta, "--seq", str(SEQ), "--micro-batch", "2", "--accumulation", "2",
           "--dtype", "fp32", "--device", "cpu", "--eval-batches", "0", "--lr", "1e-3", "--warmup", "0",
           "--schedule", "constant", "--save-dtype", "fp32", "--steps", str(steps),
           "--work-dir", str(tmp_path / f"work-{name}"), "--out", str(tmp_path / name), *args]
    return cmd


def ok(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def test_cli_dpo_trains_as_the_python_engine_does_on_the_same_batches(strider_binary, files, tmp_path):
    cmd = cli(strider_binary, files, tmp_path, "out", "--metrics", str(tmp_path / "m.jsonl"), "--checkpoint-dir",
              str(tmp_path / "ck"), "--eval-data", str(files["tokens"]), "--eval-every", "4")
    cmd[cmd.index("--eval-batches") + 1] = "1"
    out = ok(cmd)
    assert "reference log-probabilities of 12 pairs under the starting weights" in out
    # Before training the policy is the reference: every log-ratio is 0, the DPO loss log 2.
    assert "eval loss before training: 0.6931" in out
    info = strider.inspect_checkpoint(str(tmp_path / "ck" / checkpoints(tmp_path / "ck")[-1]))
    config = strider.EngineConfig.from_engine_dict(info["engine_config"], device="cpu")
    assert config.objective == "dpo" and config.beta == 0.5
    seed = info["extra"]["seed"]

    # The same steps from Python: the loader's pair order (window_order), each step 2 pairs' chosen rows then
    # their rejected ones, labels in transformers' convention, the reference under the starting weights.
    f = read_token_file(files["tokens"])
    ids, mask = torch.from_numpy(np.asarray(f["ids"], np.int64)), torch.from_numpy(np.asarray(f["mask"], np.int64))

    def rows(windows):
        x = torch.stack([ids[w * SEQ:w * SEQ + SEQ] for w in windows])
        m = torch.stack([mask[w * SEQ:w * SEQ + SEQ] for w in windows])
        return x, x.masked_fill(m != 1, -100), (m != 2).long()

    model = transformers.AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch.float32)
    engine = strider.Engine(model, config)
    every = list(range(24))
    reference = torch.cat([engine.logprobs(*rows(every[i:i + 4])) for i in range(0, 24, 4)])
    order = window_order(12, seed, 0)
    losses, margins = [], []
    for s in range(4):
        pairs = [int(p) for p in order[2 * s:2 * s + 2]]
        windows = [2 * p for p in pairs] + [2 * p + 1 for p in pairs]
        result = engine.step(*rows(windows), ref_logps=reference[windows])
        losses.append(result.loss)
        margins.append(result.metrics["rewards/margins"])
    # The evaluation after step 4: the file's first 2 pairs in order, chosen rows then rejected.
    windows = [0, 2, 1, 3]
    eval_loss = engine.evaluate(*rows(windows), ref_logps=reference[windows])
    engine.finish()
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert abs(lines[-1]["eval_loss"] - eval_loss) <= 1e-5 * eval_loss, (lines[-1], eval_loss)
    assert np.allclose([m["loss"] for m in lines], losses, rtol=1e-5, atol=0), (lines, losses)
    assert all(abs(m["rewards/margins"] - r) <= 1e-5 * (1 + abs(r)) for m, r in zip(lines, margins)), lines
    assert "| accuracy " in out and "| margin " in out
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, p in model.named_parameters():
        assert torch.allclose(saved[name], p.detach(), rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("lora", [[], ["--lora", "r=4,alpha=8,targets=all-linear"]], ids=["full", "lora"])
def test_cli_dpo_killed_and_resumed_is_bit_identical(strider_binary, files, tmp_path, lora):
    lora = [*lora, "--eval-data", str(files["tokens"]), "--eval-every", "3"]  # its reference is kept too

    def cli(*args, **kw):
        cmd = globals()["cli"](*args, **kw)
        cmd[cmd.index("--eval-batches") + 1] = "1"
        return cmd
    ok(cli(strider_binary, files, tmp_path, "straight", *lora, steps=6))
    p = subprocess.Popen(cli(strider_binary, files, tmp_path, "never", *lora, "--checkpoint-dir", str(tmp_path / "ck"),
                             steps=1_000_000), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(p, 2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err
    saved = json.loads((tmp_path / "ck" / checkpoints(tmp_path / "ck")[-1] / "trainer_state.json").read_text())
    assert 2 <= saved["step"] < 6
    out = ok(cli(strider_binary, files, tmp_path, "resumed", *lora, "--checkpoint-dir", str(tmp_path / "ck"),
                 "--resume", steps=6))
    assert f"at step {saved['step']}" in out
    assert "reference log-probabilities" not in out  # taken from the checkpoint, never recomputed
    if "--lora" in lora:
        a = load_file(str(tmp_path / "straight" / "adapter_model.safetensors"))
        b = load_file(str(tmp_path / "resumed" / "adapter_model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    else:
        assert same_model(tmp_path / "straight", tmp_path / "resumed")


def test_what_the_command_line_does_not_do_is_refused_by_name(strider_binary, files, tmp_path):
    def refused(*args, says, objective="dpo", **values):
        cmd = cli(strider_binary, files, tmp_path, "out", *args, objective=objective)
        for flag, value in values.items():  # --data, --eval-batches: another value
            cmd[cmd.index("--" + flag.replace("_", "-")) + 1] = str(value)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and says in r.stderr, r.stderr[-2000:]

    refused(objective="grpo", says="--objective grpo: its rollouts are generated outside strider")
    refused(objective="sft", says="a preference file")
    plain = tmp_path / "plain.tokens"
    strider.data.write_token_file(plain, np.arange(400) % 30, vocab_size=len(files["tokenizer"]))
    refused(says="not a preference file", data=plain)
    refused("--eval-data", str(plain), eval_batches=1, says="not a preference file")
    # A run without a reference (simpo has none) resumed as dpo: its reference is never computed from
    # trained weights.
    ck = tmp_path / "ck"
    ok(cli(strider_binary, files, tmp_path, "simpo", "--checkpoint-dir", str(ck), steps=2, objective="simpo"))
    refused("--checkpoint-dir", str(ck), "--resume", "--allow-changed", "objective,beta", steps=4,
            says="holds no reference log-probabilities")


@pytest.mark.parametrize("name, change", [("beta", ["--beta", "0.25"]), ("loss_type", ["--loss-type", "ipo"]),
                                          ("label_smoothing", ["--loss-type", "robust", "--label-smoothing", "0.1"])])
def test_an_objective_setting_changed_on_resume_is_refused_by_name_unless_allowed(strider_binary, files, tmp_path,
                                                                                name, change):
    """test_hostile changes every other maths setting through the command line; these need a preference file.
    (From Python, test_objectives.py changes each of them alone.)"""
    ck = tmp_path / "ck"
    ok(cli(strider_binary, files, tmp_path, "first", "--checkpoint-dir", str(ck), steps=1))

    def resume(*more):
        cmd = cli(strider_binary, files, tmp_path, "again", "--checkpoint-dir", str(ck), "--resume", *more, steps=2)
        for flag, value in zip(change[::2], change[1::2]):
            if flag in cmd:
                cmd[cmd.index(flag) + 1] = value
            else:
                cmd += [flag, value]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    r = resume()
    assert r.returncode != 0 and f"{name}: checkpoint " in r.stderr and "--allow-changed" in r.stderr, r.stderr[-2000:]
    allowed = ",".join(["loss_type", name] if name == "label_smoothing" else [name])
    r = resume("--allow-changed", allowed)
    assert r.returncode == 0 and "at step 1" in r.stdout, r.stderr[-2000:]


def test_cli_dpo_as_two_data_parallel_ranks_trains_as_one_process(strider_binary, files, tmp_path):
    """2 ranks under torchrun, each a pair a step (its chosen row, then its rejected one), against one process
    with both pairs a step: the same pairs, the same DPO mean over them (the ranks' is global), so the same
    losses and weights to 1e-5 (the rows sit in other micro-batches, so not the same bits). Every rank scores
    every pair for the reference, as one process does."""
    def run(name, ranks, accumulation):
        cmd = cli(strider_binary, files, tmp_path, name, "--checkpoint-dir", str(tmp_path / f"ck-{name}"),
                  "--metrics", str(tmp_path / f"{name}.jsonl"), "--grad-transfer", "fp32")
        cmd[cmd.index("--micro-batch") + 1] = "2"
        cmd[cmd.index("--accumulation") + 1] = str(accumulation)
        if ranks > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   "--no-python", *cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if "this build has none" in r.stdout + r.stderr:
            pytest.skip("this build has no c10d Gloo (no gloo headers: scripts/setup.sh installs libgloo-dev)")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        ck = tmp_path / f"ck-{name}"
        return ([json.loads(line)["loss"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()],
                load_file(str(ck / checkpoints(ck)[-1] / "state.safetensors")))

    (ranks_loss, ranks_state), (one_loss, one_state) = run("ranks", 2, 1), run("one", 1, 2)
    assert len(ranks_loss) == 4 and np.allclose(ranks_loss, one_loss, rtol=1e-5, atol=0), (ranks_loss, one_loss)
    assert ranks_state.keys() == one_state.keys()
    for k in one_state:
        assert torch.allclose(ranks_state[k], one_state[k], rtol=1e-4, atol=1e-6), k


def test_a_signal_while_the_reference_is_scored_ends_the_run_before_its_first_step(strider_binary, files, tmp_path):
    """4800 pairs (the file's 12, 400 times): scoring them takes seconds; SIGTERM as it begins ends the run
    between two batches, before the first step, with nothing to save."""
    f = read_token_file(files["tokens"])
    n = len(f["doc_starts"])
    ids, mask = np.asarray(f["ids"][:n * SEQ]), np.asarray(f["mask"][:n * SEQ])
    big = tmp_path / "big.tokens"
    strider.data.write_token_file(big, np.concatenate([np.tile(ids, 400), [0]]),
                                  np.concatenate([np.tile(mask, 400), [2]]), [k * SEQ for k in range(400 * n)],
                                  vocab_size=f["vocab_size"], example_seq=SEQ, pairs=True)
    cmd = cli(strider_binary, files, tmp_path, "out", "--checkpoint-dir", str(tmp_path / "ck"))
    cmd[cmd.index("--data") + 1] = str(big)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.strip().startswith("reference log-probabilities of 4800 pairs"):
            break
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "scoring the reference interrupted after" in out and "before the first step" in out, out[-2000:]
    assert not (tmp_path / "ck").exists() or not checkpoints(tmp_path / "ck")
