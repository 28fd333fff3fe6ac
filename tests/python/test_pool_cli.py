"""A pool of devices in one process (`--devices N`, docs/pool.md, "How the pool runs"): block b's
visits run on device b % N, block inputs and output gradients are handed between the devices through
pinned host memory, and the trained state is one device's bits. On the CPU device each member of
the pool is a CpuDevice of its own: its streams, units and budget."""
import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file


@pytest.fixture
def strider(strider_binary):
    return strider_binary("strider")


def finetune(strider, tmp_path, name, *args):
    cmd = [str(strider), "finetune", "--device", "cpu", "--seq", "32", "--micro-batch", "2", "--accumulation", "2",
           "--dtype", "fp32", "--clip", "1.0", "--steps", "3", "--eval-batches", "0",
           "--work-dir", str(tmp_path / "work"), "--checkpoint-dir", str(tmp_path / name / "ck"),
           "--out", str(tmp_path / name / "model"), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r.stdout


def final_state(tmp_path, name):
    ck = sorted((tmp_path / name / "ck").glob("step-*"))[-1]
    return load_file(str(ck / "state.safetensors"))


def test_a_pool_of_2_and_3_cpu_devices_trains_the_builtin_model_to_one_devices_bits(strider, tmp_path):
    finetune(strider, tmp_path, "one")
    one = final_state(tmp_path, "one")
    for n in (2, 3):
        out = finetune(strider, tmp_path, f"pool{n}", "--devices", str(n), "--trace", str(tmp_path / f"t{n}.json"))
        names = ", ".join(f"cpu:{d}" for d in range(n))
        assert f"devices: {names} (a pool: block b's visits on device b % {n}, the head's shards on the devices after)" in out
        pool = final_state(tmp_path, f"pool{n}")
        assert pool.keys() == one.keys()
        for k in one:
            assert torch.equal(one[k], pool[k]), (n, k)
        # The trace: a track (process) per device with its own lanes, and the hand-offs between them.
        events = json.loads((tmp_path / f"t{n}.json").read_text())["traceEvents"]
        procs = {e["args"]["name"] for e in events if e["name"] == "process_name"}
        assert procs == {f"device {d}" for d in range(n)}
        computing = {e["args"]["device"] for e in events if e["ph"] == "X" and e["name"].startswith("forward")}
        assert computing == set(range(n))
        handed = [e for e in events if e["ph"] == "X" and "hand-off" in e["name"]]
        assert {e["name"].split(" b")[0] for e in handed} >= {"d2h hand-off", "h2d hand-off", "d2h hand-off gradient",
                                                            "h2d hand-off gradient"}
        # ...on a lane of their own in each device's track.
        hand_lanes = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name" and e["args"]["name"] == "hand-off"}
        assert {(e["pid"], e["tid"]) for e in handed} <= hand_lanes and len(hand_lanes) > n


def test_devices_that_are_not_a_pool_are_refused_naming_the_entry(strider, tmp_path):
    for devices, says in (("0", "a pool has 1 to 64 devices"), ("cpu,,cpu", "an empty entry"),
                          ("cpu,tpu:0", 'device "tpu:0" is not one of')):
        r = subprocess.run([str(strider), "finetune", "--device", "cpu", "--devices", devices, "--steps", "1",
                            "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "x")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and says in r.stderr, (devices, r.stderr[-2000:])
        assert "step    1" not in r.stdout


def test_plan_for_a_pool_counts_each_device_and_predicts_on_as_many_simulated_devices(strider):
    def plan(devices, accumulation):
        r = subprocess.run([str(strider), "plan", "--model", "llama-3.1-8b", "--gpu", "24GiB", "--seq", "1024",
                            "--accumulation", str(accumulation), "--devices", str(devices), "--json"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)
    one, four = plan(1, 8), plan(4, 32)  # the same batch per device
    assert four["devices"] == 4 and "on each of 4 devices" in four["answer"]
    assert "x 4 devices in one process" in four["answer"]
    assert one["tokens_per_s"] < four["tokens_per_s"] < 4 * one["tokens_per_s"]


def test_profile_shows_each_devices_lanes_and_the_hand_offs(strider, tmp_path):
    cmd = [str(strider), "profile", "--device", "cpu", "--devices", "2", "--seq", "32", "--micro-batch", "2",
           "--accumulation", "2", "--skip-steps", "1", "--steps", "2", "--work-dir", str(tmp_path / "work"),
           "--out", str(tmp_path / "prof"), "--no-png", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [d["device"] for d in out["pool"]] == ["cpu:0", "cpu:1"]
    assert "device 1 (cpu:1): compute" in r.stderr
    for d in out["pool"]:
        assert d["compute_busy_s"] > 0 and d["h2d_busy_s"] > 0 and d["d2h_busy_s"] > 0
        assert d["hand_out_bytes"] > 0 and d["hand_in_bytes"] > 0
    # Every block boundary changes device (round robin over 2): forward and backward, each micro-batch,
    # one [micro-batch, seq, hidden] tensor in the compute dtype (bf16) out of one device and into the other.
    layers = int(out["model"].split(": ")[1].split(" layers")[0])
    hidden = int(out["model"].split("hidden ")[1].split(",")[0])
    handed = 2 * (layers + 1) * 2 * (2 * 32 * hidden * 2)
    assert sum(d["hand_out_bytes"] for d in out["pool"]) == handed
    assert sum(d["hand_in_bytes"] for d in out["pool"]) == handed
    events = json.loads((tmp_path / "prof" / "trace.json").read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"device 0", "device 1"}
