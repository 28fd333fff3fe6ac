"""`strider plan`'s advice (issue 67), through the real binary: at the default batch the first line names the
accumulation worth running at (the smallest of 1 to 256 reaching 90% of the best predicted speed, every one of
them predicted and in the JSON) and says when the host optimizer sets the pace; a refusal names the largest
part of what it needs first and each option that would make it fit with the figure it would reach; the JSON's
`feasible` is the first line's verdict, the NVMe folder's free space included; --help names every preset."""
import json
import os
import subprocess

import pytest


@pytest.fixture
def plan(strider_binary):
    cli = str(strider_binary("strider"))

    def run(*args, ok=True):
        """ok: whether it fits (exit 0), or None: either."""
        out = subprocess.run([cli, "plan", *args], capture_output=True, text=True, timeout=300)
        assert ok is None or (out.returncode == 0) == ok, out.stdout + out.stderr
        return out.stdout
    return run


LLAMA_8B = ["--model", "llama-3.1-8b", "--gpu", "24GiB", "--predict", "rtx4090"]


def test_the_first_line_names_the_accumulation_worth_running_at(plan):
    text = plan(*LLAMA_8B, "--ram", "128GiB")
    got = json.loads(plan(*LLAMA_8B, "--ram", "128GiB", "--json"))
    advice = got["accumulation_advice"]
    trials = {t["accumulation"]: t["tokens_per_s"] for t in advice["trials"]}
    assert set(trials) <= {2 ** i for i in range(9)} and 1 in trials
    best = max(trials.values())
    assert advice["best_tokens_per_s"] == best and trials[advice["best_accumulation"]] == best
    # The smallest that reaches 90% of the best, and every smaller one does not.
    assert trials[advice["accumulation"]] >= 0.9 * best
    assert all(v < 0.9 * best for a, v in trials.items() if a < advice["accumulation"])
    # At batch 1 the optimizer's lane is critical, and a larger accumulation is far faster (the old advice, ~2,
    # reached a third of it).
    assert got["critical_lane"] == "optimizer" and advice["accumulation"] >= 8
    assert advice["tokens_per_s"] > 3 * got["tokens_per_s"]
    first = text.splitlines()[0]
    assert "bound by the host optimizer" in first
    assert f"(--accumulation {advice['accumulation']}: {advice['tokens_per_s']:.0f} tokens/s" in first
    # Asked at the advised accumulation, the first line gives no other advice.
    at = plan(*LLAMA_8B, "--ram", "128GiB", "--accumulation", str(advice["accumulation"])).splitlines()[0]
    assert "(--accumulation" not in at


def test_a_refusal_names_its_largest_part_and_what_would_fit(plan):
    """RoundPipe's workload on 256 GiB: the kept block inputs, not the optimizer state, are most of it."""
    args = [*LLAMA_8B, "--ram", "256GiB", "--seq", "2048", "--accumulation", "256"]
    text = plan(*args, ok=False)
    first = text.splitlines()[0]
    assert first.startswith("does not fit: needs ")
    assert first.index("the block inputs kept for the backward") < first.index("the optimizer state")
    assert "--optimizer-state q8" in first
    got = json.loads(plan(*args, "--json", ok=False))
    assert got["feasible"] is False
    fits = {f["change"]: f for f in got["fits_with"]}
    assert {"--optimizer-state q8", "--nvme DIR", "--accumulation 128"} <= set(fits)
    assert any(c.startswith("--lora ") for c in fits)
    for f in got["fits_with"]:
        assert f["host_peak_bytes"] <= 256 * 2 ** 30
        assert f"  fits with {f['change']}: " in text
    assert fits["--optimizer-state q8"]["tokens_per_s"] > 0 and fits["--nvme DIR"]["tokens_per_s"] is None
    assert fits["--nvme DIR"]["nvme_bytes"] > 0
    # Each option, given, fits.
    q8 = json.loads(plan(*args, "--optimizer-state", "q8", "--json"))
    assert q8["feasible"] and q8["tokens_per_s"] == pytest.approx(fits["--optimizer-state q8"]["tokens_per_s"])


def test_full_training_too_large_for_the_machine_is_told_of_qlora(plan):
    got = json.loads(plan("--model", "llama-3.1-70b", "--gpu", "24GiB", "--ram", "64GiB", "--predict", "none",
                          "--json", ok=False))
    changes = [f["change"] for f in got["fits_with"]]
    assert "--nvme DIR" not in changes or got["fits_with"][changes.index("--nvme DIR")]["nvme_bytes"] > 0
    assert "--lora r=16,alpha=32,targets=all-linear --base-format nf4" in changes


def test_the_json_verdict_counts_the_nvme_folders_free_space(plan, tmp_path):
    """The same verdict as the first line on any machine: feasible exactly when the folder holds what the plan
    puts there (Llama-3.1-70B's fp32 state on 64 GiB of RAM is ~970 GiB)."""
    args = ["--model", "llama-3.1-70b", "--gpu", "24GiB", "--ram", "64GiB", "--nvme", str(tmp_path),
            "--predict", "none"]
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    got = json.loads(plan(*args, "--json", ok=None))
    assert got["nvme_free_bytes"] == pytest.approx(free, rel=0.01)
    first = plan(*args, ok=None).splitlines()[0]
    if free < got["nvme_bytes"]:
        assert got["feasible"] is False and "which has" in got["reason"]
        assert first.startswith("does not fit: the plan puts ")
    else:
        assert got["feasible"] is True and first.startswith("fits: ")
    # A folder that is not here (a plan for another machine): not checked, and said so.
    elsewhere = json.loads(plan(*args[:-4], "--nvme", str(tmp_path / "elsewhere"), "--predict", "none", "--json"))
    assert elsewhere["feasible"] is True and elsewhere["nvme_free_bytes"] is None
    assert "which is not a folder here: its free space is not checked" in elsewhere["answer"]


def test_help_names_every_preset(plan):
    text = plan("--help")
    for preset in ("llama-3.1-8b", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "qwen1.5-moe-a2.7b"):
        assert preset in text
