"""Full fine-tuning's reference model (issue 62): with keep_reference the engine keeps a frozen copy of the
starting weights in RAM, and `logprobs(..., reference=True)` streams it through the window in the compute
copy's place. Against code nobody here wrote: the reference's log-probabilities are transformers' log_softmax
on a copy of the starting model, and GRPO with its KL term (beta > 0) fed from them trains as TRL 1.16's
formula + torch.optim.AdamW on that model (test_objectives.py's helpers). Every placement streams the same
bits; a checkpoint holds the copy (reference.safetensors: the starting model's tensors by name), a resume
takes it from there and never from trained weights, and what cannot hold is refused by name."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file

import strider
from test_logprobs import transformers_logprobs
from test_objectives import assert_tracks, grpo_loss, reference_run
from test_package import BATCH, config, hf_batches, make_model

STEPS = 3


def grpo_config(**over):
    return config(**{"objective": "grpo", "loss_type": "grpo", "beta": 0.04, "keep_reference": True, **over})


def advantages(step):
    return torch.linspace(-1, 1, BATCH) * (step + 1)


def test_grpo_with_kl_takes_its_reference_from_the_kept_starting_weights():
    model = make_model()
    torch_model, start = copy.deepcopy(model), copy.deepcopy(model)
    data = hf_batches(model.config.vocab_size, STEPS)
    engine = strider.Engine(model, grpo_config())
    results, extras = [], []
    for i, (ids, labels, mask) in enumerate(data):
        ref = engine.logprobs(ids, labels, mask, per_token=True, reference=True)
        torch.testing.assert_close(ref, transformers_logprobs(start, ids, labels, mask), rtol=1e-5, atol=2e-5)
        extras.append((advantages(i), None, ref))
        results.append(engine.step(ids, labels, mask, advantages=advantages(i), ref_logps=ref))
    # Trained away from the start: the current weights give other log-probabilities than the reference.
    ids, labels, mask = data[0]
    now = engine.logprobs(ids, labels, mask, per_token=True)
    assert (now - engine.logprobs(ids, labels, mask, per_token=True, reference=True)).abs().max() > 1e-3
    engine.finish()
    assert all(r.metrics["kl"] >= 0 for r in results) and results[-1].metrics["kl"] > 0
    ref_steps, ref_metrics = reference_run(torch_model, data, extras,
                                           lambda lp, v, x: grpo_loss("grpo", 0.04, 0.2, 0.2, 0, lp, v, x))
    assert_tracks(results, ref_steps, ref_metrics, model, torch_model)


def test_every_placement_streams_the_same_reference_bits():
    data = hf_batches(500, 3)
    runs = {}
    for name, over in {"plain": {}, "chaos, window 3": {"chaos": True, "window": 3},
                       "pool of 2": {"devices": "2", "chaos": True}, "bf16": {"dtype": "bf16"}}.items():
        engine = strider.Engine(make_model(), grpo_config(**over))
        for i, b in enumerate(data[:2]):
            engine.step(*b, advantages=advantages(i), ref_logps=engine.logprobs(*b, per_token=True, reference=True))
        runs[name] = engine.logprobs(*data[2], per_token=True, reference=True)
        engine.finish()
    for name in ("chaos, window 3", "pool of 2"):
        assert torch.equal(runs[name], runs["plain"]), name
    # bf16: the starting weights rounded to bf16, as the model in bf16 computes with them.
    ids, labels, mask = data[2]
    start = make_model().to(torch.bfloat16)
    torch.testing.assert_close(runs["bf16"], transformers_logprobs(start, ids, labels, mask), rtol=0.02, atol=0.05)


def test_a_checkpoint_keeps_the_starting_weights_and_a_resume_takes_them_from_it(tmp_path):
    data = hf_batches(500, 4)
    start = make_model()
    whole = strider.Engine(make_model(), grpo_config())
    first = strider.Engine(make_model(), grpo_config())
    for i, b in enumerate(data[:2]):
        for e in (whole, first):
            e.step(*b, advantages=advantages(i), ref_logps=e.logprobs(*b, per_token=True, reference=True))
    first.save(tmp_path / "ckpt")
    first.finish()
    # The file is the starting model, by name, in the compute dtype (fp32 here: exactly).
    saved = load_file(tmp_path / "ckpt" / "reference.safetensors")
    assert set(saved) == {n for n, _ in start.named_parameters()}
    for n, p in start.named_parameters():
        assert torch.equal(saved[n], p.detach()), n
    resumed = strider.Engine.resume(tmp_path / "ckpt", make_model(), grpo_config())
    for i, b in enumerate(data[2:], start=2):
        ref = whole.logprobs(*b, per_token=True, reference=True)
        assert torch.equal(resumed.logprobs(*b, per_token=True, reference=True), ref)
        a, r = whole.step(*b, advantages=advantages(i), ref_logps=ref), resumed.step(*b, advantages=advantages(i),
                                                                                        ref_logps=ref)
        assert (a.loss, a.grad_norm, a.metrics) == (r.loss, r.grad_norm, r.metrics)
    for e in (whole, resumed):
        e.finish()
    # Resumed without keep_reference: allowed, the copy is dropped.
    dropped = strider.Engine.resume(tmp_path / "ckpt", make_model(), grpo_config(keep_reference=False))
    with pytest.raises(ValueError, match="keep_reference"):
        dropped.logprobs(*data[0], reference=True)
    dropped.finish()
    # A damaged copy is found before anything changes.
    raw = bytearray((tmp_path / "ckpt" / "reference.safetensors").read_bytes())
    raw[-5] ^= 0x40
    (tmp_path / "ckpt" / "reference.safetensors").write_bytes(bytes(raw))
    with pytest.raises(Exception, match="reference copy of block .* has checksum"):
        strider.Engine.resume(tmp_path / "ckpt", make_model(), grpo_config())


def test_a_checkpoint_without_the_starting_weights_is_refused_where_the_engine_keeps_them(tmp_path):
    data = hf_batches(500, 1)
    plain = strider.Engine(make_model(), grpo_config(keep_reference=False))
    plain.step(*data[0], advantages=advantages(0), ref_logps=torch.zeros(BATCH, data[0][0].shape[1] - 1))
    plain.save(tmp_path / "ckpt")
    plain.finish()
    assert not (tmp_path / "ckpt" / "reference.safetensors").exists()
    assert "reference" not in json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    with pytest.raises(ValueError, match="holds no reference copy .* a reference taken from its trained weights"):
        strider.Engine.resume(tmp_path / "ckpt", make_model(), grpo_config())


def test_what_cannot_hold_is_refused_by_name():
    import peft
    data = hf_batches(500, 1)
    full = strider.Engine(make_model(), config())
    with pytest.raises(ValueError, match=r"keeps no copy of its starting weights; build it with keep_reference"):
        full.logprobs(*data[0], reference=True)
    assert full.step(*data[0]).loss > 0  # the engine goes on
    full.finish()
    lora = peft.get_peft_model(make_model(), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                             lora_dropout=0.0))
    with pytest.raises(ValueError, match="keep_reference with lora: LoRA's reference model is its frozen base"):
        strider.Engine(lora, config(keep_reference=True))


def test_the_plan_prices_the_copy_in_host_ram():
    model_config = make_model().config.to_dict()
    without = strider.plan(model_config, config())
    kept = strider.plan(model_config, config(keep_reference=True))
    params = sum(p.numel() for p in make_model().parameters())
    assert without["reference_host_bytes"] == 0
    # fp32 compute here: 4 bytes a parameter, each block's copy aligned to 256 bytes.
    assert 4 * params <= kept["reference_host_bytes"] <= 4 * params + 256 * 64
    assert kept["host_bytes"] - without["host_bytes"] == kept["reference_host_bytes"]
    assert any("the starting weights' reference copy" in w for w in kept["why"])


def test_strider_plan_prices_the_reference_pass_and_the_copy(strider_binary):
    """`strider plan --predict`: DPO's reference scoring (a forward pass over every pair before the first step)
    and a GRPO step's reference pass over the kept copy, each a simulated forward pass on the machine, less than
    a step (no backward, no update) and more than nothing; the copy in the host figure."""
    import subprocess
    cli = str(strider_binary("strider"))

    def plan(*args):
        out = subprocess.run([cli, "plan", "--model", "llama-3.1-8b", "--gpu", "24GiB", "--ram", "256GiB",
                              "--accumulation", "16", "--predict", "rtx4090", *args],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout

    dpo = json.loads(plan("--objective", "dpo", "--json"))
    assert 0.2 * dpo["step_s"] < dpo["forward_pass_s"] < 0.5 * dpo["step_s"]
    assert dpo["reference_host_bytes"] == 0
    assert "reference pass (dpo): " in plan("--objective", "dpo")
    grpo = json.loads(plan("--objective", "grpo", "--beta", "0.04", "--keep-reference", "--json"))
    plain = json.loads(plan("--objective", "grpo", "--beta", "0.04", "--json"))
    assert "forward_pass_s" not in plain and grpo["forward_pass_s"] == pytest.approx(dpo["forward_pass_s"], rel=0.01)
    # The copy: 2 bytes a parameter in bf16 (8.03B), in the host figure.
    assert 2 * 8.03e9 < grpo["reference_host_bytes"] < 2 * 8.04e9
    assert grpo["host_bytes"] - plain["host_bytes"] == grpo["reference_host_bytes"]
    assert "with one a step, ~" in plan("--objective", "grpo", "--beta", "0.04", "--keep-reference")
