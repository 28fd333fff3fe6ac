"""strider: full-parameter fine-tuning of models larger than the GPU, from Python.

    import strider
    engine = strider.Engine(model, strider.EngineConfig(seq=1024, micro_batch=2, lr=1e-5))
    result = engine.step(input_ids, labels, attention_mask)
    engine.finish(); model.save_pretrained(out)   # the model's parameters are the engine's
    engine.save(ckpt); engine = strider.Engine.resume(ckpt, model)   # full training state

strider.data prepares token files (python -m strider.data --help). The engine
and torch are imported on first use, so data preparation starts quickly; the
C++ op library is loaded when the first Engine is made (strider.load_library()).
"""
from strider.config import EngineConfig, parse_bytes

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "StepResult", "SUPPORTED_ARCHITECTURES", "StriderTrainer",
           "StriderDPOTrainer", "inspect_checkpoint", "load_library", "parse_bytes", "plan"]

_LAZY = {"Engine": "strider.engine", "StepResult": "strider.engine", "SUPPORTED_ARCHITECTURES": "strider.engine",
         "inspect_checkpoint": "strider.engine", "plan": "strider.engine",
         "load_library": "strider._library", "StriderTrainer": "strider.trainer",
         "StriderDPOTrainer": "strider.dpo_trainer"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'strider' has no attribute {name!r}")
