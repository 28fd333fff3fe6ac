"""strider.EngineConfig: how a run is shaped, made from the configuration's one declaration.

The fields, their types, ranges, choices, help and defaults come from engine/config/config_fields.json, the file
the command line's options and the engine config JSON (saved in every checkpoint) are made from too: a
field here is `strider finetune`'s option of the same meaning (seq is --seq, warmup_steps is --warmup,
clip_norm is --clip, nvme_dir is --nvme; `strider finetune --help` shows them all). The defaults are for
fine-tuning a pretrained model. Two kinds of value ask the engine to choose: window 0 and token_tile -1
(the plan's choice, as `strider finetune` makes it), and device_budget "auto".

Python's own shape on top of the declaration: beta1 and beta2 are one field, `betas`, as in
torch.optim.AdamW. device, device_budget, activations and chaos are chosen for each run (the declaration's
scope "run"): they go to the device and the binding, not into the engine config or a checkpoint.

Every field is checked in __post_init__ (and again by validate(), for a config edited after it was made):
a bad value is a ValueError naming the field, the value and what is allowed, before any engine exists.
"""
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Literal, Sequence, Tuple, Union

DECLARATION_NAME = "config_fields.json"


def declaration_path() -> Path:
    """Where the declaration is: next to this package (an installed wheel), or engine/config/ of a source checkout."""
    here = Path(__file__).resolve().parent
    for p in (here / DECLARATION_NAME, here.parents[1] / "engine" / "config" / DECLARATION_NAME):
        if p.is_file():
            return p
    raise ImportError(f"strider: {DECLARATION_NAME} not found next to {here} or in engine/config/ of its checkout; "
                      "reinstall the package")


DECLARATION = json.loads(declaration_path().read_text())
FIELDS = {f["name"]: f for f in DECLARATION["fields"]}
_UNITS = DECLARATION["size_units"]
MAX_SIZE_BYTES = DECLARATION["max_size_bytes"]  # engine/config/config_fields.h's kMaxSizeBytes: past every machine

SCHEDULES = tuple(FIELDS["schedule"]["choices"])
DTYPES = tuple(FIELDS["dtype"]["choices"])
OPTIMIZERS = tuple(FIELDS["optimizer"]["choices"])
ACTIVATIONS = tuple(FIELDS["activations"]["choices"])
OPTIMIZER_STATES = tuple(FIELDS["optimizer_state"]["choices"])


def parse_bytes(value: Union[int, str], name: str = "size") -> int:
    """24GiB, 512MiB, 2e9, 1000 -> bytes, with the declaration's units (the command line's parse_bytes)."""
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


def _range_text(f) -> str:
    lo, hi = f.get("min", -math.inf), f.get("max", math.inf)
    return f"{'(' if f.get('min_open') else '['}{lo}, {hi}{')' if f.get('max_open') else ']'}"


def _problem(f, v) -> str:
    """What is wrong with value v of declared field f; empty when nothing is (engine/config/config_fields.cpp's twin)."""
    def in_range(x):
        if "min" in f and (x <= f["min"] if f.get("min_open") else x < f["min"]):
            return False
        return not ("max" in f and (x >= f["max"] if f.get("max_open") else x > f["max"]))

    def integer(x):
        if isinstance(x, bool) or not isinstance(x, int):
            return f"is not an integer (expected one in {_range_text(f)})"
        return "" if in_range(x) else f"is outside {_range_text(f)}"

    t = f["type"]
    if t == "int":
        return integer(v)
    if t == "number":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"is not a number (expected one in {_range_text(f)})"
        return "" if math.isfinite(v) and in_range(v) else f"is outside {_range_text(f)}"
    if t == "bool":
        return "" if isinstance(v, bool) else "is not True or False"
    if t == "choice":
        return "" if v in f["choices"] else f"must be one of {tuple(f['choices'])}"
    if t == "text":
        return "" if isinstance(v, str) else "is not a str"
    if t == "size":
        if v in f.get("choices", ()):
            return ""
        try:
            parse_bytes(v, "size")
        except ValueError as e:
            return f"is not a size or {' or '.join(f.get('choices', ()))} ({e})"
        return ""
    if t == "ints":
        if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
            return "is not a sequence of integers"
        for x in v:
            p = integer(x)
            if p:
                return f"holds {x!r}, which {p}"
        return ""
    raise ValueError(f"{declaration_path()}: field {f['name']!r} has unknown type {t!r}")


def engine_settings(d: dict):
    """torch.classes.strider.EngineSettings (python_shim/engine_plan.h) for a dict of engine config fields (an
    EngineConfig's engine_dict(), or the engine config a checkpoint records), each set as the typed value it
    is and checked by the engine against the declaration when set: a bad one is a ValueError naming it. The
    package's own keys: activations, devices, and state_shard with state_shards (a data-parallel rank's slice).
    Needs the op library (strider.load_library())."""
    import torch
    s = torch.classes.strider.EngineSettings()
    d = dict(d)
    if "activations" in d:
        s.set_activations(d.pop("activations"))
    if "devices" in d:
        s.set_devices(d.pop("devices"))
    if "state_shards" in d or "state_shard" in d:
        s.set_ranks(d.pop("state_shard", 0), d.pop("state_shards", 1))
    for name, v in d.items():
        if isinstance(v, bool):
            s.set_bool(name, v)
        elif isinstance(v, int):
            s.set_int(name, v)
        elif isinstance(v, float):
            s.set_float(name, v)
        elif isinstance(v, str):
            s.set_text(name, v)
        elif isinstance(v, Sequence) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            s.set_ints(name, list(v))
        else:
            raise ValueError(f"engine settings: {name!r} = {v!r} is not a number, bool, str or list of integers")
    return s


def _settings_problems(fields: dict):
    """(field, text) for each rule between the engine settings `fields` break, as the engine states them
    (EngineSettings.problems, engine/config/engine_config_json.h): one place for the command line, the engine
    and this class. Where the op library is not built, none: the engine, which needs the library, refuses
    them when it is made. A rule held against lora waits while lora is empty: a PEFT model brings the
    adapters when the Engine is made (strider.Engine checks the pair then)."""
    try:
        from strider._library import load_library
        load_library()
    except ImportError:
        return []
    names, others, texts = engine_settings(fields).problems()
    return [(n, t) for n, o, t in zip(names, others, texts) if not (o == "lora" and not fields["lora"])]


def _python_groups():
    """The fields sharing a python group name (beta1, beta2 -> betas), which EngineConfig holds as one tuple."""
    grouped = {}
    for f in DECLARATION["fields"]:
        if isinstance(f.get("python"), str):
            grouped.setdefault(f["python"], []).append(f)
    return grouped


_GROUPS = _python_groups()


class _Methods:
    """What EngineConfig does beside its fields (the fields: the generated class below)."""

    def __post_init__(self):
        for name, members in _GROUPS.items():
            if isinstance(getattr(self, name), list):
                setattr(self, name, tuple(getattr(self, name)))
        if not isinstance(self.nvme_blocks, (str, bytes)) and isinstance(self.nvme_blocks, Sequence):
            self.nvme_blocks = tuple(self.nvme_blocks)
        self.validate()

    @property
    def batch(self) -> int:
        """Sequences per optimizer step."""
        return self.micro_batch * self.accumulation

    def validate(self) -> "EngineConfig":
        def bad(name, allowed):
            raise ValueError(f"EngineConfig.{name} = {getattr(self, name)!r}: {allowed}")

        for name, members in _GROUPS.items():
            v = getattr(self, name)
            if not isinstance(v, tuple) or len(v) != len(members):
                bad(name, f"expected ({', '.join(m['name'] for m in members)})")
            for m, x in zip(members, v):
                p = _problem(m, x)
                if p:
                    bad(name, f"{m['name']} {x!r} {p}")
        for f in DECLARATION["fields"]:
            if f.get("python", True) is True:
                p = _problem(f, getattr(self, f["name"]))
                if p:
                    bad(f["name"], p)
        # What one field cannot say alone: the engine's rules (engine/config/engine_config_json.h), asked
        # through the op library, and Python's own.
        for name, text in _settings_problems(self._engine_fields()):
            bad(name, text)
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            # The command line's schedule runs to --steps, which it knows only later: this rule is Python's.
            bad("total_steps", f"schedule {self.schedule!r} decays to 0 at total_steps, so it must be > "
                               f"warmup_steps ({self.warmup_steps})")
        if self.nvme_blocks and not self.nvme_dir:
            # Python's own: its devices are real ones (the engine's simulated device runs an NVMe tier
            # without a directory).
            bad("nvme_blocks", "needs nvme_dir, the directory their optimizer state lives in")
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            bad("device", "must be auto, cpu, cuda or cuda:N")
        one = r"(auto|cpu|cuda(:[0-9]+)?)"
        if not re.fullmatch(rf"[0-9]+|{one}(,{one})*", self.devices) or self.devices == "0":
            bad("devices", "must be a count of devices (2) or a list (cuda:0,cuda:2)")
        return self

    @property
    def device_budget_bytes(self) -> int:
        """The budget in bytes for the binding; 0 for "auto" (the device's own: a CUDA device's free memory
        less a margin, the CPU device's 1 GiB)."""
        if self.device_budget in FIELDS["device_budget"].get("choices", ()):
            return 0
        return parse_bytes(self.device_budget, "EngineConfig.device_budget")

    def engine_dict(self) -> dict:
        """The engine config JSON's fields (engine/config/engine_config_json.cpp), plus activations, which the
        binding turns into saved_blocks and keep_logits."""
        self.validate()
        d = self._engine_fields()
        d["activations"] = self.activations
        d["devices"] = self.devices  # the binding's, like activations: a pool of `device`'s kind
        return d

    def _engine_fields(self) -> dict:
        d = {}
        for f in DECLARATION["fields"]:
            group = f.get("python", True)
            if f["scope"] == "run" or group is False:
                continue
            if isinstance(group, str):
                members = _GROUPS[group]
                v = getattr(self, group)[members.index(f)]
            else:
                v = getattr(self, f["name"])
            d[f["name"]] = (float(v) if f["type"] == "number" else list(v) if f["type"] == "ints" else v)
        return d

    @classmethod
    def from_engine_dict(cls, d: dict, **placement) -> "EngineConfig":
        """The inverse of engine_dict, e.g. the engine config a training checkpoint saved; `placement` sets
        the fields the engine config does not hold (device, device_budget, chaos)."""
        d = dict(d)
        # The layers that kept their activations are placement, chosen again on this machine (by
        # `activations`, default "auto"), like the device; the maths is bit-identical either way.
        for f in DECLARATION["fields"]:
            if f.get("python", True) is False:
                d.pop(f["name"], None)
        for name, members in _GROUPS.items():
            if any(m["name"] in d for m in members):
                d[name] = tuple(d.pop(m["name"], m["default"]) for m in members)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"EngineConfig.from_engine_dict: unknown engine config field(s) {unknown}")
        return cls(**{**d, **placement})

    def engine_json(self) -> str:
        return json.dumps(self.engine_dict())

    def engine_settings(self):
        """The typed settings torch.classes.strider.Engine takes (engine_settings(self.engine_dict()))."""
        return engine_settings(self.engine_dict())

    def replace(self, **changes) -> "EngineConfig":
        """A copy with some fields changed (checked like a new one)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# The fields, their types, defaults and help, from the declaration: editors and type checkers see them.
# ---- generated by scripts/gen_engine_config.py from engine/config/config_fields.json: do not edit ----
@dataclasses.dataclass
class EngineConfig(_Methods):
    """How a run is shaped (engine/config/config_fields.json): each field below, with its default and what it does.
    `strider finetune --help` shows the command line's option of the same meaning for each."""

    seq: int = 1024
    """tokens per sequence"""

    micro_batch: int = 1
    """sequences per micro-batch"""

    accumulation: int = 1
    """micro-batches per optimizer step"""

    window: int = 0
    """cache units K on the device (0: the plan chooses; at least 2)"""

    dtype: Literal['bf16', 'fp16', 'fp32'] = 'bf16'
    """compute dtype (fp16 scales its loss dynamically, as torch's GradScaler; fp32 tracks torch to 1e-5)"""

    matmul_accumulate: Literal['fp32', 'fp16'] = 'fp32'
    """what fp16 GEMMs accumulate in: fp16 runs twice as fast on a GeForce GPU (cuBLAS, as torch's
    allow_fp16_accumulation), at fp16's precision inside each sum; CUDA only, needs --dtype fp16"""

    loss_scale: float = 65536.0
    """fp16: the initial loss scale (halved on an overflow, which skips the step; at least 1)"""

    loss_scale_growth_interval: int = 2000
    """fp16: steps in a row without an overflow after which the loss scale doubles"""

    vocab_chunk: int = 8192
    """LM-head vocabulary rows per chunk"""

    token_tile: int = -1
    """tokens per tile in the LM head and the MLP (long context; -1: the plan chooses, 0: untiled)"""

    vocab_shard_rows: int = 0
    """vocabulary rows per embedding / LM-head shard, a multiple of --vocab-chunk (0: no larger than a layer, and
    with --devices N small enough for N shards where whole chunks allow: a pool runs the head's shards on
    consecutive devices)"""

    layer_pieces: str = ''
    """cut each decoder layer into pieces by tensor name: comma-separated groups of '+'-joined name fragments, e.g.
    'layernorm,self_attn+mlp' (each piece lands its gradients and runs AdamW on its own: smaller gradient ring
    slots; empty: one piece per layer)"""

    expert_pieces: int = 0
    """a mixture-of-experts layer's experts in pieces of this many (each lands its gradients and runs AdamW on its
    own: smaller gradient ring slots, updates that start sooner; 0: the experts stay in the layer's pieces)"""

    lora: str = ''
    """LoRA adapters over a frozen base: 'r=16,alpha=32,targets=all-linear' (targets:
    q_proj+k_proj+v_proj+o_proj+gate_proj+up_proj+down_proj or all-linear; optional rslora=1,
    train=lm_head+embed_tokens for modules trained in full); empty: train every parameter"""

    base_format: Literal['compute', 'int8', 'nf4'] = 'compute'
    """how a LoRA base's frozen weight matrices are held in RAM and sent to the device: compute (the compute dtype,
    exact), int8 (per-row absmax, about 1 byte per parameter) or nf4 (QLoRA's 4-bit NormalFloat, blocks of 64,
    about 0.56 bytes), quantized once at load and dequantized on the device at each visit; needs --lora"""

    grad_transfer: Literal['bf16', 'fp32'] = 'bf16'
    """gradients to the host in bf16 (summed in fp32 on the device first) or fp32 (exact; an fp32 dtype always sends
    fp32)"""

    checkpoints_on_host: bool = False
    """block inputs kept in pinned host memory, not on the device"""

    lr: float = 1e-05
    """peak learning rate"""

    schedule: Literal['constant', 'linear', 'cosine'] = 'constant'
    """learning-rate schedule after the warm-up: constant, or linear or cosine decay to 0 at the last step"""

    warmup_steps: int = 0
    """steps of linear warm-up"""

    total_steps: int = 0
    """the step linear and cosine decay reach 0 at (the command line's --steps)"""

    weight_decay: float = 0
    """AdamW weight decay (of every tensor but norms and biases, as transformers' Trainer does)"""

    decay_norms_and_biases: bool = False
    """weight decay of norms and biases too (off: they are spared, as transformers' Trainer spares them)"""

    clip_norm: float = 1.0
    """exact global gradient-norm clip (0: off)"""

    betas: Tuple[float, float] = (0.9, 0.999)
    """(beta1, beta2); beta1: Adam's first-moment decay; beta2: Adam's second-moment decay"""

    eps: float = 1e-08
    """Adam's epsilon"""

    optimizer: Literal['adamw', 'adam'] = 'adamw'
    """adamw (decoupled weight decay) or adam (weight decay added to the gradient)"""

    optimizer_threads: int = 0
    """CPU AdamW threads (0: all)"""

    optimizer_state: Literal['fp32', 'q8'] = 'fp32'
    """how master weights and Adam moments are stored: fp32 (12 bytes per parameter, exact) or q8 (3.06: the bf16
    compute copy plus an 8-bit extension as the master, 8-bit m and sqrt(v) per group of 128, stochastic
    rounding; bf16 compute only)"""

    nvme_dir: str = ''
    """directory on NVMe for optimizer state that does not fit in RAM (past it, layers' compute copies too; the plan
    chooses)"""

    nvme_blocks: Tuple[int, ...] = ()
    """blocks whose optimizer state lives under nvme_dir (the command line's plan chooses them)"""

    grad_ring: int = 3
    """host gradient staging slots shared by the NVMe-tier blocks"""

    packed_documents: bool = False
    """rows pack several documents, each attending only to itself with positions restarting at its start
    (block-diagonal attention, as transformers gives packed position_ids); costs a [batch, seq, seq] mask per
    layer call. strider finetune sets it when the token file's documents fall inside its --seq windows, unless
    given"""

    objective: Literal['sft', 'dpo', 'simpo', 'orpo', 'grpo'] = 'sft'
    """what the step minimises: sft (cross-entropy over the labels), dpo (preference pairs against a reference: the
    step's rows are N chosen sequences then their N rejected ones, Engine.step(..., ref_logps=)), simpo (CPO's
    simpo: pairs, length-normalised, no reference), orpo (SFT on the chosen plus beta times the odds-ratio term)
    or grpo (the clipped RL policy loss, Engine.step(..., advantages=, old_logps=, ref_logps=)), each as TRL 1.16
    defines it"""

    loss_type: Literal['auto', 'sigmoid', 'ipo', 'hinge', 'robust', 'grpo', 'bnpo', 'dapo', 'dr_grpo'] = 'auto'
    """TRL's loss_type: dpo takes sigmoid (auto), ipo, hinge or robust; grpo takes dapo (auto), grpo, bnpo or
    dr_grpo"""

    beta: float = -1
    """the objective's beta (-1: TRL's default, 0.1 for dpo, simpo and orpo, 0 for grpo, where it weighs the KL to
    the reference)"""

    label_smoothing: float = 0
    """dpo robust's and simpo's label smoothing: the probability that a pair's preference is flipped"""

    simpo_gamma: float = 0.5
    """simpo's target reward margin"""

    epsilon: float = 0.2
    """grpo: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]"""

    epsilon_high: float = -1
    """grpo: the clipping range's upper side (-1: epsilon)"""

    max_completion_length: int = 0
    """grpo dr_grpo: the loss is divided by rows x this"""

    keep_reference: bool = False
    """full fine-tuning: keep a frozen copy of the starting weights in RAM (2 bytes a parameter in bf16; every
    checkpoint holds it), the reference model that Engine.logprobs(..., reference=True) streams through the
    window in their place, for GRPO's KL with beta > 0 or DPO's reference; LoRA's reference is its frozen base
    without it"""

    activations: Literal['auto', 'recompute', 'saved'] = 'auto'
    """what a decoder layer's backward starts from: recompute (its forward again, from its checkpoint), saved (its
    projections' outputs, kept in pinned host RAM as far as RAM allows), or auto (saved where that pays; the
    result is bit-identical either way)"""

    device: str = 'auto'
    """auto (CUDA if usable, else the CPU), cpu, cuda, cuda:N"""

    devices: str = '1'
    """a pool of devices one process drives: a count (2: cuda:0 and cuda:1, or two CPU devices) or a list
    (cuda:0,cuda:2); block b's visits run on device b % N and the head's vocabulary shards on the devices after
    it, one host optimizer and one copy of the state serve them all, and the result is one device's bits at the
    same --vocab-shard-rows; under torchrun each rank is a pool (a count N: local rank r takes cuda:rN to
    cuda:rN+N-1)"""

    device_budget: Union[int, str] = 'auto'
    """device memory strider may use (e.g. 20GiB); auto: on a CUDA device its free memory at start less 5% of it and
    512 MiB (the CUDA context, cuBLAS workspaces, allocator rounding), on the CPU device 1 GiB"""

    chaos: bool = False
    """CPU device only: random delays that expose missing waits (tests)"""

    chaos_seed: int = 1
    """the chaos delays' seed"""
# ---- end of the generated code ----
