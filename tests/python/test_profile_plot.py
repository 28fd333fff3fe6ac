"""bench/profile_plot.py on a synthetic trace whose figures are computed by hand.

Step 2's window is the first..last span tagged step 2 on compute/h2d/d2h:
[900, 5100] us = 4200 us. Inside it:
  compute  [1000,3000] + [3000,5000] (+ [1500,2000] inside them: counted once) = 4000 us
  h2d      [900,1200] and [1100,1500] overlap: union [900,1500]               =  600 us
  d2h      [4000,5100]                                                         = 1100 us
  optimizer step 1's adamw [800,1700] clipped to [900,1700]                    =  800 us
            (step 2's adamw [5200,6000] lies after the window)
  nvme read step 1's [850,1000] clipped to [900,1000]                          =  100 us
Spans outside the window (step 1 compute [0,800], step 3 compute [5300,7000])
count nowhere. FLOPs: 4e9 + 8e9 over 4.2 ms.
"""
import json
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "bench" / "profile_plot.py"
WINDOW_US = 4200.0


def x(lane, name, b, e, step, block=-1, flops=None):
    args = {"step": step, "block": block, "micro_batch": -1}
    if flops:
        args["flops"] = flops
    return {"name": name, "ph": "X", "pid": 1, "tid": lane, "ts": b, "dur": e - b, "args": args}


def write_trace(path):
    names = ["compute", "h2d", "d2h", "optimizer", "nvme read", "nvme write"]
    ev = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": n}} for i, n in enumerate(names)]
    ev += [
        x(0, "forward b0", 0, 800, 1, 0, 1e9),
        x(0, "forward b0", 1000, 3000, 2, 0, 4e9),
        x(0, "zero grads b1", 1500, 2000, 2, 1),
        x(0, "recompute+backward b0", 3000, 5000, 2, 0, 8e9),
        x(0, "forward b0", 5300, 7000, 3, 0, 4e9),
        x(1, "h2d batch", 900, 1200, 2),
        x(1, "h2d b0", 1100, 1500, 2, 0),
        x(2, "d2h grads b0", 4000, 5100, 2, 0),
        x(3, "adamw b0", 800, 1700, 1, 0),
        x(3, "adamw b0", 5200, 6000, 2, 0),
        x(4, "nvme read state b0", 850, 1000, 1, 0),
    ]
    path.write_text(json.dumps({"traceEvents": ev, "displayTimeUnit": "ms"}))


def run(args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def trace(tmp_path):
    p = tmp_path / "trace.json"
    write_trace(p)
    return p


def test_figures_match_hand_computed(trace):
    r = run([str(trace), "--step", "2", "--params", "1e6", "--tokens", "100"])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["step_s"] == pytest.approx(WINDOW_US * 1e-6)
    expect_us = {"compute": 4000, "h2d": 600, "d2h": 1100, "optimizer": 800, "nvme read": 100, "nvme write": 0}
    for lane, us in expect_us.items():
        assert summary["lanes"][lane]["busy_s"] == pytest.approx(us * 1e-6, abs=1e-12), lane
        assert summary["lanes"][lane]["busy_fraction"] == pytest.approx(us / WINDOW_US), lane
    assert summary["critical"] == "compute"
    assert summary["overlap_efficiency"] == pytest.approx(4000 / WINDOW_US)
    assert summary["model_flops_per_s"] == pytest.approx(12e9 / (WINDOW_US * 1e-6))
    assert summary["six_n_t_flops_per_s"] == pytest.approx(6 * 1e6 * 100 / (WINDOW_US * 1e-6))
    # The human-readable lines carry the same figures.
    assert "step 2: window 4.200 ms" in out
    assert "h2d        busy     0.600 ms   14.3%" in out
    assert "compute    busy     4.000 ms   95.2%" in out
    assert "critical lane: compute" in out
    assert "overlap efficiency: 0.952" in out
    assert "2857.143 GFLOP/s (12.000 GFLOP)" in out


def test_metrics_lines_are_shown_beside(trace, tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"step": 1, "step_s": 1.0, "overlap_efficiency": 0.1, "lanes": {}}) + "\n" +
                 json.dumps({"step": 2, "step_s": 0.0045, "overlap_efficiency": 0.9,
                             "lanes": {"compute": 0.9, "h2d": 0.125}}) + "\n")
    r = run([str(trace), "--step", "2", "--metrics", str(m)])
    assert r.returncode == 0, r.stderr
    assert "(engine  12.5%)" in r.stdout
    assert "engine: step_s 4.500 ms, overlap efficiency 0.900" in r.stdout


def test_unknown_step_says_which_exist(trace):
    r = run([str(trace), "--step", "9"])
    assert r.returncode != 0
    assert "args.step == 9" in r.stderr and "[1, 2, 3]" in r.stderr


def test_png_is_written(trace, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install -r requirements.txt")
    png = tmp_path / "step.png"
    r = run([str(trace), "--step", "2", "--out", str(png)])
    assert r.returncode == 0, r.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
