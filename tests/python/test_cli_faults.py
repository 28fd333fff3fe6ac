"""`strider finetune` under faults and bad input, through the real binary:
each test starts the process (or several) in its own temporary directory,
with real signals, real files and real locks, and checks what a user relies
on: a diverging run ends non-zero with the last finite checkpoint on disk, a
signal saves and resumes bit-identically, outputs are checked before the
first step, a second run on the same directories is refused, out-of-range
options are refused while parsing, and resuming on other data is refused
unless asked for."""
import concurrent.futures
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from test_token_data import write_tokens

BASE = ("--device", "cpu", "--seq", "32", "--micro-batch", "2", "--accumulation", "2", "--eval-batches", "0")


@pytest.fixture
def strider(strider_binary):
    return strider_binary("strider")


def run(strider, tmp_path, *args, timeout=300, work="work"):
    cmd = [str(strider), "finetune", *BASE, "--work-dir", str(tmp_path / work), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def ok(strider, tmp_path, *args):
    r = run(strider, tmp_path, *args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def start(strider, tmp_path, *args):
    cmd = [str(strider), "finetune", *BASE, "--work-dir", str(tmp_path / "work"), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(p, n, timeout=120):
    """Reads the run's output until step n is printed."""
    deadline = time.time() + timeout
    for line in p.stdout:
        if line.startswith(f"step {n:>4}/"):
            return
        assert time.time() < deadline, "the run did not reach step %d in time" % n
    raise AssertionError("the run ended before step %d: %s" % (n, p.stderr.read()[-2000:]))


def checkpoints(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def same_model(a, b):
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k].view(torch.int16), y[k].view(torch.int16)) for k in x)


def test_a_diverging_run_stops_nonzero_with_the_last_finite_checkpoint(strider, tmp_path):
    ck = tmp_path / "ck"
    r = run(strider, tmp_path, "--lr", "1e20", "--warmup", "0", "--steps", "10", "--checkpoint-dir", str(ck),
            "--checkpoint-every", "1", "--keep-checkpoints", "3", "--out", str(tmp_path / "out"))
    assert r.returncode != 0
    assert "skipped: loss is nan" in r.stdout or "skipped: loss is inf" in r.stdout
    assert "the run diverged" in r.stderr and "3 steps in a row were skipped" in r.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()  # no final model from a diverged run
    good = [int(l.split()[1].split("/")[0]) for l in r.stdout.splitlines() if l.startswith("step") and "| loss" in l]
    newest = ck / checkpoints(ck)[-1]
    state = json.loads((newest / "trainer_state.json").read_text())
    assert good and state["step"] == good[-1]
    tensors = load_file(str(newest / "state.safetensors"))
    assert all(torch.isfinite(t).all() for t in tensors.values())


def test_sigterm_saves_and_the_resume_is_bit_identical(strider, tmp_path):
    # A constant learning rate, so the signalled run can be one that never
    # ends by itself (it cannot finish before the signal is handled, however
    # fast the machine) and a resume with --steps 6 still follows the
    # straight run's schedule (a resume may change --steps).
    constant = ("--schedule", "constant", "--warmup", "0")
    ok(strider, tmp_path, *constant, "--steps", "6", "--out", str(tmp_path / "straight"))
    p = start(strider, tmp_path, *constant, "--steps", "1000000", "--checkpoint-dir", str(tmp_path / "ck"),
              "--out", str(tmp_path / "never"))
    wait_for_step(p, 2)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "interrupted by SIGTERM" in out
    saved = json.loads((tmp_path / "ck" / checkpoints(tmp_path / "ck")[-1] / "trainer_state.json").read_text())
    assert 2 <= saved["step"] < 6
    assert not (tmp_path / "never" / "model.safetensors").exists()
    out = ok(strider, tmp_path, *constant, "--steps", "6", "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
             "--out", str(tmp_path / "resumed"))
    assert f"at step {saved['step']}" in out
    assert same_model(tmp_path / "straight", tmp_path / "resumed")


def test_sigint_without_a_checkpoint_dir_saves_under_out(strider, tmp_path):
    p = start(strider, tmp_path, "--steps", "1000", "--out", str(tmp_path / "out"))
    wait_for_step(p, 2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGINT, err
    root = tmp_path / "out" / "strider-checkpoints"
    assert f"--checkpoint-dir {root} --resume" in out
    assert len(checkpoints(root)) == 1


def test_a_signal_before_the_first_step_or_during_an_evaluation_ends_the_run_with_a_line(strider, tmp_path):
    # A long evaluation before training (the built-in held-out data, many batches): the signal lands in
    # it, or in the set-up before it, and the run ends without waiting for the whole evaluation.
    cmd = [str(strider), "finetune", "--device", "cpu", "--work-dir", str(tmp_path / "work"), "--eval-batches",
           "100000", "--steps", "3", "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "o")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    held_out = tmp_path / "work" / "builtin-eval.tokens"  # written just before the evaluation starts
    deadline = time.monotonic() + 120
    while not held_out.exists() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    start = time.monotonic()
    out, err = p.communicate(timeout=120)
    assert time.monotonic() - start < 30  # 100000 batches would take hours
    assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "interrupted by SIGTERM before the first step: nothing new to save" in out, out[-2000:]
    assert "step    1" not in out and checkpoints(tmp_path / "ck") == []


def test_a_second_signal_ends_the_run_at_once_and_the_last_checkpoint_loads(strider, tmp_path):
    ck = tmp_path / "ck"
    p = start(strider, tmp_path, "--steps", "1000", "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
              "--out", str(tmp_path / "out"))
    wait_for_step(p, 2)
    p.send_signal(signal.SIGTERM)
    for line in p.stdout:  # the first one is handled: the save has begun
        if line.startswith("interrupted by SIGTERM"):
            break
    p.send_signal(signal.SIGTERM)  # mid-save (it writes and fsyncs tens of MB)
    p.communicate(timeout=120)
    assert p.returncode == -signal.SIGTERM  # ended by the signal, not after the save
    out = ok(strider, tmp_path, "--checkpoint-dir", str(ck), "--resume", "--steps", "6", "--allow-changed", "total_steps", "--out",
             str(tmp_path / "out"))
    assert "resumed from" in out


def test_a_step_directory_that_is_not_a_checkpoint_is_moved_aside_not_in_the_way(strider, tmp_path):
    ck = tmp_path / "ck"
    ok(strider, tmp_path, "--steps", "2", "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
       "--keep-checkpoints", "5", "--out", str(tmp_path / "out"))
    assert checkpoints(ck) == ["step-00000001", "step-00000002"]
    # An empty directory where step 3's checkpoint goes, and a foreign one older than every checkpoint.
    (ck / "step-00000003").mkdir()
    foreign = ck / "step-00000000"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone else's")
    r = run(strider, tmp_path, "--steps", "5", "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
            "--keep-checkpoints", "2", "--resume", "--allow-changed", "total_steps", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "at step 2" in r.stdout  # the empty step-3 was skipped on load, with a warning
    assert "skipping the damaged checkpoint" in r.stderr and "step-00000003" in r.stderr
    assert "moved to" in r.stderr and "step-00000003.unreadable-1" in r.stderr
    # Nothing that was there is lost: the empty directory moved aside, the foreign one kept
    # (the two newest checkpoints kept, the older ones of the run removed).
    assert (ck / "step-00000003.unreadable-1").is_dir()
    assert (foreign / "notes.txt").read_text() == "someone else's"
    assert [c for c in checkpoints(ck) if "." not in c] == ["step-00000000", "step-00000004", "step-00000005"]
    state = json.loads((ck / "step-00000005" / "trainer_state.json").read_text())
    assert state["step"] == 5


def test_the_newest_checkpoint_is_the_highest_step_it_records_not_its_name(strider, tmp_path):
    ck = tmp_path / "ck"
    ok(strider, tmp_path, "--steps", "3", "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
       "--keep-checkpoints", "5", "--out", str(tmp_path / "out"))
    # step-2's checkpoint renamed past step 3's name (a copy, a manual rename).
    (ck / "step-00000002").rename(ck / "step-00000009")
    out = ok(strider, tmp_path, "--steps", "4", "--checkpoint-dir", str(ck), "--resume", "--allow-changed", "total_steps", 
             "--out", str(tmp_path / "out2"))
    assert f"resumed from {ck / 'step-00000003'} at step 3" in out


def test_a_checkpoint_that_fails_to_save_loses_nothing_else(strider, tmp_path):
    """A periodic checkpoint that cannot be saved (here a file lies where it goes) fails alone: the run goes on
    and a later one saves. A final checkpoint that fails still leaves the final --out, and the run's end names
    what was kept and where (issue 63, data lost 3)."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "step-00000002").write_text("in the way")
    r = run(strider, tmp_path, "--steps", "3", "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
            "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "warning: the checkpoint of step 2 failed" in r.stderr
    assert f"the last checkpoint (step 1) stays in {ck}" in r.stderr
    assert (ck / "step-00000003" / "trainer_state.json").exists()
    assert (tmp_path / "out" / "model.safetensors").exists()

    ck2 = tmp_path / "ck2"
    ck2.mkdir()
    (ck2 / "step-00000002").write_text("in the way")
    r = run(strider, tmp_path, "--steps", "2", "--checkpoint-dir", str(ck2), "--checkpoint-every", "1",
            "--out", str(tmp_path / "out2"))
    assert r.returncode != 0
    assert "the checkpoint of step 2 failed" in r.stderr, r.stderr[-2000:]
    assert f"the trained model is saved in --out {tmp_path / 'out2'}, and the last checkpoint (step 1) stays in " \
           f"{ck2}" in r.stderr
    assert (tmp_path / "out2" / "model.safetensors").exists()
    assert (ck2 / "step-00000001" / "trainer_state.json").exists()


def test_outputs_are_checked_before_the_first_step(strider, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    r = run(strider, tmp_path, "--steps", "3", "--out", str(tmp_path / "file" / "out"))
    assert r.returncode != 0 and "--out" in r.stderr and "step    1" not in r.stdout
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = run(strider, tmp_path, "--steps", "3", "--trace", str(fifo), "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "--trace" in r.stderr and "not a regular file" in r.stderr
    assert fifo.exists() and not fifo.is_file()  # untouched
    r = run(strider, tmp_path, "--steps", "3", "--metrics", str(tmp_path), "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "--metrics" in r.stderr and "step    1" not in r.stdout
    r = run(strider, tmp_path, "--steps", "3", "--checkpoint-dir", str(tmp_path / "file"), "--out",
            str(tmp_path / "o"))
    assert r.returncode != 0 and "--checkpoint-dir" in r.stderr


def test_a_metrics_write_error_stops_the_run(strider, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with open(disk / "filler", "wb", buffering=0) as f:  # then leave room for about one metrics line
            try:
                while True:
                    f.write(b"x" * 512)
                    f.flush()
            except OSError:
                pass
        os.truncate(disk / "filler", os.path.getsize(disk / "filler") - 1024)
        r = run(strider, tmp_path, "--steps", "20", "--metrics", str(disk / "m.jsonl"), "--out", str(tmp_path / "o"))
        assert r.returncode != 0
        assert "--metrics" in r.stderr and "writing failed" in r.stderr
    finally:
        subprocess.run(["umount", "-l", str(disk)])


@pytest.mark.parametrize("what", ["--checkpoint-dir", "--nvme", "--out"])
def test_a_second_run_on_the_same_directory_is_refused_naming_the_holder(strider, tmp_path, what):
    shared = tmp_path / "shared"
    # The run takes the lock on --nvme whether or not the plan puts state there.
    own = lambda name: () if what == "--out" else ("--out", str(tmp_path / name))  # noqa: E731
    a = start(strider, tmp_path, "--steps", "1000", what, str(shared), *own("a"))
    try:
        wait_for_step(a, 1)
        b = run(strider, tmp_path, "--steps", "2", what, str(shared), *own("b"), work="work-b")
        assert b.returncode != 0
        assert "in use by another strider run" in b.stderr and f"pid {a.pid}" in b.stderr, b.stderr
        if what == "--out":  # the output folder holds nothing of the lock
            assert not list(shared.glob(".strider*"))
    finally:
        a.kill()
        a.communicate()


BAD_OPTIONS = [("--steps", "0"), ("--steps", "-3"), ("--warmup", "-5"), ("--window", "-1"), ("--vocab-chunk", "0"),
               ("--optimizer-threads", "-1"), ("--eval-every", "0"), ("--checkpoint-every", "-1"), ("--lr", "-1"),
               ("--lr", "nan"), ("--keep-checkpoints", "0"), ("--max-skipped-steps", "0"), ("--seq", "0"),
               ("--accumulation", "-2"), ("--clip", "-1"), ("--weight-decay", "-0.1"), ("--allow-changed", "colour")]


def test_out_of_range_options_are_refused_while_parsing(strider, tmp_path):
    def refused(case):
        option, value = case
        work = tmp_path / ("w" + option + value)
        r = subprocess.run([str(strider), "finetune", option, value, "--work-dir", str(work)],
                           capture_output=True, text=True, timeout=120)
        ok = (r.returncode != 0 and option in r.stderr and
              any(s in r.stderr for s in ("is outside", "not in {", "not a number",
                                          "is not a setting a resume may change")) and not work.exists())
        return None if ok else f"{option} {value}: rc {r.returncode}, {r.stderr.strip()}"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # each start loads libtorch: overlap them
        failures = [f for f in pool.map(refused, BAD_OPTIONS) if f]
    assert not failures


def write_data(path, seed):
    rng = np.random.default_rng(seed)
    write_tokens(path, rng.integers(0, 2048, 20000), vocab=2048)


def test_one_directory_for_two_roles_of_a_run_is_named_as_such(strider, tmp_path):
    same = str(tmp_path / "same")
    r = run(strider, tmp_path, "--steps", "2", "--nvme", same, "--checkpoint-dir", same, "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and f"--nvme {same} is also this run's --checkpoint-dir" in r.stderr, r.stderr
    r = run(strider, tmp_path, "--steps", "2", "--checkpoint-dir", same, "--out", same)
    assert r.returncode != 0 and f"--checkpoint-dir {same} is also this run's --out" in r.stderr, r.stderr


def test_a_damaged_model_copy_in_a_checkpoint_is_named_on_resume(strider, tmp_path):
    ck = tmp_path / "ck"
    constant = ("--schedule", "constant", "--warmup", "0", "--checkpoint-dir", str(ck))
    ok(strider, tmp_path, *constant, "--steps", "2", "--out", str(tmp_path / "o"))
    model = ck / "step-00000002" / "model.safetensors"
    with open(model, "r+b") as f:  # one byte of a weight, which the format cannot see
        f.seek(-3, os.SEEK_END)
        f.write(b"\x5a")
    r = run(strider, tmp_path, *constant, "--steps", "3", "--resume", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "at step 2" in r.stdout
    assert f"the exportable model in {ck / 'step-00000002'} is damaged: {model} has checksum" in r.stderr, r.stderr


def test_another_steps_on_resume_is_asked_for_where_the_schedule_decays_to_it(strider, tmp_path):
    """--steps is total_steps, where linear and cosine decay end: another one changes every later step's
    learning rate, so it needs --allow-changed total_steps; a constant schedule does not use it (issue 32)."""
    ck = str(tmp_path / "ck")
    ok(strider, tmp_path, "--steps", "2", "--checkpoint-dir", ck, "--out", str(tmp_path / "o"))  # the demo: cosine
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    r = run(strider, tmp_path, "--steps", "4", "--checkpoint-dir", ck, "--resume", "--out", str(tmp_path / "o"))
    assert r.returncode != 0
    assert "total_steps: checkpoint 2, engine 4" in r.stderr, r.stderr
    assert "--steps 4 is total_steps: the cosine schedule" in r.stderr and "--allow-changed total_steps" in r.stderr
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before
    out = ok(strider, tmp_path, "--steps", "4", "--checkpoint-dir", ck, "--resume", "--allow-changed", "total_steps",
             "--out", str(tmp_path / "o"))
    assert "at step 2" in out and "step    4/4" in out
    # Constant: the same change needs nothing.
    constant = ("--schedule", "constant", "--warmup", "0", "--checkpoint-dir", str(tmp_path / "ck2"))
    ok(strider, tmp_path, *constant, "--steps", "2", "--out", str(tmp_path / "o2"))
    out = ok(strider, tmp_path, *constant, "--steps", "3", "--resume", "--out", str(tmp_path / "o2"))
    assert "at step 2" in out and "step    3/3" in out


def test_resume_refuses_other_data_and_changed_settings_unless_allowed(strider, tmp_path):
    a, b = tmp_path / "a.tokens", tmp_path / "b.tokens"
    write_data(a, 1)
    write_data(b, 2)
    ck = str(tmp_path / "ck")
    ok(strider, tmp_path, "--data", str(a), "--steps", "2", "--checkpoint-dir", ck, "--out", str(tmp_path / "o"))
    r = run(strider, tmp_path, "--data", str(b), "--steps", "4", "--checkpoint-dir", ck, "--resume",
            "--allow-changed", "total_steps", "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and str(a) in r.stderr and "--allow-changed data" in r.stderr
    r = run(strider, tmp_path, "--data", str(a), "--lr", "1e-3", "--steps", "4", "--checkpoint-dir", ck, "--resume",
            "--allow-changed", "total_steps", "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "lr" in r.stderr and "--allow-changed" in r.stderr
    r = run(strider, tmp_path, "--data", str(a), "--steps", "2", "--checkpoint-dir", ck, "--resume",
            "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "at step 2 already" in r.stderr
    out = ok(strider, tmp_path, "--data", str(b), "--lr", "1e-3", "--steps", "3", "--checkpoint-dir", ck, "--resume",
             "--allow-changed", "data,lr,total_steps", "--out", str(tmp_path / "o"))
    assert "resumed from" in out and "step    3/3" in out


def test_a_token_file_truncated_during_the_run_is_an_error_naming_it_and_the_last_step_is_kept(strider, tmp_path):
    data = tmp_path / "d.tokens"
    write_data(data, 3)
    p = start(strider, tmp_path, "--data", str(data), "--steps", "1000", "--out", str(tmp_path / "o"))
    wait_for_step(p, 1)
    os.truncate(data, 4096)
    _, err = p.communicate(timeout=120)
    assert p.returncode > 0, "killed by signal %d" % -p.returncode  # an error, not SIGBUS
    assert str(data) in err
    # The last good step's state is saved (under --out without --checkpoint-dir), and said where.
    root = tmp_path / "o" / "strider-checkpoints"
    assert "the training data failed after step" in err and f"is saved in {root}" in err, err[-2000:]
    (ck,) = checkpoints(root)
    step = json.loads((root / ck / "trainer_state.json").read_text())["step"]
    assert f"after step {step}:" in err


def mount_tmpfs(path, size):
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")


def fill(disk, leave):
    """Fills the file system of `disk`, then frees `leave` bytes."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"x" * 65536)
        except OSError:
            pass
    os.truncate(disk / "filler", max(0, os.path.getsize(disk / "filler") - leave))


def test_an_out_too_small_for_the_model_is_refused_before_the_first_step(strider, tmp_path):
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "1m")
    try:
        r = run(strider, tmp_path, "--steps", "2", "--out", str(disk / "out"))
        assert r.returncode != 0 and "step    1" not in r.stdout
        assert f"--out {disk / 'out'}: the final model needs about" in r.stderr and "free" in r.stderr, r.stderr
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def test_a_final_save_that_fails_keeps_the_trained_state(strider, tmp_path):
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "16m")  # the built-in model in bf16 (~12 MiB with its margin) fits at the start
    constant = ("--schedule", "constant", "--warmup", "0", "--steps", "40")

    def fails_at_the_end(*args):
        p = start(strider, tmp_path, *constant, *args)
        wait_for_step(p, 1)
        fill(disk, 1 << 20)  # then the disk fills up under the run
        out, err = p.communicate(timeout=300)
        os.remove(disk / "filler")
        assert p.returncode != 0 and "step   40/40" in out, out[-2000:] + err[-2000:]
        return err

    try:
        # Without --checkpoint-dir the state would go under --out, on the same full disk: said, not hidden.
        err = fails_at_the_end("--out", str(disk / "a"))
        assert f"the final save to --out {disk / 'a'} failed" in err, err[-2000:]
        assert "saving the trained state failed too" in err and "needs about" in err, err[-2000:]
        # With --checkpoint-dir elsewhere, the last step's state is there, and it resumes.
        ck = tmp_path / "ck"
        err = fails_at_the_end("--checkpoint-dir", str(ck), "--out", str(disk / "b"))
        assert f"the trained state (step 40) is in {ck}" in err, err[-2000:]
        out = ok(strider, tmp_path, "--schedule", "constant", "--warmup", "0", "--steps", "41", "--checkpoint-dir",
                 str(ck), "--resume", "--out", str(tmp_path / "c"))
        assert "at step 40" in out and (tmp_path / "c" / "model.safetensors").exists()
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def test_a_model_with_a_nan_weight_is_refused_naming_the_tensor(strider, tmp_path):
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=2048, max_position_embeddings=64)
    model_dir = tmp_path / "model"
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][3, 4] = float("nan")
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    r = run(strider, tmp_path, "--model", str(model_dir), "--steps", "3", "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and name in r.stderr and "non-finite" in r.stderr


def test_a_rank_without_torchruns_environment_is_refused_before_anything_is_written(strider, tmp_path):
    """torchrun starts one process per rank and sets WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT: a rank
    missing one is refused up front, naming it (tests/python/test_data_parallel_cli.py runs the real thing);
    `strider profile` measures one device and refuses any world of more than one."""
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    env.pop("MASTER_ADDR", None)
    cmd = [str(strider), "finetune", *BASE, "--work-dir", str(tmp_path / "work"), "--steps", "1",
           "--out", str(tmp_path / "out")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "WORLD_SIZE=2 but MASTER_ADDR is not set" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()
    r = subprocess.run([str(strider), "profile", "--device", "cpu", "--steps", "1", "--out", str(tmp_path / "p")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "WORLD_SIZE=2" in r.stderr and "one process" in r.stderr, r.stderr
    assert not (tmp_path / "p").exists()
    # A world of one (torchrun --nproc-per-node 1) is one process: it trains.
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**env, "WORLD_SIZE": "1", "RANK": "0"})
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("option, value, says", [
    ("--seed", "-1", "'-1' is not a seed: a whole number from 0 to 18446744073709551615"),
    ("--seed", "18446744073709551616", "is not a seed"),
    ("--seed", "12x", "is not a seed"),
    ("--device-budget", "1e30GiB", "size '1e30GiB' is past the largest strider accepts"),
    ("--host-ram", "inf", "past the largest strider accepts"),
])
def test_out_of_range_values_are_refused_naming_the_option(strider, tmp_path, option, value, says):
    # A value that would wrap, clamp or overflow is a typo: refused before anything runs.
    r = run(strider, tmp_path, "--steps", "1", option, value, "--out", str(tmp_path / "out"))
    assert r.returncode != 0
    assert says in r.stderr + r.stdout, r.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_sparse_targets_skip_empty_batches_and_the_run_finishes(strider, tmp_path):
    # Chat data masked to the assistant's turns can give a batch with no target token. Such a step changes
    # nothing and is said, with the data position, but it is not a fault: the run reaches --steps and saves.
    import numpy as np
    from strider.data import write_token_file
    n = 200_000
    ids = np.random.default_rng(0).integers(0, 2048, n)
    mask = np.zeros(n, np.uint8)
    mask[: n // 50] = 1  # 2% of the tokens, in one stretch: most windows hold none
    data = tmp_path / "sparse.tokens"
    write_token_file(str(data), ids, mask=mask, vocab_size=2048)
    r = run(strider, tmp_path, "--data", str(data), "--steps", "3", "--max-skipped-steps", "1",
            "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    empty = [l for l in r.stdout.splitlines() if "no target token" in l]
    assert empty, r.stdout  # with --max-skipped-steps 1, one counted skip would have stopped the run
    assert "nothing changed, the data moves on (epoch 0, window" in empty[0]
    assert "step    3/3 | loss" in r.stdout
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_the_output_folder_loads_as_is_in_the_sources_dtype(strider, tmp_path):
    """--out gets the tokenizer, its chat template and the generation config from --model, and the
    weights in the source checkpoint's dtype (fp32 here) unless --save-dtype says otherwise; transformers
    loads the folder as it is and generates with it. A pretrained model's settings are checked before
    step 1: a learning rate far above fine-tuning's, a warm-up as long as the run."""
    from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig,
                              LlamaForCausalLM, pipeline)
    from test_data_prep import make_tiny_tokenizer
    model_dir = make_tiny_tokenizer(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=64,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=tok.eos_token_id).save_pretrained(model_dir)
    data = tmp_path / "d.tokens"
    from strider.data import write_token_file
    write_token_file(data, np.random.default_rng(0).integers(0, len(tok), 4000), vocab_size=len(tok))
    r = run(strider, tmp_path, "--model", str(model_dir), "--data", str(data), "--steps", "2", "--lr", "1e-2",
            "--warmup", "2", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--lr 0.01 is far above what fine-tuning a pretrained model takes" in r.stderr
    assert "--warmup 2 is not below --steps 2" in r.stderr
    assert "F32; with tokenizer.json, tokenizer_config.json" in r.stdout and "generation_config.json" in r.stdout
    out = tmp_path / "out"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded.chat_template == tok.chat_template and len(loaded) == len(tok)
    generated = pipeline("text-generation", model=model, tokenizer=loaded)("the answer", max_new_tokens=3)
    assert generated[0]["generated_text"].startswith("the answer")
    # Asked for, bf16.
    r = run(strider, tmp_path, "--model", str(model_dir), "--data", str(data), "--steps", "1", "--save-dtype",
            "bf16", "--out", str(tmp_path / "out16"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out16").dtype == torch.bfloat16


def test_a_hub_id_is_found_in_the_local_cache_and_bad_data_points_to_strider_data(strider, tmp_path):
    """--model org/name reads the Hugging Face cache's snapshot (as huggingface_hub lays it out); one not
    there says how to download it. A .jsonl given as --data points to python -m strider.data."""
    from transformers import LlamaConfig, LlamaForCausalLM
    hub = tmp_path / "hub"
    repo = hub / "models--someone--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=2048, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(repo / "snapshots" / "0123abcd")
    env = {**os.environ, "HF_HUB_CACHE": str(hub)}
    cmd = [str(strider), "finetune", *BASE, "--work-dir", str(tmp_path / "work"), "--steps", "1"]
    r = subprocess.run(cmd + ["--model", "someone/tiny-llama", "--out", str(tmp_path / "o")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"the Hugging Face cache's {repo / 'snapshots' / '0123abcd'}" in r.stdout
    plan = subprocess.run([str(strider), "plan", "--model", "someone/tiny-llama", "--predict", "none"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0 and "2 layers" in plan.stdout, plan.stderr
    r = subprocess.run(cmd + ["--model", "someone/absent", "--out", str(tmp_path / "o2")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "not in the Hugging Face cache" in r.stderr
    assert "huggingface-cli download someone/absent" in r.stderr
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "hello"}]}\n' * 100)
    r = run(strider, tmp_path, "--data", str(chats), "--steps", "1", "--out", str(tmp_path / "o3"))
    assert r.returncode != 0 and "not a strider token file" in r.stderr and "python -m strider.data" in r.stderr


def test_a_resume_names_the_loss_scale_it_goes_on_from(strider, tmp_path):
    """fp16: the checkpoint's loss scale is the run's state and goes on; a --loss-scale given with --resume is
    named as overridden, not dropped without a word (issue 63)."""
    fp16 = ("--dtype", "fp16", "--checkpoint-dir", str(tmp_path / "ck"), "--schedule", "constant", "--warmup", "0")
    ok(strider, tmp_path, *fp16, "--steps", "2", "--out", str(tmp_path / "o"))
    out = ok(strider, tmp_path, *fp16, "--steps", "3", "--resume", "--loss-scale", "4", "--out", str(tmp_path / "o"))
    assert "at step 2" in out
    named = [line for line in out.splitlines() if "the loss scale goes on from the checkpoint's" in line]
    assert len(named) == 1 and "--loss-scale 4 is a new run's first scale" in named[0], out
    saved = named[0].split("checkpoint's ")[1].split(":")[0]
    step3 = [line for line in out.splitlines() if line.startswith("step    3/3")]
    assert len(step3) == 1 and f"| scale {saved} |" in step3[0], out  # the step ran at the checkpoint's scale, not 4
