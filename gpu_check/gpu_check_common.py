"""What the Python checks of gpu_check/gpu_check.sh share (gpu_engine_check.py, gpu_memory_check.py).

    from gpu_check_common import require_device, run_check   # gpu_check/ is the script's folder: on sys.path

Importing it puts this tree's python_shim/ first on sys.path, so `import strider` is the package of the
tree under test (its op library then comes from $STRIDER_BUILD_DIR), not one pip installed elsewhere.
"""
import json
import pathlib
import sys
import traceback

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO / "python_shim") not in sys.path:
    sys.path.insert(0, str(REPO / "python_shim"))


def require_device(device):
    """Raises, naming the device and the torch, when `device` is CUDA and torch sees none."""
    import torch
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"--device {device}: torch {torch.__version__} sees no CUDA device")


def run_check(out, body):
    """Runs body(out), which fills `out` and sets out["ok"]; prints `out` as the last line, one JSON object
    (gpu_check.py reads it). Returns the exit status: 0 ok, 1 a comparison failed, 2 the check could not run
    (the error, also in the JSON)."""
    try:
        body(out)
        rc = 0 if out.get("ok") else 1
    except Exception as e:  # noqa: BLE001 - the check could not run: say why
        traceback.print_exc()
        out.update(ok=False, error=f"{type(e).__name__}: {e}")
        rc = 2
    print(json.dumps(out, default=str), flush=True)
    return rc
