"""`strider finetune --lora` (engine/model/lora.h) on a transformers checkpoint, against PEFT.

The base loads from the checkpoint, the adapters start as PEFT starts them (lora_B zero: the first
evaluation is the base's), and the run leaves a PEFT adapter folder that PeftModel.from_pretrained loads:
its tensors are the ones PEFT itself saves for the same LoraConfig (names, shapes), it scores the held-out
batch as the engine did after its last step, and `--merge` writes the same model without adapters.
"""
import json
import subprocess

import numpy as np
import peft  # requirements.txt: a missing one fails here, not skips
import pytest
import torch
import transformers
from safetensors.torch import load_file

from test_token_data import write_tokens

VOCAB, SEQ, MICRO, ACC = 512, 32, 2, 2
LORA = "r=4,alpha=8,targets=all-linear,train=lm_head"


@pytest.fixture
def strider(strider_binary):
    return strider_binary("strider")


def finetune(strider, tmp_path, *args):
    cmd = [str(strider), "finetune", "--device", "cpu", "--seq", str(SEQ), "--micro-batch", str(MICRO),
           "--accumulation", str(ACC), "--work-dir", str(tmp_path / "work"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def base_config():
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                    tie_word_embeddings=False)


def eval_batch(path):
    """The engine's evaluation batch: the file's first micro_batch x accumulation windows of SEQ tokens, in
    order, each predicting the next token."""
    ids = np.fromfile(path, dtype="<u2", offset=128 * 8)[: MICRO * ACC * SEQ + 1].astype(np.int64)
    x = torch.from_numpy(ids[:-1].reshape(MICRO * ACC, SEQ))
    y = torch.from_numpy(ids[1:].reshape(MICRO * ACC, SEQ))
    return x, y


def loss_of(model, x, y):
    with torch.no_grad():
        logits = model(input_ids=x).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).item()


def write_base_and_tokens(tmp_path):
    """An fp32 base under tmp_path/base, train.tokens and eval.tokens; returns the base's folder."""
    torch.manual_seed(0)
    base_dir = tmp_path / "base"
    transformers.LlamaForCausalLM(base_config()).save_pretrained(base_dir)  # fp32
    rng = np.random.default_rng(0)
    write_tokens(tmp_path / "train.tokens", rng.integers(0, VOCAB, 20000), vocab=VOCAB)
    # Windows of SEQ + 1 tokens overlap by one: the first eval batch needs MICRO x ACC x SEQ + 1 tokens.
    write_tokens(tmp_path / "eval.tokens", rng.integers(0, VOCAB, 4000), vocab=VOCAB)
    return base_dir


def test_finetune_lora_writes_an_adapter_peft_loads_and_a_merged_model(strider, tmp_path):
    base_dir = write_base_and_tokens(tmp_path)
    out = tmp_path / "out"
    r = finetune(strider, tmp_path, "--model", str(base_dir), "--data", str(tmp_path / "train.tokens"),
                 "--eval-data", str(tmp_path / "eval.tokens"), "--eval-every", "3", "--eval-batches", "1",
                 "--lora", LORA, "--dtype", "fp32", "--lr", "2e-3", "--warmup", "0", "--steps", "3",
                 "--merge", "--metrics", str(tmp_path / "m.jsonl"), "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "a PEFT adapter, F32" in r.stdout and "merged" in r.stdout, r.stdout[-1500:]
    trained_loss = [json.loads(line) for line in open(tmp_path / "m.jsonl")][-1]["eval_loss"]
    x, y = eval_batch(tmp_path / "eval.tokens")

    def base():
        return transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)

    # The adapter folder holds what PEFT itself saves for this LoraConfig: the same names and shapes.
    cfg = peft.LoraConfig.from_pretrained(out)
    assert (cfg.r, cfg.lora_alpha, cfg.use_rslora, set(cfg.modules_to_save)) == (4, 8, False, {"lm_head"})
    assert set(cfg.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    ours = load_file(str(out / "adapter_model.safetensors"))
    reference_dir = tmp_path / "peft-saved"
    peft.get_peft_model(base(), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                                modules_to_save=["lm_head"], task_type="CAUSAL_LM")
                        ).save_pretrained(reference_dir)
    theirs = load_file(str(reference_dir / "adapter_model.safetensors"))
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    assert all(v.dtype == torch.float32 for v in ours.values())
    assert all(ours[k].abs().max() > 0 for k in ours if ".lora_B." in k), "lora_B never left zero"

    # Loaded by PEFT, it scores the held-out batch as the engine did after its last step (fp32 throughout).
    loaded = peft.PeftModel.from_pretrained(base(), out).eval()
    peft_loss = loss_of(loaded, x, y)
    assert abs(peft_loss - trained_loss) <= 1e-5 * abs(trained_loss), (peft_loss, trained_loss)
    assert peft_loss < loss_of(base().eval(), x, y) + 1.0  # sane, and not the base by accident:
    assert abs(peft_loss - loss_of(base().eval(), x, y)) > 1e-6

    # --merge: the model without adapters, as merge_and_unload makes it, in the base's dtype.
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
    reference = loaded.merge_and_unload()
    m, ref = merged.state_dict(), reference.state_dict()
    assert m.keys() == ref.keys()
    for k in m:
        assert torch.allclose(m[k], ref[k], rtol=1e-6, atol=1e-7), k
    assert abs(loss_of(merged, x, y) - peft_loss) <= 1e-5 * abs(peft_loss)


def test_lora_options_that_cannot_work_are_refused_before_any_work(strider, tmp_path):
    r = finetune(strider, tmp_path, "--lora", LORA, "--steps", "1", "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "LoRA adapts a pretrained model" in r.stderr, r.stderr[-1500:]
    r = finetune(strider, tmp_path, "--merge", "--steps", "1", "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "--merge" in r.stderr and "--lora" in r.stderr, r.stderr[-1500:]
    assert not (tmp_path / "o").exists()
    # An alpha whose scale would overflow the adapters' output at the first step: refused as it is parsed.
    base_dir = write_base_and_tokens(tmp_path)
    r = finetune(strider, tmp_path, "--model", str(base_dir), "--data", str(tmp_path / "train.tokens"), "--lora",
                 "r=4,alpha=1e40,targets=all-linear", "--steps", "1", "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "LoRA alpha '1e40' is past 1e+06" in r.stderr, r.stderr[-1500:]
    assert "step 1" not in r.stdout and not any((tmp_path / "o").glob("*"))


def test_finetune_lora_resumes_bit_identically_and_refuses_another_base(strider, tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(base_config()).save_pretrained(tmp_path / "base")
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(base_config()).save_pretrained(tmp_path / "other")
    write_tokens(tmp_path / "train.tokens", np.random.default_rng(0).integers(0, VOCAB, 20000), vocab=VOCAB)
    common = ("--data", str(tmp_path / "train.tokens"), "--eval-batches", "0", "--lora", LORA, "--dtype", "fp32",
              "--lr", "2e-3", "--warmup", "0", "--schedule", "constant", "--steps", "4")

    def ok(*args):
        r = finetune(strider, tmp_path, *common, *args)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r.stdout

    ok("--model", str(tmp_path / "base"), "--out", str(tmp_path / "straight"))
    # The same run stopped after step 2 (a constant learning rate: --steps is not in its maths).
    ck = tmp_path / "ck"
    first = finetune(strider, tmp_path, *common[:-1], "2", "--model", str(tmp_path / "base"), "--checkpoint-dir",
                     str(ck), "--out", str(tmp_path / "half"))
    assert first.returncode == 0, first.stderr[-3000:]
    step2 = ck / "step-00000002"
    assert (step2 / "adapter_model.safetensors").exists() and not (step2 / "model.safetensors").exists()
    r = finetune(strider, tmp_path, *common, "--model", str(tmp_path / "other"), "--checkpoint-dir", str(ck),
                 "--resume", "--out", str(tmp_path / "wrong"))
    assert r.returncode != 0 and "trained over another base" in r.stderr, r.stderr[-2000:]
    # No option lets the model change, and the message says so instead of offering --allow-changed FIELD
    # (issue 63, unclear messages); naming the adapters in --allow-changed is refused, saying what it takes.
    assert "no option lets the model change on resume" in r.stderr and "FIELD" not in r.stderr
    r = finetune(strider, tmp_path, *common, "--model", str(tmp_path / "other"), "--checkpoint-dir", str(ck),
                 "--resume", "--allow-changed", "lora", "--out", str(tmp_path / "wrong"))
    assert r.returncode != 0 and "'lora' is not a setting a resume may change" in r.stderr, r.stderr[-2000:]
    assert "LoRA adapters and their base, and the base's format) is the checkpoint's and cannot change" in r.stderr
    out = ok("--model", str(tmp_path / "base"), "--checkpoint-dir", str(ck), "--resume", "--out", str(tmp_path / "resumed"))
    assert "at step 2" in out
    a = load_file(str(tmp_path / "straight" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_bf16_bases_adapter_is_fp32_unless_bf16_is_asked(strider, tmp_path):
    # --save-dtype auto follows the base for a full model; the adapter's masters are fp32, and auto keeps
    # them so (the help's promise); only --save-dtype bf16 rounds them. The merged model follows the base.
    from safetensors import safe_open
    torch.manual_seed(0)
    base_dir = tmp_path / "base"
    transformers.LlamaForCausalLM(base_config()).to(torch.bfloat16).save_pretrained(base_dir)
    write_tokens(tmp_path / "train.tokens", np.random.default_rng(0).integers(0, VOCAB, 4000), vocab=VOCAB)
    for save_dtype, adapter, merged in (("auto", "F32", "BF16"), ("bf16", "BF16", "BF16"), ("fp32", "F32", "F32")):
        out = tmp_path / f"out-{save_dtype}"
        r = finetune(strider, tmp_path, "--model", str(base_dir), "--data", str(tmp_path / "train.tokens"),
                     "--eval-batches", "0", "--lora", LORA, "--steps", "1", "--merge", "--save-dtype", save_dtype,
                     "--out", str(out))
        assert r.returncode == 0, r.stderr
        for path, want in ((out / "adapter_model.safetensors", adapter), (out / "merged" / "model.safetensors", merged)):
            with safe_open(str(path), "pt") as f:
                dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
            assert dtypes == {want}, (save_dtype, path.name, dtypes)


def test_merge_over_an_fp32_base_trained_in_bf16_adds_the_adapter_to_the_base_as_loaded(strider, tmp_path):
    """--dtype bf16 over an fp32 checkpoint (issue 67): the engine computes with a bf16 copy of the frozen base,
    but --merge adds the adapter to the base as the checkpoint holds it, as PEFT's merge_and_unload over that
    base does; the merged model is fp32, as its base (before, the bf16-rounded base was merged)."""
    base_dir = write_base_and_tokens(tmp_path)
    out = tmp_path / "out"
    r = finetune(strider, tmp_path, "--model", str(base_dir), "--data", str(tmp_path / "train.tokens"),
                 "--lora", LORA, "--dtype", "bf16", "--lr", "2e-3", "--warmup", "0", "--steps", "2", "--merge",
                 "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    reference = peft.PeftModel.from_pretrained(base, out).merge_and_unload().state_dict()
    merged = load_file(str(out / "merged" / "model.safetensors"))
    assert merged.keys() == reference.keys()
    rounded = 0
    for k, v in merged.items():
        assert v.dtype == torch.float32, k
        assert torch.allclose(v, reference[k], rtol=1e-6, atol=1e-7), k
        rounded += int(not torch.equal(v, v.to(torch.bfloat16).float()))
    assert rounded > 0  # the base's own fp32 values, not bf16's
