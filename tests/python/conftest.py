"""Shared pytest fixtures: where the C++ build outputs are.

Tests that drive a C++ binary ask for `strider_binary("name")`; the test is
skipped, with the reason, when the build directory or the binary is absent.
The build directory is $STRIDER_BUILD_DIR, else <repo>/build.
"""
import os
import pathlib
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
