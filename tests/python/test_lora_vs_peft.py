"""LoRA over a frozen base (engine/model/lora.h), driven from Python with a PEFT model in place, against PEFT +
torch.optim.AdamW.

fp32 (an fp32 base), the CPU device, a window of 2 units over 4 blocks: a PEFT LoRA model (q, k, v, o and
the MLP's projections, and the LM head in modules_to_save) trained for 4 steps with accumulation, clipping,
weight decay and a warm-up tracks the same PEFT model trained by torch to 1e-5 relative, in every step's
loss and gradient norm and in every adapter afterwards; every frozen base weight keeps its bits; and the adapter the trained PEFT model
saves loads with PeftModel.from_pretrained into the same logits.
"""
import copy

import peft  # requirements.txt: a missing one fails here, not skips
import pytest
import torch
import transformers

import strider  # noqa: E402  (conftest puts python_shim/ on sys.path)
# The full-training test's model size, data and reference: transformers + torch.optim.AdamW with the Trainer's
# weight-decay groups, warm-up and linear decay, clipping (over the parameters that have gradients: PEFT's).
from test_engine_vs_torch import (ACCUMULATION, BETAS, CLIP, EPS, LR, MICRO_BATCH, SEQ, SMALL, TOTAL,  # noqa: E402
                                  WARMUP, WEIGHT_DECAY, batches, reference_run, rel_err)

from conftest import require_op_library  # noqa: E402

require_op_library()

STEPS = 4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(seed=0, arch="llama"):
    """Llama; or OLMo 2 (norms after the branches, frozen) and Gemma 3 (sandwich norms, a window of 8 below
    the sequence on its sliding layers), untied so that the LM head can train in full."""
    torch.manual_seed(seed)
    if arch == "olmo2":
        cfg = transformers.Olmo2Config(**SMALL, pad_token_id=0)
    elif arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                            tie_word_embeddings=False, pad_token_id=0,
                                            layer_types=["sliding_attention", "full_attention"])
    else:
        cfg = transformers.LlamaConfig(**SMALL)
    cfg._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def lora_model(base, **over):
    opts = dict(r=4, lora_alpha=8, target_modules=ALL, lora_dropout=0.0, modules_to_save=["lm_head"])
    opts.update(over)
    model = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", **opts))
    with torch.no_grad():  # PEFT starts lora_B at zero: move it so that lora_A's gradients mean something
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.add_(torch.randn_like(p) * 0.05)
    return model


def config(**over):
    return strider.EngineConfig(**{**dict(seq=SEQ, micro_batch=MICRO_BATCH, accumulation=ACCUMULATION, dtype="fp32",
                                          vocab_chunk=300, window=2, lr=LR, betas=BETAS, eps=EPS,
                                          weight_decay=WEIGHT_DECAY, schedule="linear", warmup_steps=WARMUP,
                                          total_steps=TOTAL, clip_norm=CLIP, device="cpu"), **over})


@pytest.mark.parametrize("arch,chaos,devices", [("llama", False, "1"), ("llama", True, "2"), ("olmo2", True, "2"),
                                                 ("gemma3", False, "1")])
def test_lora_tracks_peft_and_adamw_and_keeps_the_base(arch, chaos, devices, tmp_path):
    model = lora_model(base_model(arch=arch))
    reference = copy.deepcopy(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    data = batches(SMALL["vocab_size"])[:STEPS]

    engine = strider.Engine(model, config(chaos=chaos, devices=devices))
    assert engine.config.lora == "r=4,alpha=8,targets=" + "+".join(ALL) + ",train=lm_head"
    results = [engine.step(ids, labels) for ids, labels in data]
    engine.finish()
    ref = reference_run(reference, data)

    for s, (r, (loss, norm)) in enumerate(zip(results, ref)):
        assert abs(r.loss - loss) <= 1e-5 * abs(loss), f"step {s + 1}: loss {r.loss} vs {loss}"
        assert abs(r.grad_norm - norm) <= 1e-5 * norm, f"step {s + 1}: grad norm {r.grad_norm} vs {norm}"
    got, want = dict(model.named_parameters()), dict(reference.named_parameters())
    trained = 0
    for name, p in want.items():
        if name in frozen:  # the base (and PEFT's own copy of the LM head): bit for bit what it was
            assert torch.equal(got[name].detach(), frozen[name]), name
            continue
        trained += 1
        assert rel_err(got[name].detach(), p.detach()) <= 1e-5, name  # measured: 5.4e-7 at most (the LM head)
        assert not torch.equal(got[name].detach(), initial[name]), name  # it trained
    assert trained == 2 * 7 * 2 + 1  # the adapters, and the LM head trained in full

    # The trained adapter, saved by PEFT, loads into the same logits.
    model.save_pretrained(tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(base_model(arch=arch), tmp_path / "adapter")
    ids = data[0][0]
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, loaded(input_ids=ids).logits
    assert (a - b).abs().max().item() <= 1e-6 * max(1.0, a.abs().max().item())


def test_peft_options_strider_does_not_implement_are_refused_by_name():
    for over, named in [(dict(use_dora=True), "use_dora"), (dict(lora_dropout=0.1), "lora_dropout"),
                        (dict(bias="lora_only"), "bias"), (dict(modules_to_save=["norm"]), "modules_to_save"),
                        (dict(layers_to_transform=[0]), "layers_to_transform"),
                        (dict(rank_pattern={"q_proj": 8}), "rank_pattern")]:
        model = lora_model(base_model(), **over)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(ValueError, match=named):
            strider.Engine(model, config())
        assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())  # untouched
    with pytest.raises(ValueError, match="needs the model's adapters"):
        strider.Engine(base_model(), config(lora="r=4,alpha=8,targets=q_proj"))
    model = lora_model(base_model())
    model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad=False"):
        strider.Engine(model, config())



def test_save_and_resume_a_peft_model_is_bit_identical_and_the_checkpoint_holds_the_adapter(tmp_path):
    """Engine.save of a PEFT model: the adapters' state and the base's fingerprint, and the adapter PEFT loads;
    Engine.resume into a PEFT model over the same base (with new adapters) continues bit for bit; over
    another base it is refused by name and the model is untouched."""
    data = batches(SMALL["vocab_size"])[:STEPS]
    straight = lora_model(base_model())
    engine = strider.Engine(straight, config())
    for ids, labels in data:
        engine.step(ids, labels)
    engine.finish()

    first = lora_model(base_model())
    engine = strider.Engine(first, config())
    for ids, labels in data[:2]:
        engine.step(ids, labels)
    engine.save(tmp_path / "ckpt", extra={"at": 2})
    engine.finish()
    loaded = peft.PeftModel.from_pretrained(base_model(), tmp_path / "ckpt")  # the checkpoint's adapter
    with torch.no_grad():
        a, b = first(input_ids=data[0][0]).logits, loaded(input_ids=data[0][0]).logits
    assert (a - b).abs().max().item() <= 1e-6 * max(1.0, a.abs().max().item())

    fresh = peft.get_peft_model(base_model(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL, lora_dropout=0.0,
                                                               modules_to_save=["lm_head"], task_type="CAUSAL_LM"))
    resumed = strider.Engine.resume(tmp_path / "ckpt", fresh)
    assert resumed.resumed_extra == {"at": 2} and resumed.config.lora.startswith("r=4,alpha=8,")
    for ids, labels in data[2:]:
        resumed.step(ids, labels)
    resumed.finish()
    want = dict(straight.named_parameters())
    for name, p in fresh.named_parameters():
        assert torch.equal(p.detach(), want[name].detach()), name

    other = lora_model(base_model(seed=3))
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    with pytest.raises(ValueError, match="trained over another base"):
        strider.Engine.resume(tmp_path / "ckpt", other)
    assert all(torch.equal(p.detach(), before[n]) for n, p in other.named_parameters())
