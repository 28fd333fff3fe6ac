"""Packed documents: rows that hold several documents, each attending only to itself.

transformers does this for packed position_ids (positions restarting at each
document, no attention mask, no cache): its masks become block-diagonal and
RoPE counts from each document's start. strider's EngineConfig.packed_documents
and Engine.step's positions do the same; here they are held to transformers +
torch.optim.AdamW to 1e-5 in fp32 (test_engine_vs_torch's setup), including a
soft-capped and sliding-window model and longrope's choice of factors per
micro-batch, and a document's loss is held to be independent of its neighbours.
"""

import pytest
import torch

from test_engine_vs_torch import (ACCUMULATION, BATCH, MICRO_BATCH, SEQ, STEPS, batches, load_into, make_model,
                                  new_engine, reference_run, rel_err, shifted)
from strider.torch_reference import packed_position_ids
from conftest import step_report  # noqa: E402

# Document lengths per row (SEQ = 17 tokens each). Micro-batch 0's documents
# stay within 8 positions (phi4_mini's original_max_position_embeddings: its
# short longrope factors), micro-batch 1's run past them (the long ones).
ROWS = [[6, 6, 5], [3, 8, 6], [12, 5], [1, 16]]


def positions(rows=ROWS):
    return packed_position_ids(rows)


def packed_batches(vocab):
    """test_engine_vs_torch's batches with a document's first token never predicted from the one before."""
    pos = positions()
    out = []
    for s, (ids, labels) in enumerate(batches(vocab)):
        p = pos.roll(s, 0)  # each step its rows in another order
        labels = labels.clone()
        labels[p == 0] = -100
        out.append((ids, labels, p))
    return out


@pytest.mark.parametrize("arch,chaos,devices", [
    ("llama", True, "2"), ("qwen3_tied", False, "1"), ("gemma2_tied", True, "2"), ("gemma3_tied", False, "1"),
    ("phi4_mini", True, "1")])
def test_packed_steps_track_transformers_and_adamw(arch, chaos, devices):
    model = make_model(arch)
    data = packed_batches(model.config.vocab_size)
    engine = new_engine(model, chaos=chaos, devices=devices, packed_documents=True)
    load_into(engine, model)
    reports = [step_report(engine.step(ids, shifted(labels), pos)) for ids, labels, pos in data]
    engine.finish()
    ref = reference_run(model, data)
    for s, (r, (ref_loss, ref_norm)) in enumerate(zip(reports, ref)):
        assert abs(r["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), f"step {s + 1} loss {r['loss']} vs {ref_loss}"
        assert abs(r["grad_norm"] - ref_norm) <= 1e-5 * ref_norm, f"step {s + 1} grad norm"
    for name, p in model.named_parameters():
        assert rel_err(engine.param(name), p.detach()) <= 1e-5, f"{name} after {STEPS} steps"


def test_a_documents_loss_does_not_depend_on_its_neighbours():
    """Document A (8 tokens) after B (5 tokens) and before D, or after C (9 tokens): the loss over A's
    targets alone is the same to 1e-6, and equal to A alone at the start of a row."""
    model = make_model("gemma2_tied")  # a sliding window (8) and soft-capped attention too
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    a, b, c, d = (torch.randint(0, vocab, (n,), generator=g) for n in (8, 5, 9, 4))
    layouts = [([b, a, d], 5), ([c, a], 9), ([a, torch.randint(0, vocab, (9,), generator=g)], 0)]  # (docs, A's start)
    engine = new_engine(model, packed_documents=True)
    load_into(engine, model)
    losses = []
    for docs, start in layouts:
        ids = torch.cat(docs).repeat(BATCH, 1)
        pos = torch.cat([torch.arange(len(x)) for x in docs]).repeat(BATCH, 1)
        labels = torch.full_like(ids, -100)
        labels[:, start + 1:start + len(a)] = ids[:, start + 1:start + len(a)]  # A's targets only
        losses.append(engine.evaluate(ids, shifted(labels), pos))
    assert losses[1] == pytest.approx(losses[0], rel=1e-6, abs=0)
    assert losses[2] == pytest.approx(losses[0], rel=1e-6, abs=0)
    # Without the documents (one sequence per row) A's loss does depend on B.
    ids = torch.cat(layouts[0][0]).repeat(BATCH, 1)
    labels = torch.full_like(ids, -100)
    labels[:, 6:13] = ids[:, 6:13]
    assert abs(engine.evaluate(ids, shifted(labels), None) - losses[0]) > 1e-3


def test_plain_positions_change_nothing_and_packed_need_the_config():
    model = make_model("llama")
    ids, labels = batches(model.config.vocab_size)[0]
    plain = torch.arange(SEQ).repeat(BATCH, 1)
    finals = []
    for packed, pos in [(False, None), (False, plain), (True, plain)]:
        engine = new_engine(model, packed_documents=packed)
        load_into(engine, model)
        loss = step_report(engine.step(ids, shifted(labels), pos))["loss"]
        finals.append((loss, {n: engine.param(n) for n in engine.param_names()}))
    for loss, params in finals[1:]:
        assert loss == finals[0][0]
        assert all(torch.equal(p, finals[0][1][n]) for n, p in params.items())

    engine = new_engine(model)
    load_into(engine, model)
    with pytest.raises(ValueError, match="packed_documents"):  # refused before any work: the engine goes on
        engine.step(ids, shifted(labels), positions())
    bad = positions()
    bad[1, 3] = SEQ
    engine = new_engine(model, packed_documents=True)
    load_into(engine, model)
    with pytest.raises(ValueError, match=f"position {SEQ} at token {SEQ + 3} of the batch is outside"):
        engine.step(ids, shifted(labels), bad)
    assert engine.steps_done() == 0
    engine.step(ids, shifted(labels), positions())
    assert engine.steps_done() == 1


def test_strider_engine_takes_position_ids_as_transformers_does():
    """strider.Engine (the model in place) with a batch shorter than seq and fewer rows: position_ids
    padded as the ids are, and the loss transformers computes for the same packed rows."""
    import strider
    model = make_model("qwen3_tied")
    ids, labels, pos = packed_batches(model.config.vocab_size)[0]
    ids, labels, pos = ids[:3, :13], labels[:3, :13], pos[:3, :13]
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False).loss.item()
    engine = strider.Engine(model, strider.EngineConfig(seq=SEQ, micro_batch=MICRO_BATCH, accumulation=ACCUMULATION,
                                                        dtype="fp32", packed_documents=True, device="cpu"))
    assert engine.evaluate(ids, labels, position_ids=pos) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="position_ids must be integers of input_ids' shape"):
        engine.evaluate(ids, labels, position_ids=pos[:, :5])
