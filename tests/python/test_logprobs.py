"""`Engine.logprobs`: each target's log-probability under the current weights, forward only (issue 62, the
first part), against transformers' own log_softmax of its logits on the same weights, in fp32: per row summed
and per token, with a prompt that does not count, right padding, fewer rows and a shorter length than the
engine's batch, a tied head split in vocabulary shards, and chaos, window 3 and a pool of two devices giving the
same bits. Nothing changes: the weights, the step count and the next step are those of an engine never asked."""
import pytest
import torch

import strider
from test_package import BATCH, SEQ, config, hf_batches, make_model


def transformers_logprobs(model, ids, labels, mask):
    """TRL's per-token log-probabilities: log_softmax of the logits in fp32, gathered at the shifted labels, 0
    where the target is -100 or padding."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    target = labels[:, 1:]
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return lp.masked_fill((target == -100) | (mask[:, 1:] == 0), 0.0)


@pytest.mark.parametrize("kind, over", [("llama", {}), ("qwen3_tied", {"vocab_shard_rows": 200})])
def test_logprobs_are_transformers_log_softmax_at_the_labels(kind, over):
    batches = hf_batches(500, 3)
    engine = strider.Engine(make_model(kind), config(**over))
    for b in batches[:2]:
        engine.step(*b)
    model = engine.sync_to_model()  # the trained weights, as the engine computes with them (fp32)
    ids, labels, mask = batches[2]
    expected = transformers_logprobs(model, ids, labels, mask)
    per_token = engine.logprobs(ids, labels, mask, per_token=True)
    assert per_token.shape == (BATCH, SEQ - 1) and per_token.dtype == torch.float32
    assert bool((per_token[(labels[:, 1:] == -100) | (mask[:, 1:] == 0)] == 0).all())
    torch.testing.assert_close(per_token, expected, rtol=1e-5, atol=2e-5)
    sums = engine.logprobs(ids, labels, mask)
    assert sums.shape == (BATCH,)
    torch.testing.assert_close(sums, expected.sum(dim=1), rtol=1e-5, atol=1e-4)
    # The loss is minus their mean over the batch's targets.
    valid = int(((labels[:, 1:] != -100) & (mask[:, 1:] != 0)).sum())
    assert engine.evaluate(ids, labels, mask) == pytest.approx(-float(sums.double().sum()) / valid, rel=1e-5)
    # Fewer rows and a shorter length than the engine's batch: the engine pads, the answer keeps the caller's shape.
    short = engine.logprobs(ids[:3, :11], labels[:3, :11], mask[:3, :11], per_token=True)
    assert short.shape == (3, 10)
    torch.testing.assert_close(short, transformers_logprobs(model, ids[:3, :11], labels[:3, :11], mask[:3, :11]),
                               rtol=1e-5, atol=2e-5)
    # A row without a target sums to 0.
    none = labels.clone()
    none[1] = -100
    assert float(engine.logprobs(ids, none, mask)[1]) == 0.0


def test_logprobs_change_nothing_and_every_placement_gives_the_same_bits():
    batches = hf_batches(500, 4)
    engines = {name: strider.Engine(make_model(), config(**over)) for name, over in {
        "plain": {}, "chaos": {"chaos": True}, "window 3": {"window": 3}, "pool": {"devices": "2", "chaos": True}}.items()}
    asked = strider.Engine(make_model(), config())
    never = strider.Engine(make_model(), config())
    for b in batches[:2]:
        for e in [*engines.values(), asked, never]:
            e.step(*b)
    ids, labels, mask = batches[2]
    got = {name: e.logprobs(ids, labels, mask, per_token=True) for name, e in engines.items()}
    for name, lp in got.items():
        assert torch.equal(lp, got["plain"]), name
    before = {n: asked.param(n).clone() for n in asked.param_names()}
    for _ in range(2):
        asked.logprobs(ids, labels, mask)
    assert all(torch.equal(asked.param(n), before[n]) for n in before)
    assert asked.steps_done == never.steps_done == 2
    assert asked.step(*batches[3]).loss == never.step(*batches[3]).loss
    for e in [*engines.values(), asked, never]:
        e.finish()


@pytest.mark.parametrize("over", [{}, {"chaos": True, "window": 3}])
def test_the_reference_of_a_lora_model_is_its_frozen_base_as_peft_disables_its_adapters(over):
    """logprobs(reference=True) on a PEFT LoRA model: its layers without their adapters, as PEFT's
    disable_adapter() computes (after training, so that the adapters do change the answer); with the
    adapters, the PEFT model itself. Without LoRA, and with modules trained in full, the reference is
    refused as a ValueError and the engine goes on."""
    import peft
    batches = hf_batches(500, 3)
    lora = peft.get_peft_model(make_model(), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                             lora_dropout=0.0))
    engine = strider.Engine(lora, config(**over))
    for b in batches[:2]:
        engine.step(*b)
    engine.sync_to_model()
    ids, labels, mask = batches[2]
    with lora.disable_adapter():
        base = transformers_logprobs(lora, ids, labels, mask)
    adapted = transformers_logprobs(lora, ids, labels, mask)
    assert (base - adapted).abs().max() > 1e-3
    torch.testing.assert_close(engine.logprobs(ids, labels, mask, per_token=True, reference=True), base,
                               rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(engine.logprobs(ids, labels, mask, per_token=True), adapted, rtol=1e-5, atol=2e-5)
    engine.finish()

    full = strider.Engine(make_model(), config())
    with pytest.raises(ValueError, match="keeps no copy of its starting weights; build it with keep_reference"):
        full.logprobs(ids, labels, mask, reference=True)
    assert full.step(*batches[0]).loss > 0  # the engine goes on
    full.finish()
    saved = peft.get_peft_model(make_model(), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                              lora_dropout=0.0, modules_to_save=["lm_head"]))
    with_head = strider.Engine(saved, config())
    with pytest.raises(ValueError, match="lm_head train in full"):
        with_head.logprobs(ids, labels, mask, reference=True)
    with_head.finish()
