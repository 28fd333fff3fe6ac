"""strider: full-parameter fine-tuning of models larger than the GPU, from Python.

    import strider
    engine = strider.Engine(model, strider.EngineConfig(seq=1024, micro_batch=2, lr=1e-5))
    result = engine.step(input_ids, labels, attention_mask)
    engine.sync_to_model(); model.save_pretrained(out)

strider.data prepares token files (python -m strider.data --help). The engine
and torch are imported on first use, so data preparation starts quickly; the
C++ op library is loaded when the first Engine is made (strider.load_library()).
"""
from strider.config import EngineConfig, parse_bytes

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "StepResult", "SUPPORTED_ARCHITECTURES", "StriderTrainer",
           "load_library", "parse_bytes"]

_LAZY = {"Engine": "strider.engine", "StepResult": "strider.engine", "SUPPORTED_ARCHITECTURES": "strider.engine",
         "load_library": "strider._library", "StriderTrainer": "strider.trainer"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'strider' has no attribute {name!r}")
