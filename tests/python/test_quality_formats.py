"""bench/quality_formats.py's verdicts and README block on synthetic loss curves whose figures are computed by hand.

Every curve is flat (each of its 60 steps the same loss) except where a test says,
so the final loss and the mean of the last 50 are the same number:
  fp32 seeds 1, 2, 3: 4.0, 4.2, 4.4    band 4.0..4.4, mean of seeds 1..3 = 4.2
  band widened by 1% of that mean:     4.158 ..4.442 -> the band itself is wider: 4.0..4.4
"""
import importlib.util
import json
import pathlib
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def qf():
    if str(REPO_ROOT / "bench") not in sys.path:  # as when it runs as a script: its neighbours import
        sys.path.insert(0, str(REPO_ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("quality_formats", REPO_ROOT / "bench" / "quality_formats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def flat(x, n=60):
    return [x] * n


FP32 = {"strider fp32 seed 1": flat(4.0), "strider fp32 seed 2": flat(4.2), "strider fp32 seed 3": flat(4.4)}


def test_mean_over_seeds_decides_and_each_run_is_reported(qf):
    # q8's seed 1 (4.5) is outside the band alone; its mean (4.5 + 4.1 + 4.3) / 3 = 4.3 is inside.
    runs = FP32 | {"strider q8 seed 1": flat(4.5), "strider q8 seed 2": flat(4.1), "strider q8 seed 3": flat(4.3)}
    v = qf.verdicts(runs)
    assert v["band"]["final"] == (4.0, 4.4)
    m = v["methods"]["strider q8"]
    assert m["seeds"] == [1, 2, 3]
    assert m["final"] == pytest.approx(4.3) and m["passes"]
    assert m["vs_fp32"]["final"] == pytest.approx(4.3 / 4.2 - 1)
    assert m["runs"][1]["inside"] == {"final": False, "last50": False}
    assert m["runs"][1]["vs_fp32_same_seed"]["final"] == pytest.approx(4.5 / 4.0 - 1)
    assert m["runs"][2]["inside"]["final"] and m["runs"][2]["vs_fp32_same_seed"]["final"] == pytest.approx(4.1 / 4.2 - 1)


def test_one_percent_of_the_fp32_mean_when_wider_than_the_band(qf):
    # fp32 seeds 1 and 2 only: 4.0 and 4.02 -> band 4.0..4.02; 1% of the mean 4.01 -> 3.9699..4.0501.
    runs = {"strider fp32 seed 1": flat(4.0), "strider fp32 seed 2": flat(4.02),
            "torch AdamW seed 1": flat(4.04), "torch AdamW seed 2": flat(4.05),       # mean 4.045: inside
            "bitsandbytes AdamW8bit seed 1": flat(4.06), "bitsandbytes AdamW8bit seed 2": flat(4.05)}  # 4.055: out
    v = qf.verdicts(runs)
    assert v["methods"]["torch AdamW"]["passes"]
    assert not v["methods"]["bitsandbytes AdamW8bit"]["passes"]


def test_final_and_last50_judged_apart(qf):
    # q8 ends at fp32's losses but its last 50 steps sit at 5.0: the final is inside, the last-50 mean is not.
    q8 = lambda end: flat(5.0, 59) + [end]  # last 50: 49 x 5.0 + end
    runs = FP32 | {"strider q8 seed 1": q8(4.0), "strider q8 seed 2": q8(4.2), "strider q8 seed 3": q8(4.4)}
    m = qf.verdicts(runs)["methods"]["strider q8"]
    assert m["inside"] == {"final": True, "last50": False} and not m["passes"]
    assert qf.line_text(m["inside"]) == "final inside, last 50 **outside**"


def test_a_method_seed_without_its_fp32_run_is_refused(qf):
    runs = {"strider fp32 seed 1": flat(4.0), "strider q8 seed 1": flat(4.0), "strider q8 seed 2": flat(4.0)}
    with pytest.raises(SystemExit, match="fp32 ran only"):
        qf.verdicts(runs)


def test_readme_block_reads_its_json_back(qf):
    runs = FP32 | {"strider q8 seed 1": flat(4.5), "strider q8 seed 2": flat(4.1), "strider q8 seed 3": flat(4.3)}
    result = {"steps": 60, "seeds": 3, "format_seeds": 3,
              "hf": {"runs": runs, "verdicts": qf.verdicts(runs), "peers": {"bitsandbytes": "0.50.2"},
                     "model": {"num_hidden_layers": 4, "hidden_size": 128}}}
    for r in (result, json.loads(json.dumps(result))):  # as run, and as --render-from reads it
        block = qf.readme_block(r, ["--out", "/tmp/q"])
        assert "| strider q8 seed 1 | 4.5000 | 4.5000 | +12.50% / +12.50% | (this run alone: final **outside**" in block
        assert "| **strider q8, mean of seeds 1, 2, 3** | **4.3000** | **4.3000** | +2.38% / +2.38% | **inside** |" \
            in block
        assert "fp32's band: final 4.0000..4.4000" in block
        assert "bitsandbytes 0.50.2" in block


def test_format_seeds_beyond_the_fp32_seeds_is_refused(qf, tmp_path):
    with pytest.raises(SystemExit, match="between 1 and --seeds"):
        qf.main(["--out", str(tmp_path), "--seeds", "2", "--format-seeds", "3"])


def test_a_loss_below_the_line_is_named_lower(qf):
    runs = FP32 | {"strider q8 seed 1": flat(3.5), "strider q8 seed 2": flat(3.5), "strider q8 seed 3": flat(4.6)}
    m = qf.verdicts(runs)["methods"]["strider q8"]  # mean 3.8667 < 4.0
    assert not m["passes"] and m["below"]["final"]
    assert qf.line_text(m["inside"], m["below"]) == "final outside (lower), last 50 outside (lower)"
    assert qf.line_text(m["runs"][3]["inside"], m["runs"][3]["below"]) == "final **outside**, last 50 **outside**"
