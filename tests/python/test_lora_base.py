"""LoRA over a quantized base (host/base_format.h): `strider finetune --lora --base-format int8|nf4` and a
PEFT model with EngineConfig(base_format=...), against PEFT over the same base quantized independently.

The formats are as docs/lora.md, "Quantized bases", states them: int8 per row with scale absmax / 127, and QLoRA's NF4 (its
table of 16 levels, blocks of 64 with an absmax each). strider.torch_reference.quantized_round_trip
quantizes and dequantizes the transformers checkpoint's weight matrices with numpy by that definition;
this file lays the engine's adapter over that model with PEFT, and holds it to the engine's own held-out
loss after training; `--merge` writes the dequantized base plus the adapters, as PEFT's merge_and_unload
of that model. A resume with a base format
other than the checkpoint's is refused naming the field. From Python, the base's tensors are released
during training and hold their dequantized values after finish().
"""
import json

import peft  # requirements.txt: a missing one fails here, not skips
import pytest
import torch
import transformers
from strider.torch_reference import quantized_round_trip

from test_lora_cli import SEQ, base_config, eval_batch, finetune, loss_of, write_base_and_tokens

LORA = "r=4,alpha=8,targets=all-linear"


@pytest.fixture
def strider(strider_binary):
    return strider_binary("strider")


def quantized_base(base_dir, fmt):
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and p.dim() == 2:  # the decoder layers' linear weights
                p.copy_(torch.from_numpy(quantized_round_trip(p.numpy(), fmt)))
    return model.eval()


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_a_quantized_base_trains_adapters_peft_scores_over_the_same_base(strider, tmp_path, fmt):
    base_dir = write_base_and_tokens(tmp_path)
    out = tmp_path / "out"
    r = finetune(strider, tmp_path, "--model", str(base_dir), "--data", str(tmp_path / "train.tokens"),
                 "--eval-data", str(tmp_path / "eval.tokens"), "--eval-every", "3", "--eval-batches", "1",
                 "--lora", LORA, "--base-format", fmt, "--dtype", "fp32", "--lr", "2e-3", "--warmup", "0",
                 "--steps", "3", "--merge", "--metrics", str(tmp_path / "m.jsonl"), "--checkpoint-dir",
                 str(tmp_path / "ck"), "--checkpoint-every", "3", "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    trained_loss = [json.loads(line) for line in open(tmp_path / "m.jsonl")][-1]["eval_loss"]
    x, y = eval_batch(tmp_path / "eval.tokens")

    # PEFT over the base quantized by the definition above scores as the engine did (fp32 throughout) ...
    loaded = peft.PeftModel.from_pretrained(quantized_base(base_dir, fmt), out).eval()
    peft_loss = loss_of(loaded, x, y)
    assert abs(peft_loss - trained_loss) <= 1e-5 * abs(trained_loss), (peft_loss, trained_loss)
    # ... and over the exact base it scores otherwise, but near it: the adapters trained over the quantized one.
    exact = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), out).eval()
    exact_loss = loss_of(exact, x, y)
    assert abs(exact_loss - trained_loss) > 1e-6 and abs(exact_loss - trained_loss) < 0.05 * trained_loss

    # --merge: the dequantized base plus scale B A, as merge_and_unload makes it from that model.
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
    m, ref = merged.state_dict(), loaded.merge_and_unload().state_dict()
    assert m.keys() == ref.keys()
    for k in m:
        assert torch.allclose(m[k], ref[k], rtol=1e-6, atol=1e-7), k

    # The format is part of the run's maths: resuming with another is refused naming it.
    r = finetune(strider, tmp_path, "--model", str(base_dir), "--data", str(tmp_path / "train.tokens"),
                 "--eval-batches", "0", "--lora", LORA, "--base-format", "compute", "--dtype", "fp32", "--lr",
                 "2e-3", "--warmup", "0", "--steps", "4", "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
                 "--out", str(tmp_path / "again"))
    assert r.returncode != 0 and "base_format" in r.stderr, r.stderr[-2000:]


def test_a_base_format_without_lora_is_refused_before_any_work(strider, tmp_path):
    r = finetune(strider, tmp_path, "--base-format", "nf4", "--steps", "1", "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "--base-format nf4" in r.stderr and "--lora" in r.stderr, r.stderr[-1500:]
    r = finetune(strider, tmp_path, "--base-format", "fp4", "--steps", "1", "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "fp4" in r.stderr, r.stderr[-1500:]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_a_peft_model_trains_over_a_quantized_base_from_python(fmt):
    """From Python the base's tensors are released while the engine holds them quantized, and finish() puts
    back their dequantized values: the model then computes what the engine trained."""
    import strider as s
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(base_config())
    q = model.model.layers[1].self_attn.q_proj.weight
    original = q.detach().clone()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                      lora_dropout=0.0))
    with pytest.raises(ValueError, match="wrap the model with peft.get_peft_model"):
        s.Engine(transformers.LlamaForCausalLM(base_config()), s.EngineConfig(seq=SEQ, base_format=fmt))
    cfg = s.EngineConfig(seq=SEQ, micro_batch=2, accumulation=2, dtype="fp32", lr=2e-3, base_format=fmt,
                         device="cpu")
    engine = s.Engine(lora, cfg)
    name = next(n for n in engine.param_names() if n.endswith("layers.1.self_attn.q_proj.weight"))
    assert q.numel() == 0 and not engine.is_aliased(name)  # released: the engine holds it in `fmt`
    ids = torch.randint(0, 512, (4, SEQ), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        engine.step(ids, ids.clone())
    engine.finish()
    held_out = engine.evaluate(ids, ids.clone())
    assert q.shape == original.shape and q.dtype == original.dtype
    assert torch.equal(q.detach(), torch.from_numpy(quantized_round_trip(original.numpy(), fmt)))
    with torch.no_grad():
        logits = lora(input_ids=ids).logits.float()
    ours = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 512), ids[:, 1:].reshape(-1)).item()
    assert abs(ours - held_out) <= 1e-5 * held_out, (ours, held_out)
