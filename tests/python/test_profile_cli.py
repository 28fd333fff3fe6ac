"""`strider profile` on the built-in model: the figures it prints are coherent
(fractions of the step, a real lane, FLOP/s that count recompute), the trace
holds the measured steps, and the PNG is a PNG when matplotlib is there."""
import json
import subprocess

import pytest

LANES = {"compute", "h2d", "d2h", "optimizer", "nvme read", "nvme write", "collective", "hand-off"}


@pytest.fixture
def strider(strider_binary):
    return strider_binary("strider")


def profile(strider, tmp_path, *args, steps=2):
    cmd = [str(strider), "profile", "--device", "cpu", "--seq", "32", "--micro-batch", "2", "--accumulation", "2",
           "--skip-steps", "1", "--steps", str(steps), "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "prof"),
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def test_profile_json_figures_trace_and_png(strider, tmp_path):
    r = profile(strider, tmp_path, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # --json: stdout is one JSON object, the rest went to stderr
    assert "strider profile:" in r.stderr and "critical lane:" in r.stderr

    assert out["steps"] == 2 and [s["step"] for s in out["per_step"]] == [2, 3]
    assert out["step_s"] > 0 and out["tokens_per_step"] == 2 * 2 * 32
    assert out["tokens_per_s"] == pytest.approx(out["tokens_per_step"] / out["step_s"])
    assert set(out["lanes"]) == LANES
    for lane, f in out["lanes"].items():
        assert 0.0 <= f["busy_fraction"] <= 1.0, lane
        assert f["busy_s"] <= out["step_s"] * (1 + 1e-9), lane
    assert out["lanes"]["compute"]["busy_s"] > 0 and out["lanes"]["h2d"]["busy_s"] > 0
    assert out["critical_lane"] in LANES
    busiest = max(out["lanes"].values(), key=lambda f: f["busy_s"])
    assert out["lanes"][out["critical_lane"]] == busiest
    assert 0.0 < out["overlap_efficiency"] <= 1.0
    assert out["overlap_efficiency"] == pytest.approx(busiest["busy_fraction"])

    # 6·N·tokens from the model's parameter count; the executed figure counts
    # the recompute on top of forward + backward, so with every layer
    # recomputing it is larger. (Layers that keep their activations and kept
    # logits recompute little, and the embedding's lookup, which 6·N·tokens
    # counts as a matmul, computes nothing: then it may be smaller.)
    assert out["six_n_t_flops_per_step"] == pytest.approx(6 * out["params"] * out["tokens_per_step"])
    assert out["model_flops_per_s"] == pytest.approx(out["six_n_t_flops_per_step"] / out["step_s"])
    assert out["model_flops_per_s"] > 0
    assert out["executed_flops_per_s"] > 0
    if out["saved_layers"] == 0:
        assert out["executed_flops_per_s"] > out["model_flops_per_s"]

    # The bytes each step moved: every parameter goes in twice in bf16 (forward, backward) but the head's
    # (once: the built-in vocabulary is one shard), so under 4 bytes a parameter but well over 2; each comes
    # out once as a bf16 gradient (2 bytes, summed in fp32 on the device first; a little more with the
    # layout's padding). Kept activations (if the plan keeps them) cross on top, as many bytes each way,
    # and are reported apart. ATen needed working memory in every step.
    for s in out["per_step"]:
        assert s["h2d_bytes_per_param"] == pytest.approx(s["h2d_bytes"] / out["params"])
        kept = s["activations"]
        assert kept["h2d_bytes"] == kept["d2h_bytes"]
        assert (kept["h2d_bytes"] > 0) == (out["saved_layers"] > 0)
        assert 2.5 < (s["h2d_bytes"] - kept["h2d_bytes"]) / out["params"] < 4.0
        assert 2.0 <= (s["d2h_bytes"] - kept["d2h_bytes"]) / out["params"] < 2.1
        assert s["work_peak_bytes"] > 0
    assert out["work_peak_bytes"] == max(s["work_peak_bytes"] for s in out["per_step"])
    assert "ATen working memory" in r.stderr and "B/param" in r.stderr

    trace = json.loads((tmp_path / "prof" / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["step"] for e in spans} >= {1, 2, 3}
    names = {e["name"].split(" b")[0] for e in spans}
    assert {"forward", "adamw"} <= names
    assert "recompute+backward" in names or {"backward", "d2h activations", "h2d activations"} <= names

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert out["png"] is None and "matplotlib" in out["png_error"]
        return
    png = tmp_path / "prof" / "step3.png"
    assert out["png"] == str(png) and out["png_step"] == 3
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_missing_python_still_writes_the_trace_and_says_what_to_run(strider, tmp_path):
    r = profile(strider, tmp_path, "--python", str(tmp_path / "no-such-python"), steps=1)
    assert r.returncode == 0, r.stderr
    assert "no png:" in r.stdout and "no-such-python" in r.stdout
    assert "profile_plot.py" in r.stdout and "--step 2" in r.stdout  # the command to run instead
    assert "overlap efficiency:" in r.stdout and "executed FLOP/s" in r.stdout
    assert (tmp_path / "prof" / "trace.json").stat().st_size > 0
    assert not list((tmp_path / "prof").glob("*.png"))
