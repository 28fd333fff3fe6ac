"""Finds and loads libstrider_ops.so, the C++ engine behind strider.Engine.

Looked for, in order: next to this package (an installed wheel puts it there),
$STRIDER_BUILD_DIR/python_shim/, then <repo>/build/python_shim/ (a source
checkout built with CMake). Loaded once per process; torch must be imported
first, because the library links against torch's own libtorch.
"""
import os
from pathlib import Path

import torch

LIBRARY_NAME = "libstrider_ops.so"
_loaded = None  # the path loaded, once loaded


def candidate_paths():
    """Where load_library looks, in order."""
    here = Path(__file__).resolve().parent
    paths = [here / LIBRARY_NAME]
    build = os.environ.get("STRIDER_BUILD_DIR")
    if build:
        paths.append(Path(build).resolve() / "python_shim" / LIBRARY_NAME)
    paths.append(here.parents[1] / "build" / "python_shim" / LIBRARY_NAME)
    return paths


def load_library():
    """Loads the op library (once) and returns its path; ImportError names every path tried."""
    global _loaded
    if _loaded is not None:
        return _loaded
    tried = candidate_paths()
    path = next((p for p in tried if p.is_file()), None)
    if path is None:
        raise ImportError(
            f"strider: {LIBRARY_NAME} not found; looked in: " + ", ".join(str(p) for p in tried) +
            ". Build it (cmake --build <build> --target strider_ops) and set STRIDER_BUILD_DIR=<build>, "
            "or pip install the strider package")
    try:
        torch.ops.load_library(str(path))
    except OSError as e:
        raise ImportError(f"strider: {path} exists but does not load ({e}); it must be built against this "
                          f"process's torch {torch.__version__}: rebuild it") from e
    try:
        torch.classes.strider.Engine
    except RuntimeError as e:  # torch.classes raises RuntimeError for an unknown class
        raise ImportError(f"strider: {path} has no torch.classes.strider.Engine (built before it existed): "
                          "rebuild it") from e
    _loaded = path
    return path
