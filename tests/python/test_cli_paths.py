"""What `strider finetune` reads and what it writes stay apart, through the real binary: an output over an
input, over another output or inside a directory the run prunes is refused before anything is written, and a
path or config the checkpoints' JSON cannot hold is refused before the first step, not at the first save."""
import hashlib
import os
import subprocess

import numpy as np
from transformers import LlamaConfig, LlamaForCausalLM

from test_cli_faults import run, strider  # noqa: F401  (strider: the fixture)
from test_token_data import write_tokens


def tiny_model_and_tokens(tmp_path):
    """A 2-layer Llama saved under tmp_path/model and 4096 random tokens in tmp_path/train.tokens."""
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    model = tmp_path / "model"
    LlamaForCausalLM(cfg).save_pretrained(model)
    data = tmp_path / "train.tokens"
    write_tokens(data, np.random.default_rng(0).integers(0, 256, 4096), vocab=256)
    return model, data


def test_an_output_that_names_an_input_or_another_output_is_refused_and_nothing_is_lost(strider, tmp_path):
    """An output over an input (the trace over the base model's weights, the metrics appended to the token
    file, the trace over the config), the same file twice, and a file inside the directory whose checkpoints
    the run prunes: each refused before the first step, naming both options, with every file as it was."""
    model, data = tiny_model_and_tokens(tmp_path)
    conf = tmp_path / "c.toml"
    conf.write_text("steps = 2\n")
    (tmp_path / "link").symlink_to(data)                # the token file by another name
    os.link(data, tmp_path / "hard")                    # and by a hard link
    files = [model / "model.safetensors", model / "config.json", data, conf]
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    common = ("--model", str(model), "--data", str(data), "--config", str(conf))
    cases = [
        (("--trace", str(model / "model.safetensors")), "--trace", "lies inside --model"),
        (("--metrics", str(model / "config.json")), "--metrics", "lies inside --model"),
        (("--trace", str(data)), "--trace", "is --data"),
        (("--trace", str(tmp_path / "sub" / ".." / "train.tokens")), "--trace", "is --data"),
        (("--metrics", str(tmp_path / "link")), "--metrics", "is --data"),
        (("--metrics", str(tmp_path / "hard")), "--metrics", "is --data"),
        (("--trace", str(conf)), "--trace", "is --config"),
        (("--out", str(model)), "--out", "is --model"),
        (("--trace", str(tmp_path / "t.json"), "--metrics", str(tmp_path / "t.json")), "--metrics",
         "is also this run's --trace"),
        (("--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(tmp_path / "ck" / "m.jsonl")), "--metrics",
         "lies inside --checkpoint-dir"),
    ]
    for args, option, why in cases:
        out = () if "--out" in args else ("--out", str(tmp_path / "o"))
        r = run(strider, tmp_path, *common, *out, *args)
        assert r.returncode != 0, args
        assert option in r.stderr and why in r.stderr, (args, r.stderr[-1000:])
        assert "step    1" not in r.stdout, args
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in files} == before
    assert not (tmp_path / "ck").exists() and not (tmp_path / "t.json").exists()
    # Apart, the same paths train.
    r = run(strider, tmp_path, *common, "--out", str(tmp_path / "o"), "--trace", str(tmp_path / "t.json"),
            "--metrics", str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(tmp_path / "ck"))
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_path_or_config_that_is_not_utf8_is_refused_before_the_first_step(strider, tmp_path):
    """Every checkpoint records the data's and the config's paths and the config's text as JSON (UTF-8 only):
    a byte that is not UTF-8 in any of them is refused before the first step, naming the option, where it
    used to train every step and then fail at the save with nothing kept."""
    data = tmp_path / os.fsdecode(b"d\xe9.tokens")
    write_tokens(data, np.random.default_rng(0).integers(0, 256, 4096), vocab=256)
    ck = tmp_path / "ck"
    conf = tmp_path / "c.toml"  # TOML is UTF-8: its reader refuses the byte, naming line and column
    conf.write_bytes(b"# r\xe9glages\nsteps = 2\n")
    r = run(strider, tmp_path, "--config", str(conf), "--checkpoint-dir", str(ck), "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "line 1, column 3: Encountered invalid utf-8" in r.stderr, r.stderr[-2000:]
    assert "step    1" not in r.stdout
    conf = tmp_path / "c.ini"  # INI is bytes: the record's check refuses it
    conf.write_bytes(b"# r\xe9glages\nsteps = 2\n")
    r = run(strider, tmp_path, "--config", str(conf), "--checkpoint-dir", str(ck), "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "--config's text holds bytes that are not UTF-8" in r.stderr, r.stderr[-2000:]
    assert "step    1" not in r.stdout
    r = run(strider, tmp_path, "--data", str(data), "--steps", "2", "--checkpoint-dir", str(ck),
            "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "--data holds bytes that are not UTF-8" in r.stderr, r.stderr[-2000:]
    assert "step    1" not in r.stdout and not any(ck.glob("step-*"))
    # The same data under a UTF-8 name trains and saves.
    (tmp_path / "d.tokens").write_bytes(data.read_bytes())
    r = run(strider, tmp_path, "--data", str(tmp_path / "d.tokens"), "--steps", "2", "--checkpoint-dir", str(ck),
            "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert any(ck.glob("step-*"))


def test_a_fifo_given_as_an_input_is_refused_at_once(strider, tmp_path):
    """A FIFO blocks open() until a writer comes: as --data, --eval-data, a model's config.json or its
    weights, or --config, each is refused naming it before any work, not waited on."""
    model, data = tiny_model_and_tokens(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    fifo_model = tmp_path / "fifo-model"
    fifo_model.mkdir()
    (fifo_model / "config.json").write_text((model / "config.json").read_text())
    os.mkfifo(fifo_model / "model.safetensors")
    fifo_config = tmp_path / "fifo-config"
    fifo_config.mkdir()
    os.mkfifo(fifo_config / "config.json")
    cases = [(("--model", str(model), "--data", str(fifo)), f"{fifo}: not a regular file"),
             (("--model", str(model), "--data", str(data), "--eval-data", str(fifo), "--eval-batches", "1"),
              f"{fifo}: not a regular file"),
             (("--model", str(fifo_config), "--data", str(data)), f"{fifo_config / 'config.json'}: not a regular file"),
             (("--model", str(fifo_model), "--data", str(data)), f"{fifo_model / 'model.safetensors'}: not a regular"),
             (("--model", str(model), "--data", str(data), "--config", str(fifo)), f"{fifo}: not a regular file"),
             ]
    for args, says in cases:
        cmd = [str(strider), "finetune", "--device", "cpu", "--seq", "16", "--steps", "1", "--work-dir",
               str(tmp_path / "work"), "--out", str(tmp_path / "out"), *args]
        if "--eval-batches" not in args:
            cmd += ["--eval-batches", "0"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and says in r.stderr, (args, r.stderr[-1500:])
