"""The optimizer-state formats (host/state_format.h) from the outside: what `strider plan` says each
takes (issue 13: the 8B plan's pinned training state under 8 bytes per parameter with q8), a q8 run
that trains, resumes bit-identically and is refused by a resume in another format, and the Python
config's checks. The engine's own invariants in q8 (bit-identical across K, tiers, chaos, shards)
are Catch2 tests: tests/engine/test_engine.cpp, test_train_checkpoint.cpp, tests/host/test_adam_q8.cpp."""
import json
import re
import subprocess

import pytest
import torch
from safetensors.torch import load_file

import strider  # noqa: E402  (tests/python/conftest.py puts python_shim/ on sys.path)


@pytest.fixture
def binary(strider_binary):
    return str(strider_binary("strider"))


def plan(binary, *args, ram="256GiB"):
    out = subprocess.run([binary, "plan", "--model", "llama-3.1-8b", "--gpu", "24GiB", "--ram", ram, "--seq",
                          "1024", "--accumulation", "8", "--clip", "1", *args], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return out


def test_plan_counts_each_formats_bytes(binary):
    q8 = json.loads(plan(binary, "--optimizer-state", "q8", "--json"))
    fp32 = json.loads(plan(binary, "--json"))
    params = float(re.search(r"([0-9.]+)B parameters", q8["model"]).group(1)) * 1e9
    # The pinned training state: format + bf16 compute copy + bf16 gradient staging.
    assert q8["optimizer_state"] == "q8" and q8["host_bytes"] <= 8 * params
    assert fp32["host_bytes"] > 15.9 * params
    # Everything pinned (kept activations too) is the larger figure; the process's peak larger still.
    assert q8["host_bytes"] < q8["host_pinned_bytes"] <= q8["host_peak_bytes"]
    # Each plan says what the other format would take under the same limits.
    assert q8["other_formats"] == [{"optimizer_state": "fp32", "feasible": True, "host_bytes": fp32["host_bytes"],
                                    "nvme_blocks": 0}]
    assert fp32["other_formats"][0]["host_bytes"] == q8["host_bytes"]
    text = plan(binary, "--optimizer-state", "q8")
    assert "optimizer state (q8: master, Adam m, v at 3.062 bytes per parameter) in host RAM" in text
    assert "fp32 would take" in text


def test_plan_with_little_ram_puts_fewer_q8_blocks_on_nvme(binary):
    lim = ["--nvme", "/tmp/strider-nvme-plan", "--json"]
    q8 = json.loads(plan(binary, "--optimizer-state", "q8", *lim, ram="96GiB"))
    fp32 = json.loads(plan(binary, *lim, ram="96GiB"))
    assert len(q8["nvme_blocks"]) < len(fp32["nvme_blocks"])
    assert q8["nvme_bytes"] < fp32["nvme_bytes"] / 3  # 3.06 bytes per parameter on the drive, not 12


def finetune(binary, tmp_path, *args, check=True, state="q8"):
    cmd = [binary, "finetune", "--device", "cpu", "--seq", "32", "--micro-batch", "2", "--accumulation", "2",
           "--work-dir", str(tmp_path / "work"), "--eval-batches", "0", "--optimizer-state", state, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=check)


def test_q8_run_trains_resumes_bit_identically_and_a_fp32_resume_is_refused(binary, tmp_path):
    def losses(path):
        return [json.loads(l)["loss"] for l in path.read_text().splitlines()]

    finetune(binary, tmp_path, "--steps", "6", "--metrics", str(tmp_path / "q8.jsonl"), "--out",
             str(tmp_path / "straight"))
    finetune(binary, tmp_path, "--steps", "6", "--metrics", str(tmp_path / "fp32.jsonl"), "--out",
             str(tmp_path / "fp32-run"), state="fp32")
    q8, fp32 = losses(tmp_path / "q8.jsonl"), losses(tmp_path / "fp32.jsonl")
    assert q8[-1] < q8[0] - 0.1
    assert q8 != fp32 and q8 == pytest.approx(fp32, rel=5e-3)  # another format, the same training
    finetune(binary, tmp_path, "--steps", "3", "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "half"))
    state = json.loads((tmp_path / "ck" / "step-00000003" / "trainer_state.json").read_text())
    assert state["engine_config"]["optimizer_state"] == "q8"
    out = finetune(binary, tmp_path, "--steps", "6", "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
                   "--allow-changed", "total_steps", "--out", str(tmp_path / "resumed")).stdout
    assert "at step 3" in out
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)), k
    # The checkpoint names its format; resuming it in fp32 is refused, naming the field, and nothing is lost.
    bad = finetune(binary, tmp_path, "--steps", "8", "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
                   "--out", str(tmp_path / "fp32"), check=False, state="fp32")
    assert bad.returncode != 0
    assert "optimizer_state" in bad.stderr and '"q8"' in bad.stderr, bad.stderr
    assert (tmp_path / "ck" / "step-00000006" / "trainer_state.json").exists()


def test_q8_needs_the_bf16_compute_dtype(binary, tmp_path):
    r = finetune(binary, tmp_path, "--steps", "1", "--dtype", "fp32", "--out", str(tmp_path / "o"), check=False)
    assert r.returncode != 0 and "--optimizer-state q8 with --dtype fp32: " in r.stderr, r.stderr
    assert "needs the bf16 compute dtype, not fp32" in r.stderr
    with pytest.raises(ValueError, match="optimizer_state.*needs the bf16 compute dtype"):
        strider.EngineConfig(dtype="fp32", optimizer_state="q8")
    with pytest.raises(ValueError, match="optimizer_state"):
        strider.EngineConfig(optimizer_state="int4")
