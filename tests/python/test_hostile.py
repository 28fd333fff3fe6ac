"""Classes of hostile input to `strider finetune`, through the real binary (issue 63): each case of a class, not
one example of it. Every output option aliased to every input option is refused before the first step with the
input unchanged; every file-reading option given a FIFO, a directory, a dangling symlink or a name that is not
UTF-8 ends before the first step (refused, naming the option) or trains, and never hangs."""
import hashlib
import os
import subprocess

import pytest

from test_cli_faults import strider  # noqa: F401  (the fixture)
from test_cli_paths import tiny_model_and_tokens

OUTPUTS_FILE = ("--trace", "--metrics")
OUTPUTS_DIR = ("--out", "--checkpoint-dir", "--nvme")
INPUTS = ("--model", "--data", "--eval-data", "--config")


def finetune(strider, tmp_path, *args, timeout=60):
    # One evaluation batch, so that --eval-data is read (with none it is not: a warning says so).
    cmd = [str(strider), "finetune", "--device", "cpu", "--seq", "16", "--micro-batch", "1", "--accumulation", "1",
           "--steps", "1", "--eval-batches", "1", *args]
    return subprocess.run(cmd, capture_output=True, timeout=timeout, cwd=tmp_path)


def digest(path):
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture
def inputs(tmp_path):
    model, data = tiny_model_and_tokens(tmp_path)
    eval_data = tmp_path / "eval.tokens"
    eval_data.write_bytes(data.read_bytes())
    conf = tmp_path / "c.toml"
    conf.write_text("lr = 1e-4\n")
    return {"--model": model, "--data": data, "--eval-data": eval_data, "--config": conf}


def given(inputs, **over):
    args = []
    for option in INPUTS:
        args += [option, str(over.get(option, inputs[option]))]
    return args


@pytest.mark.parametrize("output", OUTPUTS_FILE + OUTPUTS_DIR)
def test_every_output_over_every_input_is_refused_and_nothing_is_lost(strider, tmp_path, inputs, output):
    before = {option: digest(path) for option, path in inputs.items()}
    for option, path in inputs.items():
        # The input itself, and (a folder) a file inside it.
        targets = [path] + ([path / "model.safetensors"] if path.is_dir() else [])
        for target in targets:
            others = [] if output == "--out" else ["--out", str(tmp_path / "out")]
            r = finetune(strider, tmp_path, *given(inputs), *others, output, str(target))
            err = r.stderr.decode(errors="replace")
            assert r.returncode != 0, (output, option, target)
            assert output in err, (output, option, target, err[-1000:])
            assert b"step    1" not in r.stdout, (output, option, target)
    assert {option: digest(path) for option, path in inputs.items()} == before
    assert not (tmp_path / "out" / "model.safetensors").exists()


def hostile_paths(tmp_path):
    fifo = tmp_path / "a-fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "a-folder"
    folder.mkdir()
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nothing-here")
    return {"FIFO": fifo, "directory": folder, "dangling symlink": dangling}


@pytest.mark.parametrize("option", INPUTS)
def test_every_file_option_given_a_fifo_a_folder_or_a_dangling_link_ends_before_the_first_step(strider, tmp_path,
                                                                                               inputs, option):
    for kind, path in hostile_paths(tmp_path).items():
        if option == "--model" and kind == "directory":
            continue  # a model is a folder: an empty one is the next test's
        r = finetune(strider, tmp_path, *given(inputs, **{option: path}), "--out", str(tmp_path / "out"))
        err = r.stderr.decode(errors="replace")
        assert r.returncode != 0, (option, kind)
        assert b"step    1" not in r.stdout, (option, kind)
        assert str(path.name) in err or option in err, (option, kind, err[-1000:])
    # A model folder whose config.json is a FIFO, a folder, or missing.
    if option == "--model":
        for kind in ("FIFO", "directory", "missing"):
            model = tmp_path / f"model-{kind}"
            model.mkdir()
            if kind == "FIFO":
                os.mkfifo(model / "config.json")
            elif kind == "directory":
                (model / "config.json").mkdir()
            r = finetune(strider, tmp_path, *given(inputs, **{"--model": model}), "--out", str(tmp_path / "out"))
            err = r.stderr.decode(errors="replace")
            assert r.returncode != 0 and b"step    1" not in r.stdout, kind
            assert "config.json" in err, (kind, err[-1000:])


def test_an_input_nothing_would_read_is_refused(strider, tmp_path, inputs):
    r = subprocess.run([str(strider), "finetune", "--device", "cpu", "--steps", "1", "--eval-batches", "0",
                        *given(inputs), "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "step    1" not in r.stdout
    assert "--eval-data" in r.stderr and "--eval-batches is 0, so nothing would read it" in r.stderr


@pytest.mark.parametrize("option", INPUTS)
def test_every_file_option_under_a_name_that_is_not_utf8_is_refused_before_the_first_step_or_trains(
        strider, tmp_path, inputs, option):
    source = inputs[option]
    odd = tmp_path.joinpath(os.fsdecode(b"r\xe9glages-") + source.name)
    os.rename(source, odd)
    r = finetune(strider, tmp_path, *given(inputs, **{option: odd}), "--out", str(tmp_path / "out"))
    err = r.stderr.decode(errors="replace")
    if r.returncode != 0:
        assert b"step    1" not in r.stdout, err[-1000:]
        assert option in err or "UTF-8" in err, err[-1000:]
    else:
        assert (tmp_path / "out" / "strider-out.json").exists()
