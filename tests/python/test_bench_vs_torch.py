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


def test_bench_vs_torch_on_a_checkpoint_folder_with_the_command_line_beside(build_dir, repo_root, tmp_path):
    """--model DIR trains the folder's own weights on both sides (their losses agree step by step, which a
    random model of the same shape would not give torch's side); --cli adds `strider profile` on it in every
    round; --window 0 runs the plan's window and the JSON says which."""
    import torch
    import transformers
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(hidden_size=72, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    cmd = [sys.executable, str(repo_root / "bench/bench_vs_torch.py"), "--model", str(tmp_path / "model"), "--cli",
           "--window", "0", "--rounds", "2", "--steps-per-round", "1", "--seq", "32"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "STRIDER_BUILD_DIR": str(build_dir)})
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["model"] == str(tmp_path / "model") and result["params"] == sum(
        p.numel() for p in transformers.LlamaForCausalLM(cfg).parameters())
    assert result["window_asked"] == 0 and result["window"] >= 2
    assert result["cli_over_torch"] > 0 and len(result["cli_ratios"]) == 2
    assert result["loss_max_rel_diff"] < 2e-2
    assert "CLI/torch" in r.stdout
    bad = subprocess.run([sys.executable, str(repo_root / "bench/bench_vs_torch.py"), "--cli"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--cli needs --model" in bad.stderr
