"""bench/bench_vs_torch.py end to end at a toy size: both sides train the same
model on the same batches, step by step, and the JSON line carries the ratio
and the losses' agreement (the figure itself is never asserted: timing)."""
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("docs", [0, 3])
def test_bench_vs_torch_runs_both_sides_and_their_losses_agree(build_dir, repo_root, docs):
    """docs 3: rows of three packed documents, strider's packed_documents against transformers' packed
    position_ids, in fp32, where their losses agree to 1e-4 only if both keep the documents apart (attending
    across them moves this toy's loss by ~2e-3)."""
    cmd = [sys.executable, str(repo_root / "bench/bench_vs_torch.py"), "--toy", "--rounds", "2", "--docs", str(docs)]
    if docs:
        cmd += ["--dtype", "fp32"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "STRIDER_BUILD_DIR": str(build_dir)})
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["bench"] == "vs_torch" and result["device"] == "cpu" and result["docs"] == docs
    assert result["steps"] == 3  # one warm-up step, then 2 rounds x 1 step, each side
    assert result["strider_over_torch"] > 0 and len(result["ratios"]) == 2
    assert result["loss_max_rel_diff"] < (1e-4 if docs else 2e-2)
    assert "round 2:" in r.stdout and "step 3: loss torch" in r.stdout


def test_bench_vs_torch_with_lora_runs_peft_strider_and_full_training(build_dir, repo_root):
    cmd = [sys.executable, str(repo_root / "bench/bench_vs_torch.py"), "--toy", "--rounds", "2", "--lora", "4"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "STRIDER_BUILD_DIR": str(build_dir)})
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["lora"] == 4 and result["steps"] == 3
    assert result["lora_over_full"] > 0 and len(result["lora_over_full_rounds"]) == 2
    assert result["loss_max_rel_diff"] < 2e-2  # strider's LoRA against PEFT's, step by step
    assert "LoRA step / full step" in r.stdout
