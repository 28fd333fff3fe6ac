"""`strider finetune` as N data-parallel ranks under torchrun (CPU device, Gloo), against one
process stepping on the same global batches with N times the accumulation (issue 15's first
done-criterion): the same bits. The ranks shard the state (each keeps and updates its slice of
master, m and v; their one compute copy is in shared memory) and sum each gradient slice in rank
order, which is the order one process accumulates its micro-batches in. Both sides compute with
one ATen thread (OMP_NUM_THREADS=1, torchrun's default per rank): a GEMM's bits depend on how
many threads split it, so a process with two would differ in the last bits before any rank does.

Only rank 0 writes; every rank takes the same decisions. A stop signal reaches the ranks
through torchrun and ends all of them after the same step, with rank 0's checkpoint saved.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

COMMON = ["--device", "cpu", "--dtype", "fp32", "--grad-transfer", "fp32", "--seq", "32", "--micro-batch", "2",
          "--eval-batches", "0", "--lr", "1e-2"]


def finetune(binary, tmp_path, name, *args, ranks=1, accumulation=1, check=True, common=COMMON):
    out = tmp_path / name
    cmd = [str(binary), "finetune", *common, "--accumulation", str(accumulation), "--work-dir",
           str(tmp_path / "work"), "--out", str(out / "model"), "--checkpoint-dir", str(out / "ck"),
           "--metrics", str(out / "metrics.jsonl"), *args]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "--no-python", *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the ranks' (torchrun's default), for the one process too
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if "this build has none" in r.stdout + r.stderr:
        pytest.skip("this build has no c10d Gloo (no gloo headers: scripts/setup.sh installs libgloo-dev)")
    if check:
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r


def final_state(tmp_path, name):
    ck = sorted((tmp_path / name / "ck").glob("step-*"))[-1]
    return load_file(str(ck / "state.safetensors"))


def losses(tmp_path, name):
    return [json.loads(l)["loss"] for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_train_as_one_process_with_their_accumulation(strider_binary, tmp_path, n):
    binary = strider_binary("strider")
    finetune(binary, tmp_path, "ranks", "--steps", "3", ranks=n, accumulation=1)
    finetune(binary, tmp_path, "one", "--steps", "3", ranks=1, accumulation=n)
    a, b = final_state(tmp_path, "ranks"), final_state(tmp_path, "one")
    assert a.keys() == b.keys()
    for k in b:  # weights, Adam's m and v: bit for bit
        assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k
    assert losses(tmp_path, "ranks") == losses(tmp_path, "one")
    # Rank 0 alone wrote: one metrics file with one line per step, one model.
    assert len(losses(tmp_path, "ranks")) == 3
    assert (tmp_path / "ranks" / "model" / "model.safetensors").exists()


def test_ranks_of_pools_train_as_ranks_of_one_device(strider_binary, tmp_path):
    # Each of 2 ranks a pool of 2 CPU devices (`--devices 2`: its blocks dealt over them, hand-offs
    # between them), against 2 ranks of one device each: a pool changes no bit, within a rank either.
    binary = strider_binary("strider")
    pools = finetune(binary, tmp_path, "pools", "--steps", "3", "--devices", "2", ranks=2, accumulation=2)
    assert "a pool: block b's visits on device b % 2" in pools.stdout + pools.stderr
    finetune(binary, tmp_path, "single", "--steps", "3", ranks=2, accumulation=2)
    a, b = final_state(tmp_path, "pools"), final_state(tmp_path, "single")
    assert a.keys() == b.keys()
    for k in b:
        assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k
    assert losses(tmp_path, "pools") == losses(tmp_path, "single")


def test_a_resumed_two_rank_run_is_bit_identical_to_an_uninterrupted_one(strider_binary, tmp_path):
    binary = strider_binary("strider")
    finetune(binary, tmp_path, "straight", "--steps", "4", ranks=2)
    finetune(binary, tmp_path, "halves", "--steps", "2", ranks=2)
    finetune(binary, tmp_path, "halves", "--steps", "4", "--resume", "--allow-changed", "total_steps", ranks=2)
    a, b = final_state(tmp_path, "straight"), final_state(tmp_path, "halves")
    for k in a:
        assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k


def test_a_signal_stops_every_rank_after_the_same_step_with_rank_0s_save(strider_binary, tmp_path):
    binary = strider_binary("strider")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
           str(binary), "finetune", *COMMON, "--accumulation", "1", "--steps", "100000", "--work-dir",
           str(tmp_path / "work"), "--out", str(out / "model"), "--checkpoint-dir", str(out / "ck"),
           "--metrics", str(out / "metrics.jsonl")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    # To torchrun's agent, which forwards it to every rank once (a second SIGTERM would end a
    # rank at once, as it does a single process).
    os.kill(p.pid, signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=300)
    assert "interrupted by SIGTERM" in stdout, (stdout[-2000:], stderr[-2000:])
    steps = len(metrics.read_text().splitlines())
    ck = sorted((out / "ck").glob("step-*"))
    assert ck and ck[-1].name == f"step-{steps:08d}", (ck, steps)
    assert json.loads((ck[-1] / "trainer_state.json").read_text())["step"] == steps


def test_another_world_size_resumes_only_when_asked_and_reshards(strider_binary, tmp_path):
    binary = strider_binary("strider")
    finetune(binary, tmp_path, "run", "--steps", "2", ranks=2)
    before = sorted(p.name for p in (tmp_path / "run" / "ck").glob("step-*"))
    r = finetune(binary, tmp_path, "run", "--steps", "4", "--resume", "--allow-changed", "total_steps", ranks=1,
                 accumulation=1, check=False)
    assert r.returncode != 0
    assert "was saved by 2 rank(s) and this run has 1" in r.stderr and "--allow-changed world" in r.stderr, \
        r.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "run" / "ck").glob("step-*")) == before
    # Asked for, 3 ranks load the 2 ranks' whole checkpoint, each its slice, and go on. A step at
    # learning rate 1e-30 leaves every weight as it was (a change 1e-20 of its size rounds away; the
    # decay factor 1 - lr x weight_decay rounds to 1), so the 3 ranks' next checkpoint holds the loaded
    # weights, gathered back from their slices: bit for bit.
    lr0 = [x if x != "1e-2" else "1e-30" for x in COMMON]
    r = finetune(binary, tmp_path, "run", "--steps", "3", "--resume", "--allow-changed", "world,lr,total_steps", ranks=3,
                 common=lr0)
    assert "the world size changed (2 -> 3 ranks)" in r.stdout, r.stdout[-2000:]
    ck = sorted((tmp_path / "run" / "ck").glob("step-*"))
    assert [c.name for c in ck][-2:] == ["step-00000002", "step-00000003"]
    a, b = (load_file(str(c / "state.safetensors")) for c in ck[-2:])
    for k in a:
        if not k.endswith((".exp_avg", ".exp_avg_sq")):
            assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k


def rank_pids(launcher_pid):
    """{rank: pid} of torchrun's workers, from their environments."""
    out = {}
    for child in subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split():
        try:
            env = dict(kv.split("=", 1) for kv in open(f"/proc/{child}/environ").read().split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(child)
    return out


def test_a_rank_killed_mid_run_is_named_by_the_other(strider_binary, tmp_path):
    # torchrun's monitor at 5 s (its default stops the survivor within 0.1 s, naming the dead
    # rank itself): the survivor's next collective fails first, when the dead rank's sockets close.
    binary = strider_binary("strider")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--monitor-interval", "5",
           "--nproc-per-node", "2", "--no-python", str(binary), "finetune", *COMMON, "--accumulation", "1",
           "--steps", "100000", "--dist-timeout", "60", "--work-dir", str(tmp_path / "work"), "--out",
           str(out / "model"), "--metrics", str(out / "metrics.jsonl")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    pids = rank_pids(p.pid)
    assert set(pids) == {0, 1}, pids
    t0 = time.time()
    os.kill(pids[1], signal.SIGKILL)
    _, stderr = p.communicate(timeout=300)
    assert p.returncode != 0
    # Killed between collectives, it never reached rank 0's; killed inside one, its heartbeat stopped.
    named = ("Never reached it: rank 1" in stderr or "from: rank 1 (dead or frozen)" in stderr or
             "then rank 1 went silent" in stderr)
    assert "Every rank reached it. No heartbeat" not in stderr  # not two claims side by side
    assert "rank 0 of 2:" in stderr and named, stderr[-3000:]
    assert time.time() - t0 < 60  # at once (its sockets closed), well inside --dist-timeout


def test_plan_predicts_data_parallel_ranks(strider_binary):
    """`strider plan --gpus N --link L`: each rank plans its slice of the state; the prediction is one rank's
    schedule with its collectives, times the ranks; on one machine the compute copy is counted once."""
    binary = str(strider_binary("strider"))
    base = [binary, "plan", "--model", "llama-3.1-8b", "--gpu", "24GiB", "--seq", "1024", "--accumulation", "8",
            "--json"]

    def plan(*args):
        r = subprocess.run(base + list(args), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)

    one, box, eth = plan(), plan("--gpus", "8", "--link", "pcie4"), plan("--gpus", "8", "--link", "eth100")
    for dp in (box, eth):
        assert dp["gpus"] == 8
        assert dp["tokens_per_s"] == pytest.approx(8 * dp["rank_tokens_per_s"])
        assert dp["lane_busy_s"]["optimizer"] > 0
    # A rank keeps 1/8 of master, m and v (12 bytes per parameter in fp32).
    params = 8.03e9
    assert box["rank_optimizer_host_bytes"] == pytest.approx(12 * params / 8, rel=0.02)
    # One machine: 8 ranks' own memory plus one shared compute copy (2 bytes per parameter), far less than 8
    # single-GPU processes.
    assert box["shared_host_bytes"] == pytest.approx(2 * params, rel=0.02)
    assert box["machine_host_bytes"] < 2 * one["host_peak_bytes"]
    # The ranks' collectives (and their shared memory bus) cost each rank time: no rank is faster than one GPU.
    assert box["step_s"] >= one["step_s"]
    # On one machine the ranks share its memory bus over time, each rank's copies with its optimizer's bytes:
    # every rank pulls every weight through it, so on the workstation's 70 GB/s eight ranks predict less than
    # a pool of eight devices on the same bus, which loads each block once (8 sequences per GPU both).
    pool = subprocess.run([binary, "plan", "--model", "llama-3.1-8b", "--gpu", "24GiB", "--seq", "1024",
                           "--accumulation", "64", "--devices", "8", "--json"], capture_output=True, text=True,
                          timeout=300)
    assert pool.returncode == 0, pool.stderr[-2000:]
    assert box["tokens_per_s"] < json.loads(pool.stdout)["tokens_per_s"]
    r = subprocess.run(base + ["--gpus", "8", "--link", "nvlink9"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--link nvlink9: expected pcie3" in r.stderr


def test_cuda_ranks_take_their_local_rank_s_gpu_or_are_refused(strider_binary, tmp_path):
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs for two ranks: gpu_check/gpu_check.sh runs them")
    binary = str(strider_binary("strider"))
    def launch(device, *more):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
               binary, "finetune", "--device", device, "--steps", "1", "--work-dir", str(tmp_path / "w"), "--out",
               str(tmp_path / "o"), *more]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode != 0
        return r.stderr

    # Whichever rank fails first (torchrun then stops the other) names its GPU and the devices there are.
    err = launch("cuda")
    assert re.search(r"rank (\d) \(local rank \1 of 2\) takes cuda:\1, but this machine shows", err), err[-2000:]
    err = launch("cuda:0")
    assert "each data-parallel rank takes the GPU of its local rank" in err, err[-2000:]
    # Ranks of pools: local rank r takes cuda:2r and cuda:2r+1; a list is one process's.
    err = launch("cuda", "--devices", "2")
    assert re.search(r"rank (\d) \(local rank \1 of 2\) takes cuda:(0 to cuda:1|2 to cuda:3), but this machine "
                     r"shows", err), err[-2000:]
    err = launch("cuda", "--devices", "cuda:0,cuda:1")
    assert "--devices cuda:0,cuda:1 with 2 data-parallel ranks: give a count N" in err, err[-2000:]
