"""A batch strider.Engine refuses is the caller's to fix, not the end of the engine: a position outside
[0, seq), positions that restart while packed_documents is off, a token id outside the vocabulary, each a
ValueError naming what is wrong, after which the engine steps, evaluates and saves as if the refused call had
never been made. It used to raise RuntimeError and refuse every later call ("this Engine failed earlier")."""
import pytest
import torch

import strider
from test_package import SEQ, config, hf_batches, make_model


def test_a_refused_batch_leaves_the_engine_usable(tmp_path):
    batches = hf_batches(500, 3)
    engine = strider.Engine(make_model(), config())
    engine.step(*batches[0])
    ids, labels, mask = batches[1]
    positions = torch.arange(SEQ).repeat(ids.shape[0], 1)
    with pytest.raises(ValueError, match=r"position_ids must lie in \[0, seq"):
        engine.step(ids, labels, mask, position_ids=positions + 1)
    with pytest.raises(ValueError, match=r"position_ids must lie in \[0, seq"):
        engine.evaluate(ids, labels, mask, position_ids=positions - 1)
    restart = positions.clone()
    restart[:, SEQ // 2:] -= SEQ // 2  # two documents a row, but the engine was made without packed_documents
    with pytest.raises(ValueError, match="packs several documents in a row"):
        engine.evaluate(ids, labels, mask, position_ids=restart)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 500\)"):
        engine.step(torch.full_like(ids, 10_000), labels, mask)
    # The engine goes on: the same losses as an engine never given the refused batches.
    losses = [engine.step(*b).loss for b in batches[1:]]
    engine.save(tmp_path / "ckpt", write_model=False)
    engine.finish()
    other = strider.Engine(make_model(), config())
    expected = [other.step(*b).loss for b in batches][1:]
    other.finish()
    assert losses == expected
