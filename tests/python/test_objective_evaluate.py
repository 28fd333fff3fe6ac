"""Engine.evaluate under an objective past SFT: the objective's loss and TRL's figures for one batch, with no
update, against the same loss written in plain torch from TRL 1.16's formulas on transformers' logits (the
references of tests/python/test_objectives.py, which cites TRL's lines), to 1e-5 in fp32; the weights do not
move, and a step on the same batch reports the same loss. Inputs are step()'s, refused as step() refuses them."""
import copy

import pytest
import torch

import strider
from conftest import require_op_library  # noqa: E402
from test_objectives import (dpo_loss, frozen_logps, grpo_loss, orpo_loss, pair_batches, per_token_logps,
                             simpo_loss)
from test_package import BATCH, config, hf_batches, make_model

require_op_library()


def inputs(objective, data, model):
    """Each batch's step() keywords: DPO's reference sums (another model's, so that the log-ratios are not 0),
    GRPO's advantages, sampling and reference log-probabilities."""
    g = torch.Generator().manual_seed(11)
    if objective == "dpo":
        other = make_model(seed=3)
        return [dict(ref_logps=frozen_logps(other, b).sum(1)) for b in data]
    if objective == "grpo":
        out = []
        for b in data:
            base = frozen_logps(model, b)
            out.append(dict(advantages=torch.randn(BATCH, generator=g),
                            old_logps=base + 0.3 * torch.randn(base.shape, generator=g),
                            ref_logps=base + 0.1 * torch.randn(base.shape, generator=g)))
        return out
    return [{} for _ in data]


def reference_loss(objective, over, lp, valid, kw):
    if objective == "dpo":
        return dpo_loss(over.get("loss_type", "sigmoid"), over.get("beta", 0.1), 0.0, lp, valid, kw["ref_logps"])
    if objective == "simpo":
        return simpo_loss(over.get("beta", 0.1), 0.5, 0.0, lp, valid, None)
    if objective == "orpo":
        return orpo_loss(over.get("beta", 0.1), lp, valid, None)
    return grpo_loss("grpo", over["beta"], 0.2, 0.2, 0, lp, valid,
                     (kw["advantages"], kw["old_logps"], kw["ref_logps"]))


@pytest.mark.parametrize("objective, over", [("dpo", {}), ("dpo", {"loss_type": "ipo", "beta": 0.3}), ("simpo", {}),
                                             ("orpo", {"beta": 0.25}), ("grpo", {"loss_type": "grpo", "beta": 0.04})])
def test_evaluate_gives_the_objective_loss_and_figures_without_an_update(objective, over):
    model = make_model()
    reference = copy.deepcopy(model)
    vocab = model.config.vocab_size
    data = (hf_batches(vocab, 2) if objective == "grpo" else pair_batches(vocab))[:2]
    kws = inputs(objective, data, reference)
    engine = strider.Engine(model, config(objective=objective, **over))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for b, kw in zip(data, kws):
        loss = engine.evaluate(*b, **kw)
        with torch.no_grad():
            lp, valid = per_token_logps(reference, *b)
            want, metrics = reference_loss(objective, over, lp, valid, kw)
        want = float(want)
        assert abs(loss - want) <= 1e-5 * max(abs(want), 1e-3), (loss, want)
        assert set(engine.last_eval_metrics) == set(metrics)
        for k, v in metrics.items():
            assert abs(engine.last_eval_metrics[k] - v) <= 1e-5 * max(abs(v), 1.0), (k, engine.last_eval_metrics[k], v)
        losses.append(loss)
    engine.finish()
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())  # nothing moved
    assert engine._engine.steps_done() == 0
    step = engine.step(*data[0], **kws[0])
    assert abs(step.loss - losses[0]) <= 1e-6 * max(abs(losses[0]), 1e-3), (step.loss, losses[0])


def test_evaluate_refuses_what_step_refuses():
    model = make_model()
    data = pair_batches(model.config.vocab_size)
    dpo = strider.Engine(model, config(objective="dpo"))
    with pytest.raises(ValueError, match="ref_logps .* are needed"):
        dpo.evaluate(*data[0])
    dpo.finish()
    sft = strider.Engine(make_model(), config())
    with pytest.raises(ValueError, match="the engine's objective is sft"):
        sft.evaluate(*data[0], ref_logps=torch.zeros(BATCH))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_evaluates_with_its_load_balancing_loss(arch):
    """TRL adds router_aux_loss_coef x the forward's aux loss to DPO's (dpo_trainer.py 1530-1532); evaluate
    does as the step does: against transformers' forward to 1e-5, and the step's loss on the same batch."""
    from test_moe_vs_transformers import make_model as moe_model
    model = moe_model(arch)
    reference = copy.deepcopy(model)
    b = pair_batches(model.config.vocab_size)[0]
    ref = frozen_logps(moe_model(arch, seed=3), b).sum(1)
    engine = strider.Engine(model, config(objective="dpo", micro_batch=BATCH, accumulation=1, vocab_chunk=300))
    loss = engine.evaluate(*b, ref_logps=ref)
    ids, labels, mask = b
    with torch.no_grad():
        out = reference(input_ids=ids, attention_mask=mask, output_router_logits=True)
        target = labels[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        valid = target != -100
        lp = torch.log_softmax(out.logits.float()[:, :-1], -1).gather(-1, target.clamp(min=0).unsqueeze(-1))
        want, _ = dpo_loss("sigmoid", 0.1, 0.0, lp.squeeze(-1).masked_fill(~valid, 0.0), valid, ref)
        want = float(want + model.config.router_aux_loss_coef * out.aux_loss)
    assert abs(loss - want) <= 1e-5 * abs(want), (loss, want)
    step = engine.step(*b, ref_logps=ref)
    assert abs(step.loss - loss) <= 1e-6 * abs(loss), (step.loss, loss)
