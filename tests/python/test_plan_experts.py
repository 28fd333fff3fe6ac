"""`strider plan` on a mixture of experts chooses its expert pieces by the
predicted speed (engine/plan/plan_speed.cpp): every size it tried is in the JSON
with its tokens/s, the one chosen is the fastest under the 1% rule, and the
plan's own prediction is the chosen size's. The rule on given speeds is
tests/engine/test_plan_moe.cpp's."""
import json
import subprocess

import pytest


@pytest.fixture
def strider(strider_binary):
    return strider_binary("strider")


def plan(strider, tmp_path, *args):
    # A folder that is not here: the plan is for a machine with the room, whatever this one's disk holds.
    out = subprocess.run([str(strider), "plan", "--json", "--model", "mixtral-8x7b", "--gpu", "24GiB", "--seq",
                          "1024", "--accumulation", "32", "--optimizer-state", "q8", "--nvme", str(tmp_path / "elsewhere"),
                          *args],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    p = json.loads(out)
    assert p["feasible"]
    return p


def test_the_plan_takes_the_fastest_expert_pieces_it_predicted(strider, tmp_path):
    p = plan(strider, tmp_path, "--ram", "128GiB", "--predict", "rtx4090")
    tried = {t["expert_pieces"]: t["tokens_per_s"] for t in p["expert_pieces_tried"]}
    assert list(tried) == [0, 4, 1]  # whole layers, then pieces of 4 and 1 of Mixtral's 8 experts
    best = 0
    for n, speed in tried.items():  # a smaller piece wins only where >= 1% faster
        if speed >= tried[best] * 1.01:
            best = n
    assert p["expert_pieces"] == best
    assert p["tokens_per_s"] == pytest.approx(tried[best], rel=1e-9)
    line = next(w for w in p["why"] if w.startswith("expert pieces:"))
    print(line)
    if best != 0:
        assert f"strider finetune: --expert-pieces {best}" in line


def test_a_named_size_or_no_prediction_tries_nothing(strider, tmp_path):
    named = plan(strider, tmp_path, "--ram", "128GiB", "--predict", "rtx4090", "--expert-pieces", "4")
    assert named["expert_pieces"] == 4 and named["expert_pieces_tried"] == []
    unpredicted = plan(strider, tmp_path, "--ram", "128GiB", "--predict", "none")
    assert unpredicted["expert_pieces"] == 0 and unpredicted["expert_pieces_tried"] == []
