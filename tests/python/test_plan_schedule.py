"""`strider plan --schedule`: the program one training step runs, for the
built-in model, for Llama-3.1-8B, and for a rank of data parallel; its shape
from the passes (docs/step-program.md)."""
import json
import subprocess

import pytest


@pytest.fixture
def strider(strider_binary):
    return strider_binary("strider")


def schedule(strider, *args):
    out = subprocess.run([str(strider), "plan", "--schedule", "--json", "--predict", "none", *args],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    plan = json.loads(out)
    assert plan["feasible"]
    return plan["schedule"]


def ops(program, name):
    return [i for i, o in enumerate(program) if o["op"] == name]


def test_builtin_model_schedule_has_every_pass(strider):
    prog = schedule(strider, "--gpu", "24MiB", "--seq", "128", "--accumulation", "2")
    pieces = {o["piece"] for o in prog if o["op"] == "land"}
    for name in ("land", "sum of squares", "adamw", "updated"):
        assert {o["piece"] for o in prog if o["op"] == name} == pieces, name
        assert len(ops(prog, name)) == len(pieces), name
    # Clipping is on by default: the norm gates every update, which run in forward order.
    (norm,) = ops(prog, "norm")
    assert prog[norm]["clip"] == 1.0
    adamw = ops(prog, "adamw")
    assert min(adamw) > norm
    assert [prog[i]["piece"] for i in adamw] == sorted(pieces)
    assert max(ops(prog, "land")) < norm
    # Every dependency points backwards; every load waits for its pieces' previous update.
    for i, o in enumerate(prog):
        assert all(a < i for a in o["after"] if a >= 0)
        if o["op"] == "load":
            assert o["after_previous_step"]
    # Each visit: a load, its operations, a release; forward and backward once per micro-batch.
    assert len(ops(prog, "load")) == len(ops(prog, "release"))
    assert {o["micro_batch"] for o in prog if o["op"] in ("forward", "backward")} == {0, 1}
    assert len(ops(prog, "grads out")) == len(pieces)


def test_no_clipping_updates_each_piece_as_it_lands(strider):
    prog = schedule(strider, "--gpu", "24MiB", "--seq", "128", "--clip", "0")
    (norm,) = ops(prog, "norm")
    assert "clip" not in prog[norm]
    assert norm == len(prog) - 1
    assert len(ops(prog, "check gradient")) == len(ops(prog, "land"))
    for land, adam in zip(ops(prog, "land"), ops(prog, "adamw")):
        assert land < adam


def test_llama_8b_with_nvme_reads_and_writes_its_state(strider, tmp_path):
    prog = schedule(strider, "--model", "llama-3.1-8b", "--gpu", "24GiB", "--ram", "64GiB", "--nvme", str(tmp_path / "elsewhere"),
                    "--seq", "1024", "--accumulation", "8")
    reads, writes = ops(prog, "read state"), ops(prog, "write state")
    assert reads and len(reads) == len(writes)
    adam_of = {prog[i]["piece"]: i for i in ops(prog, "adamw")}
    for r, w in zip(reads, writes):
        assert r < adam_of[prog[r]["piece"]] < w
    # With clipping, the gradients of NVMe-tier pieces wait for the norm on NVMe.
    (norm,) = ops(prog, "norm")
    assert ops(prog, "spill") and max(ops(prog, "spill")) < norm


def test_two_gpus_add_the_collectives(strider):
    prog = schedule(strider, "--model", "llama-3.1-8b", "--gpu", "24GiB", "--seq", "1024", "--accumulation", "8",
                    "--gpus", "2", "--link", "pcie4")
    lands = ops(prog, "land")
    assert len(ops(prog, "sum over ranks")) == len(lands)
    assert all(prog[i]["slice"] for i in ops(prog, "sum over ranks"))
    assert len(ops(prog, "gather")) == len(lands)
    text = subprocess.run([str(strider), "plan", "--schedule", "--predict", "none", "--model", "llama-3.1-8b",
                           "--gpu", "24GiB", "--gpus", "2"], capture_output=True, text=True, timeout=120,
                          check=True).stdout
    assert "program" in text and "of rank 0" in text and "sum over ranks" in text
