"""Shared pytest fixtures: where the C++ build outputs are.

Tests that drive a C++ binary ask for `strider_binary("name")`; the test is
skipped, with the reason, when the build directory or the binary is absent.
The build directory is $STRIDER_BUILD_DIR, else <repo>/build.

Under scripts/test.sh (STRIDER_STRICT_SKIPS=1) a skip fails the run unless
its reason is on ALLOWED_SKIPS below: a build that lost its op library, a
binary or a dependency must not pass by skipping the tests that need it.
"""
import functools
import json
import os
import pathlib
import re
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# The `strider` Python package is tested from the source tree, not from a pip install.
if str(REPO_ROOT / "python_shim") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "python_shim"))


def build_dir_path() -> pathlib.Path:
    return pathlib.Path(os.environ.get("STRIDER_BUILD_DIR", REPO_ROOT / "build")).resolve()


def find_binary(name: str, build_dir: pathlib.Path):
    """The executable `name` in the build tree, or None. Looks where CMake puts
    our targets first (the top, then one and two folders down), skipping
    CMakeFiles, so a big tree is not walked."""
    candidates = [build_dir / name]
    if build_dir.is_dir():
        for sub in sorted(build_dir.iterdir()):
            if sub.is_dir() and sub.name != "CMakeFiles":
                candidates.append(sub / name)
                candidates.extend(sorted(p / name for p in sub.iterdir()
                                         if p.is_dir() and p.name != "CMakeFiles"))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    return None


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def build_dir() -> pathlib.Path:
    d = build_dir_path()
    if not d.is_dir():
        pytest.skip(f"build directory {d} does not exist: build strider, or set STRIDER_BUILD_DIR")
    return d


@pytest.fixture(scope="session")
def strider_binary(build_dir):
    """strider_binary("st_tool") -> path of that executable, or skip."""
    def get(name: str) -> pathlib.Path:
        path = find_binary(name, build_dir)
        if path is None:
            pytest.skip(f"{name} is not built in {build_dir} (cmake --build {build_dir} "
                        f"--target {name}, or set STRIDER_BUILD_DIR)")
        return path
    return get


def step_report(parts):
    """torch.classes.strider.Engine.step's typed report (numbers, texts, each lane's busy fraction) as one
    dict, for the tests that drive the raw binding."""
    numbers, texts, busy = parts
    return {**numbers, **texts, "busy_fraction": dict(busy)}


_RANK_PREAMBLE = """
import sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[2]]
torch.set_num_threads(1)  # a GEMM split over more threads rounds differently
import torch.distributed as dist
rank, world, store, out = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
if world > 1:
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
"""
_RANK_POSTAMBLE = """
if world > 1:
    dist.barrier()
    dist.destroy_process_group()
"""


def launch_python_ranks(body, world, out_prefix):
    """Runs `body` (Python source) in `world` processes of one torch.distributed group (Gloo, a file://
    rendezvous; one ATen thread each), with python_shim/ and this folder on sys.path and `rank`, `world` and
    `out` (out_prefix) defined; every process must exit 0. Returns each rank's stdout."""
    import subprocess
    import textwrap
    import strider
    here = os.path.dirname(os.path.abspath(__file__))
    shim = os.path.dirname(strider.__path__[0])
    code = _RANK_PREAMBLE + textwrap.dedent(body) + _RANK_POSTAMBLE
    procs = [subprocess.Popen([sys.executable, "-c", code, shim, here, str(rank), str(world),
                               str(out_prefix) + "-store", str(out_prefix)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [out for out, _ in outs]


def require_op_library():
    """Loads libstrider_ops.so for a module whose every test needs it, or skips the whole module with the
    loader's message (every path it tried), which pytest_terminal_summary names and STRIDER_STRICT_SKIPS=1
    (scripts/test.sh) fails: a build without the op library cannot pass by skipping."""
    from strider import _library
    try:
        _library.load_library()
    except ImportError as e:
        pytest.skip(str(e), allow_module_level=True)


# The reasons a test may skip under scripts/test.sh, each with why it is not
# a hole: the machine lacks something no build can supply. A Gloo skip is
# allowed only in a build without gloo headers (BUILD/strider_features.json).
ALLOWED_SKIPS = [
    # A GPU machine runs these through gpu_check/gpu_check.sh instead.
    (re.compile(r"GPU"), None),
    # Mounting a tmpfs (a full-disk test) needs privileges a container may lack.
    (re.compile(r"cannot mount a tmpfs"), None),
    # Without /dev/shm the ranks keep a compute copy each; the shared one cannot be measured.
    (re.compile(r"no /dev/shm"), None),
    (re.compile(r"this build has no c10d Gloo"), "gloo"),
]

_skips = []


def _skip_reason(report):
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@functools.lru_cache(maxsize=1)
def _build_features():
    path = build_dir_path() / "strider_features.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _allowed(reason):
    features = _build_features()
    for pattern, feature in ALLOWED_SKIPS:
        if pattern.search(reason):
            return feature is None or features.get(feature) is False
    return False


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skips.append((report.nodeid, _skip_reason(report)))


def pytest_collectreport(report):
    if report.skipped:
        _skips.append((report.nodeid, _skip_reason(report)))


def _unallowed_skips():
    return [(node, reason) for node, reason in _skips if not _allowed(reason)]


def pytest_terminal_summary(terminalreporter):
    """Outside scripts/test.sh a skip not on ALLOWED_SKIPS passes the run, but
    is named at the end of it, never in silence (a whole module skips when,
    say, the op library is not built)."""
    if os.environ.get("STRIDER_STRICT_SKIPS") == "1":
        return  # pytest_sessionfinish fails the run and names them
    bad = _unallowed_skips()
    if bad:
        terminalreporter.write_sep("=", f"{len(bad)} skipped for a reason not on ALLOWED_SKIPS "
                                        f"(STRIDER_STRICT_SKIPS=1, as scripts/test.sh sets, fails them)",
                                   yellow=True)
        for node, reason in bad:
            terminalreporter.write_line(f"  {node}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("STRIDER_STRICT_SKIPS") != "1":
        return
    bad = _unallowed_skips()
    if not bad:
        return
    lines = [f"conftest: {len(bad)} tests skipped for a reason not on ALLOWED_SKIPS "
             f"(tests/python/conftest.py), so the run fails:"]
    lines += [f"  {node}: {reason}" for node, reason in bad]
    print("\n" + "\n".join(lines), file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
