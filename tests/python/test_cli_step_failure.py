"""A `strider finetune` step that fails part way, through the real binary. A device failure (injected as a
failed launch would raise it: STRIDER_INJECT_DEVICE_FAULT) before any update of the step: the last whole step
is saved, the data back at the failed step's batch, and the resume ends on the bits of the run that never
failed. A real fault: the NVMe file torn under the running process (stopped, overwritten, let go), so that
the next read fails its checksum; what can be kept is kept and the run says what and where."""
import mmap
import os
import re
import signal
import subprocess

import pytest

from test_cli_faults import BASE, checkpoints, same_model, wait_for_step
from test_host_peak import deep_model_dir, nvme_limit  # noqa: F401 (a fixture)


@pytest.mark.parametrize("fault, more", [("3:backward:1", []), ("3:forward:2", ["--clip", "0"]),
                                         ("3:grads out:3", ["--mlp-pieces", "2"])])
def test_a_device_failure_mid_step_saves_the_last_whole_step_and_the_resume_is_bit_identical(
        strider_binary, tmp_path, fault, more):
    strider = str(strider_binary("strider"))

    def run(name, *args, env=None):
        cmd = [strider, "finetune", *BASE, "--schedule", "constant", "--warmup", "0", "--steps", "5", *more,
               "--work-dir", str(tmp_path / f"work-{name}"), "--out", str(tmp_path / name), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, **(env or {})))

    straight = run("straight")
    assert straight.returncode == 0, straight.stderr[-2000:]
    ck = tmp_path / "ck"
    failed = run("failed", "--checkpoint-dir", str(ck), env={"STRIDER_INJECT_DEVICE_FAULT": fault})
    step, op, block = fault.split(":")
    assert failed.returncode != 0, failed.stdout[-2000:]
    assert f"step 3 failed: injected device fault: {op} of block {block}; the state of step 2 is saved in {ck}; " \
           f"resume with --checkpoint-dir {ck} --resume" in failed.stderr, failed.stderr[-2000:]
    assert checkpoints(ck) == ["step-00000002"]
    assert not (tmp_path / "failed" / "model.safetensors").exists()
    resumed = run("resumed", "--checkpoint-dir", str(ck), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "at step 2" in resumed.stdout
    assert same_model(tmp_path / "straight", tmp_path / "resumed")


@pytest.mark.parametrize("value", ["3:backward", "x:backward:1", "0:backward:1", "3:adamw:1", "3:no such op:1"])
def test_a_malformed_fault_hook_is_refused_naming_it(strider_binary, tmp_path, value):
    r = subprocess.run([str(strider_binary("strider")), "finetune", *BASE, "--steps", "1", "--work-dir",
                        str(tmp_path / "work"), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, STRIDER_INJECT_DEVICE_FAULT=value))
    assert r.returncode != 0
    assert f"STRIDER_INJECT_DEVICE_FAULT={value}: expected STEP:OP:BLOCK" in r.stderr, r.stderr


def test_an_nvme_file_torn_under_a_run_ends_it_saying_what_is_kept(strider_binary, deep_model_dir,  # noqa: F811
                                                                   tmp_path):
    """A run stopped after step 2, the whole NVMe file overwritten, let go. The first read to fail names its
    extent: with --clip 0 step 2's updates are done when its line is printed, so it is mostly a compute copy
    read for step 3's forward (the state is whole, but torn on disk too); else an update's read, after
    others were applied (not whole). Nothing can be saved either way, and the run says so."""
    cmd = [str(strider_binary("strider")), "finetune", "--model", str(deep_model_dir), "--device", "cpu",
           "--device-budget", "256MiB", "--seq", "64", "--micro-batch", "2", "--accumulation", "2",
           "--eval-batches", "0", "--clip", "0", "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    nvme = tmp_path / "nvme"
    limit = nvme_limit(cmd + ["--steps", "2"], tmp_path / "nvme-probe", compute=True)
    ck = tmp_path / "ck"
    p = subprocess.Popen(cmd + ["--steps", "1000", "--checkpoint-dir", str(ck), "--host-ram", f"{limit}MiB",
                                "--nvme", str(nvme)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(p, 2)
    p.send_signal(signal.SIGSTOP)
    # Written as the engine writes, with O_DIRECT (4 KiB aligned: the file is whole extents): a buffered
    # write beside its direct I/O meets stale page-cache pages, and the kernel fails it with EIO.
    f = nvme / "strider-state.bin"  # the NVMe tier's one file: every extent
    size = f.stat().st_size
    garbage = mmap.mmap(-1, size)
    garbage.write(b"\xa5" * size)
    fd = os.open(f, os.O_WRONLY | os.O_DIRECT)
    try:
        assert os.pwrite(fd, garbage, 0) == size
    finally:
        os.close(fd)
    p.send_signal(signal.SIGCONT)
    _, err = p.communicate(timeout=600)
    assert p.returncode not in (0, -signal.SIGSEGV, -signal.SIGABRT), err[-3000:]
    m = re.search(r"step (\d+) failed: .*?checksum mismatch reading (\w+) of block \d+ ", err)
    assert m and int(m.group(1)) >= 3 and m.group(2) in ("compute", "master", "adam_m", "adam_v"), err[-3000:]
    assert "saving the state of step 2 failed too" in err or "the state after it is not whole" in err, err[-3000:]
    assert "so no checkpoint of this run was saved" in err, err[-3000:]
    assert not ck.exists() or not checkpoints(ck)
    assert not (tmp_path / "out" / "model.safetensors").exists()
