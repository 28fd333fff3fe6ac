"""The `strider` command line end to end: the built-in run trains, a resumed run
is bit-identical to an uninterrupted one, Ctrl-C stops after the current step
with a checkpoint, and a plan that cannot work is refused with the number.
Faults and bad input: test_cli_faults.py."""
import json
import os
import re
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file


def size_bytes(text):
    """'85.4 MiB' (format_bytes' form) -> bytes."""
    value, unit = text.split()
    return int(float(value) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[unit])


@pytest.fixture
def strider(strider_binary):
    return strider_binary("strider")


def finetune(strider, tmp_path, *args):
    cmd = [str(strider), "finetune", "--device", "cpu", "--seq", "32", "--micro-batch", "2",
           "--accumulation", "2", "--work-dir", str(tmp_path / "work"), "--eval-batches", "0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout


def test_resume_is_bit_identical(strider, tmp_path):
    finetune(strider, tmp_path, "--steps", "4", "--out", str(tmp_path / "straight"))
    finetune(strider, tmp_path, "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck"),
             "--out", str(tmp_path / "half"))
    # The demo's cosine schedule ends at --steps: a resume that moves it says so (issue 32).
    out = finetune(strider, tmp_path, "--steps", "4", "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "--allow-changed", "total_steps",
                   "--out", str(tmp_path / "resumed"))
    assert "resumed from" in out and "at step 2" in out
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)), k
    state = json.loads((tmp_path / "ck" / "step-00000004" / "trainer_state.json").read_text())
    assert state["step"] == 4
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("step-")) == [
        "step-00000002", "step-00000004"]


def test_weight_decay_spares_norms_unless_told(strider, tmp_path):
    """One step with and without --decay-norms-and-biases: only the norms differ, and the checkpoint says which."""
    outs = {}
    for flag in ([], ["--decay-norms-and-biases"]):
        name = "all" if flag else "spared"
        finetune(strider, tmp_path, "--steps", "1", "--warmup", "0", "--weight-decay", "10", *flag,
                 "--checkpoint-dir", str(tmp_path / f"ck-{name}"), "--out", str(tmp_path / name))
        outs[name] = load_file(str(tmp_path / name / "model.safetensors"))
        state = json.loads((tmp_path / f"ck-{name}" / "step-00000001" / "trainer_state.json").read_text())
        assert state["engine_config"]["decay_norms_and_biases"] == bool(flag)
    norms = [k for k in outs["all"] if "norm" in k]
    assert norms and len(norms) < len(outs["all"])
    for k in outs["all"]:
        same = torch.equal(outs["all"][k].view(torch.int16), outs["spared"][k].view(torch.int16))
        assert same == (k not in norms), k


def test_packed_documents_follow_the_data_unless_told(strider, tmp_path):
    """Documents of 5 to 20 tokens start inside 32-token windows: packed documents are on (said, recorded,
    and they change what a token sees), --packed-documents=false turns them off, and a resume across the
    change is refused naming the field."""
    from strider.data import write_token_file
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(5, 21, (400,), generator=g)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    data = tmp_path / "docs.tokens"
    write_token_file(data, torch.randint(0, 2048, (int(lengths.sum()),), generator=g).numpy(),
                     doc_starts=starts.numpy(), vocab_size=2048)
    runs = {}
    for name, flag in [("on", []), ("off", ["--packed-documents=false"])]:
        out = finetune(strider, tmp_path, "--data", str(data), "--steps", "1", "--warmup", "0", *flag, "--checkpoint-dir",
                       str(tmp_path / f"ck-{name}"), "--out", str(tmp_path / name))
        assert ("packed documents: each attends only to itself" in out) == (name == "on")
        assert ("the data's documents start inside --seq windows" in out) == (name == "on")
        state = json.loads((tmp_path / f"ck-{name}" / "step-00000001" / "trainer_state.json").read_text())
        assert state["engine_config"]["packed_documents"] == (name == "on")
        runs[name] = load_file(str(tmp_path / name / "model.safetensors"))
    assert any(not torch.equal(runs["on"][k], runs["off"][k]) for k in runs["on"])
    with pytest.raises(subprocess.CalledProcessError) as e:
        finetune(strider, tmp_path, "--data", str(data), "--steps", "2", "--warmup", "0", "--allow-changed",
                 "total_steps", "--packed-documents=false",
                 "--checkpoint-dir", str(tmp_path / "ck-on"), "--resume", "--out", str(tmp_path / "x"))
    assert "packed_documents: checkpoint true, engine false" in e.value.stderr


def test_a_config_file_holds_options_the_command_line_wins_and_the_run_records_it(strider, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('steps = 2\nseq = 64\nwarmup = 0\nweight-decay = 0.5\ndecay-norms-and-biases = true\n'
                   'checkpoint-every = 1\n')
    out = finetune(strider, tmp_path, "--config", str(cfg), "--checkpoint-dir", str(tmp_path / "ck"),
                   "--out", str(tmp_path / "out"))  # finetune() gives --seq 32 on the command line
    assert f"options from {cfg}" in out
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("step-")) == [
        "step-00000001", "step-00000002"]
    state = json.loads((tmp_path / "ck" / "step-00000002" / "trainer_state.json").read_text())
    engine = state["engine_config"]
    assert (engine["seq"], engine["warmup_steps"], engine["weight_decay"], engine["decay_norms_and_biases"]) == (
        32, 0, 0.5, True)
    assert state["extra"]["config_file"] == {"path": str(cfg), "text": cfg.read_text()}

    # A key that is no option is refused, naming it and the fix; so is a missing file.
    cfg.write_text('device_budget = "20MiB"\n')
    bad = subprocess.run([str(strider), "finetune", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    assert "device_budget" in bad.stderr and "device-budget" in bad.stderr and "--help" in bad.stderr, bad.stderr
    bad = subprocess.run([str(strider), "plan", "--config", str(tmp_path / "none.toml")], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "none.toml" in bad.stderr, bad.stderr


def test_progress_bar_with_eta_on_a_terminal_plain_lines_otherwise(strider, tmp_path):
    import pty
    args = [str(strider), "finetune", "--device", "cpu", "--seq", "32", "--steps", "3", "--eval-batches", "0",
            "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    pid, fd = pty.fork()
    if pid == 0:  # the child: strider on the terminal's side
        os.execv(args[0], args)
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    tty = b"".join(chunks).decode()
    assert re.search(r"\[#+\.*\] 3/3 100% \| ETA 0s", tty), tty
    assert "\r\x1b[K" in tty  # the bar is erased before each line
    plain = subprocess.run(args[:-2] + ["--out", str(tmp_path / "out2")], capture_output=True, text=True,
                           timeout=300, check=True).stdout
    assert "\x1b[" not in plain and "[#" not in plain
    steps = [line for line in plain.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all(re.search(r"\| ETA \S+$", line) for line in steps), steps


def test_loss_falls_and_metrics_are_written(strider, tmp_path):
    metrics = tmp_path / "m.jsonl"
    finetune(strider, tmp_path, "--steps", "12", "--warmup", "2", "--metrics", str(metrics), "--trace", str(tmp_path / "t.json"),
             "--out", str(tmp_path / "out"))
    lines = [json.loads(l) for l in metrics.read_text().splitlines()]
    assert [l["step"] for l in lines] == list(range(1, 13))
    assert lines[-1]["loss"] < lines[0]["loss"] - 0.5
    assert set(lines[0]["lanes"]) == {"compute", "h2d", "d2h", "optimizer", "nvme read", "nvme write", "collective",
                                      "hand-off"}
    # What each step moved and ATen's working memory: the same shapes each step, so the same bytes.
    assert all(l["h2d_bytes"] == lines[0]["h2d_bytes"] > 0 and l["d2h_bytes"] == lines[0]["d2h_bytes"] > 0
               for l in lines)
    assert all(l["work_peak_bytes"] > 0 for l in lines)
    trace = json.loads((tmp_path / "t.json").read_text())
    names = {e["name"].split(" b")[0] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"forward", "h2d params", "d2h grads", "adamw"} <= names
    # The layers' backward: recomputing, or (the plan's choice on this machine's measured rates) from the
    # activations forward kept on the host, which then cross each way.
    assert "recompute+backward" in names or {"backward", "d2h activations", "h2d activations"} <= names


def test_a_short_run_is_evaluated_after_its_last_step(strider, tmp_path):
    """--eval-every 30 (the default) and 3 steps: the last step's line still has its evaluation (issue 67: a
    short run printed none); a run as long as --eval-every evaluates once, not twice."""
    for steps, every in (("3", "30"), ("4", "2")):
        metrics = tmp_path / f"m{steps}.jsonl"
        out = subprocess.run([str(strider), "finetune", "--device", "cpu", "--seq", "32", "--micro-batch", "2",
                              "--accumulation", "2", "--work-dir", str(tmp_path / "work"), "--steps", steps,
                              "--eval-every", every, "--eval-batches", "1", "--metrics", str(metrics),
                              "--out", str(tmp_path / f"out{steps}")],
                             capture_output=True, text=True, timeout=300, check=True).stdout
        lines = [json.loads(l) for l in metrics.read_text().splitlines()]
        evaluated = [l["step"] for l in lines if "eval_loss" in l]
        assert evaluated == ([3] if steps == "3" else [2, 4]), lines
        assert len(re.findall(r"^ +eval loss [0-9.]+$", out, re.M)) == len(evaluated), out


def test_epochs_set_the_steps_from_the_datas_windows(strider, tmp_path):
    """--epochs N in --steps' place (issue 67): a file of 1001 tokens holds 31 windows of seq 32 (each needs
    its next token), and a step of micro-batch 2 x accumulation 2 takes 4, so 2 passes are ceil(62 / 4) = 16
    steps and 0.5 a pass 4; the run trains that many, and its schedule decays over them. --epochs with --steps
    is refused."""
    from strider.data import write_token_file

    data = tmp_path / "train.tokens"
    write_token_file(data, list(range(1, 1002)), vocab_size=2048)
    for epochs, steps in (("2", 16), ("0.5", 4)):
        metrics = tmp_path / f"m{epochs}.jsonl"
        out = finetune(strider, tmp_path, "--data", str(data), "--epochs", epochs, "--metrics", str(metrics),
                       "--out", str(tmp_path / f"out{epochs}"), "--schedule", "linear", "--warmup", "0")
        assert f"--epochs {epochs}: {steps} steps (31 windows of seq 32 in {data}, 4 a step)" in out, out
        lines = [json.loads(l) for l in metrics.read_text().splitlines() if "lr" in l]
        assert [l["step"] for l in lines] == list(range(1, steps + 1)), lines
        assert lines[-1]["lr"] < lines[0]["lr"]  # it decays toward the last of those steps
    r = subprocess.run([str(strider), "finetune", "--device", "cpu", "--steps", "3", "--epochs", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--steps excludes --epochs" in r.stderr, r.stderr + r.stdout


def test_ctrl_c_stops_after_the_step_with_a_checkpoint(strider, tmp_path):
    """Ctrl-C finishes the step, saves and exits 130 (128 + SIGINT), as a shell expects."""
    cmd = [str(strider), "finetune", "--device", "cpu", "--seq", "32", "--steps", "1000",
           "--work-dir", str(tmp_path / "work"), "--checkpoint-dir", str(tmp_path / "ck"),
           "--out", str(tmp_path / "out"), "--eval-batches", "0"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    for line in p.stdout:  # wait for two steps, then interrupt
        if line.startswith("step    2/"):
            p.send_signal(signal.SIGINT)
            break
        assert time.time() < deadline
    rest = p.communicate(timeout=120)[0]
    assert p.returncode == 128 + signal.SIGINT
    assert "interrupted by SIGINT after step" in rest
    [ck] = [p for p in (tmp_path / "ck").iterdir() if p.name.startswith("step-")]
    step = json.loads((ck / "trainer_state.json").read_text())["step"]
    assert 2 <= step < 1000
    assert (ck / "model.safetensors").exists()  # the checkpoint holds the model transformers loads


def test_impossible_budget_is_refused_with_the_number(strider, tmp_path):
    r = subprocess.run([str(strider), "finetune", "--device", "cpu", "--device-budget", "1MiB",
                        "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "needs" in r.stderr and "budget is 1.0 MiB" in r.stderr
    plan = subprocess.run([str(strider), "plan", "--gpu", "1MiB", "--json"], capture_output=True, text=True)
    assert plan.returncode == 1
    assert json.loads(plan.stdout)["feasible"] is False


def test_plan_leaves_the_os_a_stated_share_of_ram(strider, tmp_path):
    """--ram is the machine's: the plan fills at most 95% of it and says so in its answer."""
    ram = 64 << 30
    out = subprocess.run([str(strider), "plan", "--model", "llama-3.1-8b", "--gpu", "24GiB", "--ram", "64GiB",
                          "--nvme", str(tmp_path / "elsewhere"), "--seq", "1024", "--accumulation", "8", "--json"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    p = json.loads(out)
    assert p["feasible"] and len(p["nvme_blocks"]) > 0
    assert p["host_ram_bytes"] == ram and p["os_headroom_bytes"] == ram * 5 // 100
    assert ram * 90 // 100 < p["host_peak_bytes"] <= ram - p["os_headroom_bytes"]
    assert "(--ram less 5% for the OS)" in p["answer"]


def test_device_budget_defaults_to_24_mib_on_the_cpu_and_a_given_one_wins(strider, tmp_path):
    out = finetune(strider, tmp_path, "--steps", "1", "--out", str(tmp_path / "a"))
    assert "ATen working memory = " in out and " of 24.0 MiB\n" in out
    out = finetune(strider, tmp_path, "--steps", "1", "--device-budget", "40MiB", "--out", str(tmp_path / "b"))
    assert " of 40.0 MiB\n" in out
    assert "device budget: " not in out  # the CUDA default's explanation, not printed for the CPU
    help_text = subprocess.run([str(strider), "finetune", "--help"], capture_output=True, text=True).stdout
    assert "auto: on a CUDA device its free memory at start less 5% of it and 512 MiB" in " ".join(help_text.split())


def nvme_forcing_limit(strider, tmp_path, common):
    """A --host-ram limit that leaves the arena 70% of the all-in-RAM one, so the plan puts some blocks'
    optimizer state on NVMe."""
    out = finetune(strider, tmp_path, *common, "--out", str(tmp_path / "ram"))
    pinned = size_bytes(re.search(r"host: ([\d.]+ \w+) pinned", out).group(1))
    # The limit bounds the whole process at its peak. Below what the process holds besides its arena the
    # run is refused, naming that figure; the limit then leaves the arena 70% of the all-in-RAM one.
    tiny = subprocess.run([str(strider), "finetune", "--device", "cpu", "--seq", "32", "--micro-batch", "2",
                           "--accumulation", "2", "--work-dir", str(tmp_path / "work"), "--host-ram", "1MiB",
                           *common, "--out", str(tmp_path / "y")], capture_output=True, text=True, timeout=120)
    m = re.search(r"is below what the process holds besides its pinned arena: ([\d.]+ \w+)", tiny.stderr)
    assert tiny.returncode != 0 and m, tiny.stderr
    assert "RAM: --host-ram 1.0 MiB less 51.2 KiB (5%) left to the OS: 972.8 KiB for strider" in tiny.stdout
    # --host-ram is the machine's: the process plans within 95% of it, the rest left to the OS.
    process = size_bytes(m.group(1)) + pinned * 7 // 10
    return f"{(process * 100 // 95 >> 20) + 1}MiB"


def test_an_nvme_disk_without_room_for_the_state_is_refused_before_anything_runs(strider, tmp_path):
    common = ("--steps", "3")
    limit = nvme_forcing_limit(strider, tmp_path, common)
    from test_cli_faults import mount_tmpfs
    small = tmp_path / "small"
    mount_tmpfs(small, "1m")
    try:
        r = subprocess.run([str(strider), "finetune", "--device", "cpu", "--seq", "32", "--micro-batch", "2",
                            "--accumulation", "2", "--work-dir", str(tmp_path / "work"), "--host-ram", limit,
                            *common, "--nvme", str(small / "state"), "--out", str(tmp_path / "z")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and f"--nvme {small / 'state'}: the plan puts" in r.stderr, r.stderr[-2000:]
        assert "free" in r.stderr and "step    1" not in r.stdout
    finally:
        subprocess.run(["umount", "-l", str(small)])


@pytest.mark.parametrize("clip", ["1.0", "0"])
def test_host_ram_limit_moves_state_to_nvme_and_changes_nothing(strider, tmp_path, clip):
    """Under a host RAM limit the plan puts blocks' optimizer state on NVMe (their gradients through the
    staging ring, spilled to NVMe while a clip waits for the norm); the trained weights are the same bits
    as with everything in RAM."""
    common = ("--steps", "3", "--clip", clip)
    limit = nvme_forcing_limit(strider, tmp_path, common)
    refused = subprocess.run([str(strider), "finetune", "--device", "cpu", "--seq", "32", "--micro-batch", "2",
                              "--accumulation", "2", "--work-dir", str(tmp_path / "work"), "--host-ram", limit,
                              *common, "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "host RAM" in refused.stderr and "--nvme" in refused.stderr
    (tmp_path / "nvme").mkdir()
    out = finetune(strider, tmp_path, *common, "--host-ram", limit, "--nvme", str(tmp_path / "nvme"),
                   "--trace", str(tmp_path / "t.json"), "--out", str(tmp_path / "tiered"))
    peak_tiered = size_bytes(re.search(r"at its peak the process holds ~([\d.]+ \w+)", out).group(1))
    assert peak_tiered <= size_bytes(limit.replace("MiB", " MiB")) * 95 // 100  # 5% is the OS's
    assert "on NVMe" in out and "gradients through a ring" in out
    names = {e["name"].split(" b")[0] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]
             if e["ph"] == "X"}
    assert "nvme read state" in names and "nvme write state" in names
    assert ("nvme write grads" in names) == (clip != "0")
    a = load_file(str(tmp_path / "ram" / "model.safetensors"))
    b = load_file(str(tmp_path / "tiered" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)), k
