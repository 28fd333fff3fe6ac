"""A step that fails part way (a device, an NVMe read, an update) ends that Engine's work, not the run's.
save() still writes the last whole state: the step before, when no update of the failed step was applied
(with clipping every update waits for the whole gradient), which a new Engine loads and trains on to the same
bits as a run that never failed. A state that is not whole (an update failed after others were applied) is
refused by save(), saying why, and nothing is written; the earlier checkpoint stays. It used to refuse every
call after the failure, save() included ("this Engine failed earlier; its state is unknown")."""
import os

import pytest
import torch

import strider
from test_package import config, hf_batches, make_model

VOCAB = 500


def params(engine):
    engine.finish()
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


# The device fault as a failed launch or copy raises it (Engine.inject_device_fault): in the forward, in
# the head's backward (block 3: after the 2 layers), in a layer's backward and as its gradients go out.
@pytest.mark.parametrize("op, block, chaos", [("forward", 1, False), ("head backward", 3, True), ("backward", 1, True),
                                              ("grads out", 2, False)])
def test_a_step_that_fails_part_way_leaves_the_last_whole_state_to_save(tmp_path, op, block, chaos):
    batches = hf_batches(VOCAB, 4)
    engine = strider.Engine(make_model(), config(chaos=chaos))
    for b in batches[:2]:
        engine.step(*b)
    engine._engine.inject_device_fault(op, block)
    with pytest.raises(RuntimeError, match=rf"(?s)injected device fault: {op} of block {block}.*"
                                           r"save\(\) still writes the state of step 2"):
        engine.step(*batches[2])
    for call in (lambda: engine.step(*batches[2]), lambda: engine.evaluate(*batches[2]),
                 lambda: engine.load(tmp_path / "none")):
        with pytest.raises(RuntimeError, match=r"(?s)failed earlier \(step: injected device fault.*"
                                               r"save\(\) still writes the state of step 2"):
            call()
    engine.save(tmp_path / "ckpt", extra={"batches": 2})

    # The saved state is step 2's: a new Engine goes on from it to the bits of a run that never failed.
    resumed = strider.Engine(make_model(seed=7), config())
    assert resumed.load(tmp_path / "ckpt") == {"batches": 2}
    losses = [resumed.step(*b).loss for b in batches[2:]]
    whole = strider.Engine(make_model(), config())
    expected = [whole.step(*b).loss for b in batches][2:]
    assert losses == expected
    got, want = params(resumed), params(whole)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_state_an_update_left_half_written_is_not_saved(tmp_path):
    """Block 2's optimizer state on NVMe, torn on disk after step 1: step 2's updates (after the norm, in
    forward order) apply blocks 0 and 1, then fail reading block 2's. The model is then neither step 1's nor
    step 2's: save() refuses, saying so, and writes nothing; the checkpoint of step 1 stays and loads."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    batches = hf_batches(VOCAB, 3)
    engine = strider.Engine(make_model(), config(nvme_dir=str(nvme), nvme_blocks=[2]))
    engine.step(*batches[0])
    engine.save(tmp_path / "ckpt")
    torn = 0
    for f in nvme.rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            with open(f, "r+b") as out:
                out.write(b"\xa5" * f.stat().st_size)
                out.flush()
                os.fsync(out.fileno())  # what the engine reads with O_DIRECT
            torn += 1
    assert torn > 0
    with pytest.raises(RuntimeError, match=r"(?s)checksum mismatch.*its state is not whole \(an update failed"):
        for b in batches[1:]:  # the update's failure is found by step 2's end, or by step 3
            engine.step(*b)
    with pytest.raises(RuntimeError, match=r"(?s)failed earlier.*cannot be saved: make a new Engine from the last"):
        engine.save(tmp_path / "new")
    assert not (tmp_path / "new").exists()
    fresh = strider.Engine(make_model(seed=3), config())
    fresh.load(tmp_path / "ckpt")
    assert fresh._engine.steps_done() == 1
