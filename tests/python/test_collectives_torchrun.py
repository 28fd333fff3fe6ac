"""engine/run/collectives under torchrun: ranks from the environment torchrun sets, joining its
agent's store, Gloo between processes (tests/engine/collectives_probe.cpp is the C++ side).

The probe's values: rank r contributes [1e16, 1.0, -1e16, 0.25][r % 4] and 0.1 * (r + 1) to a
sum, and (r + 1) * 100 + i at index i of a reduce-scatter of 3 floats per rank.
"""
import json
import os
import subprocess
import sys

import pytest


def torchrun(probe, n, *args, monitor_s=None, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
    if monitor_s is not None:
        cmd += ["--monitor-interval", str(monitor_s)]
    cmd += ["--no-python", str(probe), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    if "this build has none" in r.stdout + r.stderr:
        pytest.skip("this build has no c10d Gloo (no gloo headers: scripts/setup.sh installs libgloo-dev)")
    return r


def lines(out):
    return sorted((json.loads(l) for l in out.splitlines() if l.startswith("{")), key=lambda j: j["rank"])


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_from_torchrun_sum_in_rank_order_and_get_their_slices(strider_binary, n):
    r = torchrun(strider_binary("collectives_probe"), n)
    assert r.returncode == 0, r.stderr[-3000:]
    got = lines(r.stdout)
    assert [j["rank"] for j in got] == list(range(n))
    vals = [1e16, 1.0, -1e16, 0.25]
    expect = [0.0, 0.0]
    for k in range(n):  # the rank-order sum, in doubles as the probe adds them
        expect[0] += vals[k % 4]
        expect[1] += 0.1 * (k + 1)
    for j in got:
        assert (j["world"], j["local_world"], j["local_rank"]) == (n, n, j["rank"])
        assert j["sum"] == expect  # bit-identical on every rank (JSON round-trips doubles exactly)
        assert j["slice"] == [sum((k + 1) * 100 + 3 * j["rank"] + i for k in range(n)) for i in range(3)]
        assert j["any"] is True  # rank 0 said yes


def test_a_killed_rank_is_named_by_the_survivor(strider_binary):
    # The last rank SIGKILLs itself before the second collective. torchrun's own monitor would
    # stop the survivor within 0.1 s (and name the dead rank itself); at 5 s the survivor's
    # collective fails first (its peer's socket closes) and names rank 1.
    r = torchrun(strider_binary("collectives_probe"), 2, "--leave-at", "2", "--timeout-ms", "20000", monitor_s=5)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "rank 0 of 2: reduce_scatter_sum (collective #2 on channel main, timeout 20000 ms) failed" in out, out[-3000:]
    assert "Never reached it: rank 1 (at #1)" in out


def test_a_torchrun_environment_without_its_rank_is_refused(strider_binary):
    probe = strider_binary("collectives_probe")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")} | {"WORLD_SIZE": "2"}
    r = subprocess.run([str(probe)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1
    assert "WORLD_SIZE=2 but RANK is not set: launch the ranks with torchrun" in r.stderr
    r = subprocess.run([str(probe)], capture_output=True, text=True, timeout=60, env=env | {"RANK": "x1"})
    assert "environment variable RANK='x1' is not a non-negative integer" in r.stderr
