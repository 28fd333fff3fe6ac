"""`strider finetune` on transformers checkpoints of the newer architectures (issue 33): a folder written
by `save_pretrained` loads, trains, and the output folder loads back with `AutoModelForCausalLM`, scoring
the held-out batch as the engine did after its last step. Their steps' agreement with transformers +
AdamW is tests/python/test_engine_vs_torch.py's (test_moe_vs_transformers.py's for the mixtures of experts).
"""
import json

import numpy as np
import pytest
import torch
import transformers

from test_lora_cli import ACC, MICRO, SEQ, VOCAB, eval_batch, finetune, loss_of, strider  # noqa: F401 (fixture)
from test_token_data import write_tokens

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)


def config(arch):
    # Mixtures of experts, saved in the Hub's layout (a tensor per expert and projection): Qwen3-MoE with a
    # dense layer 1, Mixtral's block_sparse_moe names, Qwen2-MoE's shared expert.
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=32, num_experts=6,
                                           num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
    if arch == "mixtral":
        return transformers.MixtralConfig(**{**COMMON, "intermediate_size": 48}, num_local_experts=4,
                                          num_experts_per_tok=2)
    if arch == "qwen2_moe":  # its shared expert and gate; layer 1 dense
        return transformers.Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                           num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])
    if arch == "olmo2":
        return transformers.Olmo2Config(**COMMON)
    if arch == "gemma2":  # soft-capped attention and logits; layers 0 and 2 slide over 8 positions
        return transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                         attn_logit_softcapping=5.0, final_logit_softcapping=6.0)
    # Gemma 3: layers 0 and 2 slide over 8 positions (< SEQ), layer 1 is global; tied embeddings.
    return transformers.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"])


@pytest.mark.parametrize("arch", ["olmo2", "gemma3", "gemma2", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_finetune_a_saved_checkpoint_and_load_the_output_back(strider, tmp_path, arch):  # noqa: F811
    torch.manual_seed(0)
    src = tmp_path / "src"
    transformers.AutoModelForCausalLM.from_config(config(arch), dtype=torch.float32).save_pretrained(src)
    rng = np.random.default_rng(0)
    write_tokens(tmp_path / "train.tokens", rng.integers(0, VOCAB, 20000), vocab=VOCAB)
    write_tokens(tmp_path / "eval.tokens", rng.integers(0, VOCAB, 4000), vocab=VOCAB)
    out = tmp_path / "out"
    r = finetune(strider, tmp_path, "--model", str(src), "--data", str(tmp_path / "train.tokens"),
                 "--eval-data", str(tmp_path / "eval.tokens"), "--eval-every", "3", "--eval-batches", "1",
                 "--dtype", "fp32", "--lr", "1e-3", "--warmup", "0", "--steps", "3", "--window", "2",
                 "--metrics", str(tmp_path / "m.jsonl"), "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    evals = [json.loads(line)["eval_loss"] for line in open(tmp_path / "m.jsonl") if "eval_loss" in line]
    x, y = eval_batch(tmp_path / "eval.tokens")
    before = loss_of(transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), x, y)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    after = loss_of(model, x, y)
    assert abs(after - evals[-1]) <= 1e-5 * abs(evals[-1]), (after, evals)
    assert after != before


def test_experts_cut_into_groups_train_the_whole_layers_bits_at_the_chunk_the_plan_names(strider, tmp_path):  # noqa: F811
    """`--mlp-pieces 2` on a mixture of experts against whole layers, through the binary (issue 63, trains
    silently wrong 3). Cut layers make the vocabulary shards no larger than a piece; where that is below
    --vocab-chunk the LM head's logits come in smaller chunks and the loss's log-sum-exp merges other partial
    sums, so the plan names the chunk, and whole layers at that chunk give the cut's bits, tensor for tensor."""
    import re

    from safetensors.torch import load_file
    torch.manual_seed(0)
    src = tmp_path / "src"
    cfg = transformers.Qwen3MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                      num_experts_per_tok=2, norm_topk_prob=True)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(src)
    write_tokens(tmp_path / "train.tokens", np.random.default_rng(0).integers(0, VOCAB, 20000), vocab=VOCAB)

    def run(name, *extra):
        r = finetune(strider, tmp_path, "--model", str(src), "--data", str(tmp_path / "train.tokens"),
                     "--eval-batches", "0", "--dtype", "bf16", "--save-dtype", "fp32", "--clip", "0",
                     "--steps", "3", "--seed", "5", "--out", str(tmp_path / name), *extra)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r.stdout + r.stderr, load_file(tmp_path / name / "model.safetensors")

    log, cut = run("cut", "--mlp-pieces", "2")
    m = re.search(r"LM-head chunks of (\d+) rows, not (\d+) \(--vocab-chunk\)", log)
    assert m, log[-3000:]
    assert int(m.group(1)) < int(m.group(2)) == VOCAB
    whole_log, whole = run("whole", "--vocab-chunk", m.group(1))
    assert "LM-head chunks of" not in whole_log
    assert cut.keys() == whole.keys()
    assert [k for k in cut if not cut[k].equal(whole[k])] == []
    _, default = run("default")  # the default chunk rounds otherwise: the check above can see a difference
    assert any(not cut[k].equal(default[k]) for k in cut)
