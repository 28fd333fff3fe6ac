"""strider.EngineConfig: how a run is shaped, with the command line's names.

The fields are `strider finetune`'s options (seq, micro_batch, accumulation,
window, dtype, lr, schedule, ...). `engine_json()` maps them onto the engine
config JSON of engine/engine_config_json.cpp (betas -> beta1/beta2); device,
device_budget and chaos go to the device, not the engine config; activations
goes to the binding, which chooses the engine config's saved_blocks and
keep_logits from it.

Names that differ from the command line, and why: `warmup_steps` (--warmup),
`total_steps` (--steps) and `clip_norm` (--clip) use the engine config's names
so that a config reads the same in Python and in saved training state.

Every field is checked in __post_init__ (and again by validate(), for a config
edited after it was made): a bad value is a ValueError naming the field, the
value and what is allowed, before any engine exists.
"""
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple, Union

SCHEDULES = ("constant", "linear", "cosine")
DTYPES = ("bf16", "fp32")
OPTIMIZERS = ("adamw", "adam")
ACTIVATIONS = ("auto", "recompute", "saved")
OPTIMIZER_STATES = ("fp32", "q8")

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1e3, "kib": 1024, "m": 1 << 20, "mb": 1e6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1e9, "gib": 1 << 30, "t": 1 << 40, "tb": 1e12, "tib": 1 << 40}


MAX_SIZE_BYTES = 1 << 60  # engine/plan.h's kMaxSizeBytes: past every machine


def parse_bytes(value: Union[int, str], name: str = "size") -> int:
    """24GiB, 512MiB, 2e9, 1000 -> bytes; the units of the command line's parse_bytes (engine/plan.cpp)."""
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a size such as 20GiB or a number of bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}: size {value} is negative")
        if value > MAX_SIZE_BYTES:
            raise ValueError(f"{name}: size {value} is past the largest strider accepts ({MAX_SIZE_BYTES}, 1 EiB)")
        return value
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", str(value))
    try:
        number = float(m.group(1)) if m else math.nan
    except ValueError:
        number = math.nan
    if not m or not math.isfinite(number):
        raise ValueError(f"{name}: {value!r} is not a size (use e.g. 24GiB, 512MiB, 2e9)")
    unit = m.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"{name}: {value!r} has unknown unit {m.group(2)!r} "
                         "(B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB)")
    if number < 0:
        raise ValueError(f"{name}: size {value!r} is negative")
    if number * _UNITS[unit] > MAX_SIZE_BYTES:
        raise ValueError(f"{name}: size {value!r} is past the largest strider accepts ({MAX_SIZE_BYTES}, 1 EiB)")
    return int(round(number * _UNITS[unit]))


@dataclass
class EngineConfig:
    # The batch: input_ids of one step are [micro_batch * accumulation, seq].
    seq: int = 512                  # tokens per sequence (shorter batches are padded to it)
    micro_batch: int = 1            # sequences per micro-batch
    accumulation: int = 1           # micro-batches per optimizer step
    # The sliding window.
    window: int = 2                 # cache units K on the device (>= 2)
    dtype: str = "bf16"             # compute dtype: bf16 or fp32 (fp32 tracks torch to 1e-5)
    vocab_chunk: int = 8192         # LM-head vocabulary rows per chunk
    token_tile: int = 0             # tokens per tile in the LM head and the MLP (long context); 0: all at once
    vocab_shard_rows: int = 0       # vocabulary rows per embedding / LM-head shard; 0: no larger than a layer
    grad_transfer: str = "bf16"     # gradients to the host in bf16 (summed in fp32 first) or fp32 (exact);
                                    # an fp32 dtype always sends fp32
    checkpoints_on_host: bool = False  # block inputs kept in pinned host memory, not on the device
    # What a decoder layer's backward starts from: "recompute" (its forward again, from its checkpoint),
    # "saved" (its projections' outputs, kept in pinned host RAM: every layer), or "auto" (the last layers
    # whose kept bytes fit in half of MemAvailable after the engine's other host bytes). Under saved and
    # auto the head's logits also stay on the device between its two passes when they take at most an
    # eighth of the device budget the engine's buffers leave. The engine chooses (python_shim/engine_class.cpp);
    # the result is bit-identical either way. Placement: a resumed run may choose differently.
    activations: str = "auto"
    # The optimizer (AdamW on fp32 masters, on the CPU).
    lr: float = 1e-5                # peak learning rate
    schedule: str = "constant"      # constant, linear or cosine, after warmup_steps of linear warm-up
    warmup_steps: int = 0
    total_steps: int = 0            # linear/cosine decay to 0 at total_steps (needed by those two)
    weight_decay: float = 0.0
    clip_norm: float = 1.0          # exact global gradient-norm clip; 0: off
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    optimizer: str = "adamw"        # adamw (decoupled weight decay) or adam
    optimizer_threads: int = 0      # CPU AdamW threads; 0: all
    # How master weights and Adam moments are stored (host/state_format.h): "fp32" (12 bytes per
    # parameter, exact) or "q8" (3.06: the bf16 compute copy plus an 8-bit extension as the master,
    # 8-bit m and sqrt(v) per group of 128, stochastic rounding; needs dtype bf16). Recorded in
    # checkpoints; a checkpoint in another format is refused unless the change is asked for.
    optimizer_state: str = "fp32"
    # Where optimizer state goes when RAM is short.
    nvme_dir: str = ""
    nvme_blocks: Sequence[int] = field(default_factory=tuple)  # blocks whose fp32 state lives in nvme_dir
    grad_ring: int = 3              # host gradient staging slots shared by blocks (>= 1; engine.h)
    # The device.
    device: str = "auto"            # auto (CUDA if usable, else CPU), cpu, cuda, cuda:N
    device_budget: Union[int, str] = 0  # device memory strider may use, e.g. "20GiB"; 0: the device's default
    chaos: bool = False             # CPU device only: random delays that expose missing waits (tests)
    chaos_seed: int = 1

    def __post_init__(self):
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        self.nvme_blocks = tuple(self.nvme_blocks)
        self.validate()

    @property
    def batch(self) -> int:
        """Sequences per optimizer step."""
        return self.micro_batch * self.accumulation

    def validate(self) -> "EngineConfig":
        def bad(name, allowed):
            raise ValueError(f"EngineConfig.{name} = {getattr(self, name)!r}: {allowed}")

        def integer(name, lo):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(name, f"expected an int >= {lo}")
            if v < lo:
                bad(name, f"must be >= {lo}")

        def number(name, lo, hi=math.inf, lo_open=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, "expected a finite number")
            if v < lo or (lo_open and v == lo) or v > hi:
                bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}]")

        integer("seq", 1)
        integer("micro_batch", 1)
        integer("accumulation", 1)
        integer("window", 2)  # one unit computes while the next is copied in
        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {DTYPES}")
        integer("vocab_chunk", 1)
        integer("token_tile", 0)
        integer("vocab_shard_rows", 0)
        if self.grad_transfer not in ("bf16", "fp32"):
            bad("grad_transfer", "must be bf16 or fp32")
        if not isinstance(self.checkpoints_on_host, bool):
            bad("checkpoints_on_host", "expected a bool")
        if self.activations not in ACTIVATIONS:
            bad("activations", f"must be one of {ACTIVATIONS}")
        number("lr", 0)
        if self.schedule not in SCHEDULES:
            bad("schedule", f"must be one of {SCHEDULES}")
        integer("warmup_steps", 0)
        integer("total_steps", 0)
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            bad("total_steps", f"schedule {self.schedule!r} decays to 0 at total_steps, so it must be > "
                               f"warmup_steps ({self.warmup_steps})")
        number("weight_decay", 0)
        number("clip_norm", 0)
        if (not isinstance(self.betas, tuple) or len(self.betas) != 2 or
                not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                        for b in self.betas)):
            bad("betas", "expected (beta1, beta2), each in [0, 1)")
        number("eps", 0, lo_open=True)
        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", f"must be one of {OPTIMIZERS}")
        integer("optimizer_threads", 0)
        if self.optimizer_state not in OPTIMIZER_STATES:
            bad("optimizer_state", f"must be one of {OPTIMIZER_STATES}")
        if self.optimizer_state == "q8" and self.dtype != "bf16":
            bad("optimizer_state", "q8 keeps the master's high half in the bf16 compute copy: it needs dtype bf16")
        if not isinstance(self.nvme_dir, str):
            bad("nvme_dir", "expected a directory path (str)")
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in self.nvme_blocks):
            bad("nvme_blocks", "expected block indices >= 0")
        if self.nvme_blocks and not self.nvme_dir:
            bad("nvme_blocks", "needs nvme_dir, the directory their optimizer state lives in")
        integer("grad_ring", 1)
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            bad("device", "must be auto, cpu, cuda or cuda:N")
        parse_bytes(self.device_budget, "EngineConfig.device_budget")
        if not isinstance(self.chaos, bool):
            bad("chaos", "expected a bool")
        integer("chaos_seed", 0)
        return self

    @property
    def device_budget_bytes(self) -> int:
        return parse_bytes(self.device_budget, "EngineConfig.device_budget")

    def engine_dict(self) -> dict:
        """The engine config JSON's fields (engine/engine_config_json.cpp)."""
        self.validate()
        return dict(seq=self.seq, micro_batch=self.micro_batch, accumulation=self.accumulation, dtype=self.dtype,
                    vocab_chunk=self.vocab_chunk, token_tile=self.token_tile, vocab_shard_rows=self.vocab_shard_rows,
                    grad_transfer=self.grad_transfer, window=self.window, checkpoints_on_host=self.checkpoints_on_host,
                    lr=float(self.lr), beta1=float(self.betas[0]), beta2=float(self.betas[1]), eps=float(self.eps),
                    weight_decay=float(self.weight_decay), optimizer=self.optimizer, schedule=self.schedule,
                    warmup_steps=self.warmup_steps, total_steps=self.total_steps, clip_norm=float(self.clip_norm),
                    optimizer_threads=self.optimizer_threads, optimizer_state=self.optimizer_state,
                    nvme_dir=self.nvme_dir,
                    nvme_blocks=list(self.nvme_blocks), grad_ring=self.grad_ring,
                    # Not an engine config field: the binding turns it into saved_blocks and keep_logits.
                    activations=self.activations)

    @classmethod
    def from_engine_dict(cls, d: dict, **placement) -> "EngineConfig":
        """The inverse of engine_dict (beta1/beta2 -> betas), e.g. the engine config a training checkpoint
        saved; `placement` sets the fields the engine config does not hold (device, device_budget, chaos)."""
        d = dict(d)
        # The layers that kept their activations are placement, chosen again on this machine (by
        # `activations`, default "auto"), like the device; the maths is bit-identical either way.
        d.pop("saved_blocks", None)
        d.pop("keep_logits", None)
        if "beta1" in d or "beta2" in d:
            d["betas"] = (d.pop("beta1", 0.9), d.pop("beta2", 0.999))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"EngineConfig.from_engine_dict: unknown engine config field(s) {unknown}")
        return cls(**{**d, **placement})

    def engine_json(self) -> str:
        return json.dumps(self.engine_dict())

    def replace(self, **changes) -> "EngineConfig":
        """A copy with some fields changed (checked like a new one)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
