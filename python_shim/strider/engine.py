"""strider.Engine: trains a transformers causal LM in place with the sliding-window engine.

    model = AutoModelForCausalLM.from_pretrained(path)          # on the CPU
    engine = strider.Engine(model, strider.EngineConfig(seq=1024, micro_batch=2, lr=1e-5))
    for batch in loader:
        r = engine.step(batch["input_ids"], batch["labels"], batch["attention_mask"])
    engine.finish()                                              # wait for the last updates
    model.save_pretrained(out)                                   # the trained weights

The engine keeps the fp32 masters and Adam m and v in its own pinned host
store and streams blocks to the device itself, so the model must live on the
CPU. Construction loads the model's weights into the masters and then takes
the model's parameters over IN PLACE: every parameter's `.data` becomes a view
of the engine's compute copy (the bytes each block's H2D sends), so no second
copy of the weights exists and the model always holds what the engine trains
on. Consequences:

- The parameters' dtype becomes the compute dtype: bfloat16 with
  EngineConfig.dtype "bf16" (the default), float16 with "fp16" (the engine
  scales the loss dynamically, as torch's GradScaler does: StepResult.loss_scale,
  and an overflow skips the step), float32 with "fp32". Buffers (rotary
  tables) keep theirs. Tied weights stay tied.
- step() returns before the optimizer has finished updating the blocks (the
  updates overlap the next step). Call engine.finish() before reading the
  model (a forward pass, state_dict, save_pretrained); sync_to_model() does
  the same and is kept for code written before aliasing.
- The parameters belong to the engine: a write through them is overwritten
  by the block's next update. Load other weights with Engine(...) again.
- The model keeps the engine (its host arena, its device memory) alive as
  long as any parameter refers to it, so `del engine` alone frees nothing
  and a model that outlives its Engine never reads freed memory.

A refused model (an unsupported architecture, a parameter off the CPU, a
budget too small, a bad config) is untouched: the parameters are rebound only
after the engine was built and loaded.

Training state: engine.save(dir, extra) writes engine/checkpoint/train_checkpoint.h's
checkpoint (masters, m, v, step count, configs, `extra`, and a model
from_pretrained loads); strider.Engine.resume(dir, model) builds an engine on
`model` from it and continues bit-identically.

Batches follow transformers' conventions: labels are NOT shifted (the engine
predicts labels[t + 1] from position t, as the model's own loss does), -100
means "no loss", and positions whose attention_mask is 0 get no loss (nor a
place in a mixture-of-experts model's load-balancing loss). The engine runs
causal attention without a padding mask, so padding must be on the right
(after every real token), where no real token attends to it.
"""
import dataclasses
import json
import os
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import torch

from strider import peft_lora
from strider._library import load_library
from strider.config import EngineConfig
from strider.objective_inputs import objective_step_args

# The decoder families the C++ ModelSpec implements (engine/model/model_spec.cpp).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                           "GraniteForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
                           "MixtralForCausalLM")
IGNORE_INDEX = -100


@dataclass
class StepResult:
    step: int                    # the update this step made (1 for the first); a skipped step repeats it
    loss: float                  # mean over the batch's valid tokens (an objective past sft: its loss)
    tokens: int                  # batch * seq, padding included
    valid_tokens: int            # tokens whose loss counted
    grad_norm: float             # global norm before clipping
    lr: float                    # the learning rate this update used
    step_s: float
    tokens_per_s: float
    overlap_efficiency: float    # busiest lane's time / step time (1.0: perfectly hidden)
    critical_lane: str
    lanes: Dict[str, float] = field(default_factory=dict)  # busy fraction per lane
    peak_device_bytes: int = 0
    # What the step's device work moved and needed: bytes copied host -> device (parameters of each visit,
    # the batch, host checkpoints back) and device -> host (gradients, checkpoints out, the loss figures),
    # and ATen's working memory, the most any one compute op held (0 where the device does not measure it).
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    work_peak_bytes: int = 0
    # The numerics guard: a non-finite loss or gradient skips the step before
    # any update (no weight, moment or step count changes; the batch is spent).
    skipped: bool = False
    skip_reason: str = ""        # "loss is nan", "gradient norm is inf", ...
    # The batch had no target token (every label -100): nothing computed or changed, not a fault.
    no_targets: bool = False
    nonfinite_block: int = -1    # first block (forward order) with a non-finite gradient
    nonfinite_tensor: str = ""
    # fp16: the loss scale this step's gradients carried (0: the dtype does not scale), and whether the step
    # was skipped for an overflow of them above the floor scale (the scale backed off; not a divergence).
    loss_scale: float = 0.0
    overflow: bool = False
    # An objective past sft (EngineConfig.objective): its figures over every rank's rows under TRL's names
    # (dpo, simpo, orpo: rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins; grpo:
    # clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean, and kl with beta > 0).
    metrics: Dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_report(cls, numbers: Dict[str, float], texts: Dict[str, str],
                    busy: Dict[str, float]) -> "StepResult":
        """The binding's typed report (torch.classes.strider.Engine.step): its numbers, texts and lanes."""
        kw = {name: kind(numbers[name]) for name, kind in _REPORT_NUMBERS}
        kw.update((name, texts[name]) for name in _REPORT_TEXTS)
        metrics = {k[len("objective:"):]: float(v) for k, v in numbers.items() if k.startswith("objective:")}
        return cls(lanes=dict(busy), metrics=metrics, **kw)


# StepResult's fields the binding reports as numbers (each with its Python type) and as texts.
_REPORT_NUMBERS = [(f.name, f.type) for f in dataclasses.fields(StepResult) if f.type in (int, float, bool)]
_REPORT_TEXTS = [f.name for f in dataclasses.fields(StepResult) if f.type is str]


def architecture_of(model) -> str:
    """The model's class name; refuses a model that is not a supported causal LM."""
    name = type(model).__name__
    listed = list(getattr(getattr(model, "config", None), "architectures", None) or [])
    if name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"strider.Engine: {name} (config.architectures {listed}) is not supported; strider trains "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} (load the model with AutoModelForCausalLM)")
    unsupported = [a for a in listed if a not in SUPPORTED_ARCHITECTURES]
    if unsupported:
        raise ValueError(f"strider.Engine: config.architectures lists {unsupported}, which strider does not "
                         f"support (it trains {', '.join(SUPPORTED_ARCHITECTURES)})")
    return name


def check_trainable(model, pnames, trained):
    """Refuses a requires_grad flag that is not what the engine does with the tensor: a plain model trains
    every parameter (freeze a base with PEFT's LoRA instead); a PEFT model its adapters and modules_to_save
    (`pnames`: engine name -> the model's parameter name; `trained`: the engine names the engine trains)."""
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    frozen = [pn for en, pn in pnames.items() if not flags[pn] and en in trained]
    wrong = [pn for en, pn in pnames.items() if flags[pn] and en not in trained]
    for names, what, does in ((frozen, "requires_grad=False", "trains"), (wrong, "requires_grad=True", "freezes")):
        if names:
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
            raise ValueError(f"strider.Engine: {len(names)} parameters have {what} ({shown}), but strider {does} "
                             "them: it trains every parameter of a plain model, and a PEFT LoRA model's adapters "
                             "and modules_to_save (freeze a base with peft.get_peft_model)")


def check_on_cpu(model):
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            raise ValueError(f"strider.Engine: parameter {name} is on the meta device (not materialised); load "
                             "the model's weights on the CPU first")
        if p.device.type != "cpu":
            raise ValueError(f"strider.Engine: parameter {name} is on {p.device}; keep the model on the CPU "
                             "(model.to('cpu')): strider holds the weights in host memory and streams them to "
                             "the GPU itself, so a second copy on the GPU would only take its memory")


def check_finite(named_params):
    """A weight the engine would train from that is NaN or infinite: every loss would be NaN and every step
    skipped. Refused by name, as the command line refuses such a checkpoint."""
    chunk = 1 << 24  # elements checked at a time: an 8B model's embedding would need a 0.5 GB mask at once
    for name, p in named_params:
        flat = p.detach().reshape(-1)
        for start in range(0, flat.numel(), chunk):
            bad = ~torch.isfinite(flat[start:start + chunk])
            if bad.any():
                i = start + int(bad.nonzero()[0])
                raise ValueError(f"strider.Engine: parameter {name} holds {float(flat[i])} at element {i}: a model "
                                 "with a non-finite weight cannot train (every loss would be NaN); reload or repair "
                                 "the model")


def check_not_trained_elsewhere(model):
    """Two engines on one model would each rebind its parameters and write their trained weights into the
    other's compute copy: refused while the engine that took it first lives (the mark is on each parameter,
    so a PEFT wrapper and its base model count as one)."""
    import gc
    for name, p in model.named_parameters():
        owner = getattr(p, "_strider_engine", None)
        if owner is not None and owner() is not None:
            gc.collect()  # an engine dropped but held in a reference cycle is not alive
        if owner is not None and owner() is not None:
            raise ValueError(f"strider.Engine: the model's parameter {name} is trained by another strider.Engine "
                             "that is still alive; finish with it and drop it (del engine) before building "
                             "another on this model, or give the new one a copy of the model")


def inspect_checkpoint(path) -> dict:
    """What a training checkpoint (engine.save) says about itself: path (the directory used: <dir>, or
    <dir>.old after a crash mid-save), step, model_config, engine_config, extra, and model_problems: the
    exportable model files that are missing or differ from the checksums their save recorded (empty when
    the copy is sound). ValueError naming the path or the field when there is none or it is incomplete."""
    load_library()
    path = os.fspath(path)
    return json.loads(torch.ops.strider.inspect_training_checkpoint(path))


def plan(model_config: dict, config: Optional[EngineConfig] = None) -> dict:
    """The plan strider.Engine(model, config) runs by, for a model's config (model.config.to_dict(), or a
    config.json's dict) on config.device with config.device_budget: what `strider plan --json` prints, made by
    the same C++ (python_shim/engine_plan.h, EngineSettings.plan): window, token_tile, kept activations (saved_blocks) and logits
    (keep_logits), device and host bytes, and `why`. No device of that kind need exist here when the budget
    is given ("cuda" plans on the rtx4090's rates, as `strider plan --predict none` does)."""
    config = EngineConfig() if config is None else config
    if not isinstance(config, EngineConfig):
        raise TypeError(f"strider.plan: config must be a strider.EngineConfig, got {type(config).__name__}")
    load_library()
    return json.loads(config.engine_settings().plan(json.dumps(model_config, default=str), config.device,
                                                    config.device_budget_bytes))


def distributed_ranks():
    """(rank, world, local_rank, local_world) of an initialized torch.distributed group of more than one
    process, else None. The local figures come from torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE (every rank on
    one machine without them)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    return rank, world, int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world))


class Engine:
    """The sliding-window engine, training a transformers model's own parameters in place."""

    def __init__(self, model, config: Optional[EngineConfig] = None):
        """Builds the engine for `model`, loads the model's weights into its fp32 masters and rebinds every
        parameter to the engine's compute copy (dtype: config.dtype). `model` is untouched if this raises."""
        check_not_trained_elsewhere(model)
        check_on_cpu(model)  # before the values are read (a meta tensor has none)
        check_finite(model.named_parameters())
        self._build(model, config)
        params = self._params()
        for name in self._names:
            self._engine.set_param(name, params[name].detach())
        self._alias()

    @classmethod
    def resume(cls, path, model, config: Optional[EngineConfig] = None, allow_changed: Sequence[str] = (),
               verify_checksums: bool = True) -> "Engine":
        """An engine on `model` continuing the run saved by engine.save(path): masters, Adam m and v and the
        step count come from the checkpoint (the model's current weights are not used), and the model's
        parameters are rebound to the engine's compute copy, i.e. the checkpoint's weights. The next step
        is bit-identical to the one the saved engine would have taken. A PEFT LoRA model (the run's
        adapters, new ones) keeps its frozen base, which must be the one the run started from: the checkpoint
        holds the trained tensors and the base's fingerprint, and a resume over another base is refused.

        config None: the checkpoint's engine config (device "auto"). A config whose maths fields (lr,
        schedule, betas, seq, batch, ...) differ from the saved run is refused unless they are named in
        allow_changed (e.g. ["total_steps"] to extend a run); placement (window, NVMe tier, device) may
        differ. The caller's `extra` from save() is in engine.resumed_extra. A refused resume (no checkpoint,
        another model, a changed config, a damaged file) is a ValueError naming the file and field, and
        leaves `model` untouched."""
        info = inspect_checkpoint(path)
        if config is None:
            config = EngineConfig.from_engine_dict(info["engine_config"])
            if peft_lora.is_peft_model(model):
                config = config.replace(lora="")  # the PEFT model's own (the load refuses other adapters)
        check_not_trained_elsewhere(model)
        engine = cls.__new__(cls)
        engine._build(model, config)
        if engine.config.lora:
            # A LoRA checkpoint holds the adapters (and the modules trained in full), not the frozen base: that is
            # the model's own, which the load checks is the base the adapters were trained over.
            params, trained = engine._params(), set(engine._engine.trainable_names())
            check_finite((name, params[name]) for name in engine._names if name not in trained)
            for name in engine._names:
                if name not in trained:
                    engine._engine.set_param(name, params[name].detach())
        engine.resumed_extra = engine._load(path, allow_changed, verify_checksums)
        engine._alias()
        return engine

    def _build(self, model, config):
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"strider.Engine: config must be a strider.EngineConfig, got {type(config).__name__}")
        config.validate()
        ranks = distributed_ranks()
        if config.base_format != "compute" and not peft_lora.is_peft_model(model):
            raise ValueError(f"strider.Engine: EngineConfig.base_format = {config.base_format!r} holds a frozen LoRA "
                             "base quantized; wrap the model with peft.get_peft_model(model, peft.LoraConfig(...))")
        base, pnames = model, None
        if peft_lora.is_peft_model(model):
            # LoRA over a frozen base: the adapters' options become the engine's (engine/model/lora.h).
            if config.lora:
                raise ValueError("strider.Engine: EngineConfig.lora is taken from the PEFT model; leave it empty")
            base, lora, pnames = peft_lora.engine_view(model)
            config = config.replace(lora=lora)
        elif config.lora:
            raise ValueError(f"strider.Engine: EngineConfig.lora = {config.lora!r} needs the model's adapters: wrap "
                             "the model with peft.get_peft_model(model, peft.LoraConfig(...)) and leave lora empty")
        arch = architecture_of(base)
        check_on_cpu(model)
        max_pos = getattr(base.config, "max_position_embeddings", None)
        if max_pos is not None and config.seq > max_pos:
            raise ValueError(f"EngineConfig.seq = {config.seq} is past the model's max_position_embeddings "
                             f"({max_pos}); lower seq")
        load_library()

        model_config = base.config.to_dict()
        model_config["architectures"] = [arch]
        self._model_config_json = json.dumps(model_config, default=str)
        self._base_model = str(getattr(base.config, "_name_or_path", "") or "")  # a LoRA checkpoint's adapter names it
        # Everything the engine builds is checked before anything is allocated, and nothing of the
        # model is written: a refusal here leaves `model` as it was.
        settings = config.engine_settings()
        if ranks is not None:
            # Data parallel: this rank keeps its slice of master, m and v (engine/run/engine.h, state_shards).
            settings.set_ranks(ranks[0], ranks[1])
        self._engine = torch.classes.strider.Engine(self._model_config_json, settings, config.device,
                                                    config.device_budget_bytes, config.chaos, config.chaos_seed)
        if ranks is not None:
            self._join(*ranks)
        self.model = model
        self.config = config
        self._names = list(self._engine.param_names())
        self._released = {}  # a base held quantized: name -> the model's dtype, while its tensors are empty
        params = dict(model.named_parameters())  # a tied weight appears once
        # Engine name -> the model's parameter name (a PEFT model's differ; a plain one's are the same).
        self._pnames = {n: n for n in params} if pnames is None else pnames
        missing = [n for n in self._names if n not in self._pnames]
        extra = [pn for en, pn in self._pnames.items() if en not in set(self._names)]
        if missing or extra:
            raise ValueError(f"strider.Engine: the model's parameters do not match what the engine trains for "
                             f"{arch}: the model lacks {missing[:5]}, the engine has no place for {extra[:5]}")
        check_trainable(model, self._pnames, set(self._engine.trainable_names()))
        self.last_result: Optional[StepResult] = None
        self.last_eval_metrics: dict = {}  # an objective past SFT: evaluate()'s figures under TRL's names
        self.resumed_extra = None

    def _join(self, rank, world, local_rank, local_world):
        """Joins the other ranks of the torch.distributed group: rank 0 hosts strider's own store (its C++
        collectives cannot use torch.distributed's from Python) on a free port, the group's broadcast tells the
        others where, and every rank's engine joins it. Each rank then steps on its own micro-batches; the
        gradients are summed over the ranks, the optimizer state is sharded, and every rank's model ends with
        the same weights."""
        import socket
        timeout = int(os.environ.get("STRIDER_DIST_TIMEOUT", "300"))
        where = [None]
        if rank == 0:
            host = os.environ.get("MASTER_ADDR") or socket.gethostname()
            where = [(host, int(self._engine.host_ranks(world, timeout)))]
        torch.distributed.broadcast_object_list(where, src=0)
        host, port = where[0]
        self._engine.join_ranks(host, port, rank, world, local_rank, local_world, timeout)

    def _params(self):
        """The model's parameters by the engine's names."""
        params = dict(self.model.named_parameters())
        return {name: params[self._pnames[name]] for name in self._names}

    @torch.no_grad()
    def _alias(self):
        """Rebinds every parameter's data to its slot of the engine's compute copy. Every view is made
        first, so a failure leaves the model as it was; the rebinding itself cannot fail half-way."""
        # A base held quantized (EngineConfig.base_format int8 or nf4) has no copy in the model's dtype to
        # alias: its tensors are released (empty) while the engine trains, and restore() puts back their
        # dequantized values, what the layers computed with.
        held = {name for name in self._names if self._engine.held_quantized(name)}
        views = {name: self._engine.compute_view(name) for name in self._names if name not in held}
        params = self._params()
        for name in held:
            if name not in self._released:
                self._released[name] = params[name].dtype
        mark = weakref.ref(self)
        for name in self._names:
            p = params[name]
            p._strider_engine = mark  # check_not_trained_elsewhere: this engine trains it while it lives
            p.grad = None  # a gradient of the old data means nothing to the engine's weights
            # The Parameter object stays: ties, hooks and references hold.
            p.data = views[name] if name in views else torch.empty(0, dtype=self._released[name])

    # -- batches ---------------------------------------------------------------------------------------
    def _prepare(self, what, input_ids, labels, attention_mask, position_ids=None):
        """[rows, length] HF batch -> the engine's [batch, seq] int64 ids, shifted labels, positions (None
        without position_ids) and attention mask (None without padding).

        Fewer rows or a shorter length than the config's are padded (ids 0, labels -100): padding on the
        right of a causal model changes no real token's output, and rows with no valid label add nothing
        to the loss, which is a mean over valid tokens. A padded row's positions count from 0; a row's
        padding continues its last document's. The attention mask, the caller's zeros and that padding,
        leaves the padding out of a mixture-of-experts model's load-balancing loss, as transformers does."""
        c = self.config
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"{what}: input_ids must be integer token ids of shape [batch, seq], got "
                             f"{tuple(ids.shape)} {ids.dtype}")
        rows, length = ids.shape
        if rows > c.batch or length > c.seq or rows == 0 or length == 0:
            raise ValueError(f"{what}: input_ids has shape {tuple(ids.shape)}; the engine takes up to [batch, seq] = "
                             f"[{c.batch}, {c.seq}] (micro_batch {c.micro_batch} x accumulation {c.accumulation}, "
                             f"seq {c.seq}) per call")
        lab = ids.clone() if labels is None else torch.as_tensor(labels)
        if lab.dim() == 1:
            lab = lab.unsqueeze(0)
        if lab.shape != ids.shape:
            raise ValueError(f"{what}: labels has shape {tuple(lab.shape)}, input_ids {tuple(ids.shape)}; they "
                             "must match (labels are not shifted: transformers' convention)")
        lab = lab.to(torch.int64).clone()
        if attention_mask is not None:
            mask = torch.as_tensor(attention_mask)
            if mask.dim() == 1:
                mask = mask.unsqueeze(0)
            if mask.shape != ids.shape:
                raise ValueError(f"{what}: attention_mask has shape {tuple(mask.shape)}, input_ids "
                                 f"{tuple(ids.shape)}; they must match")
            keep = mask.to(torch.int64) != 0
            # Right padding: once a row's mask is 0, it stays 0. A 0 before a 1 is left padding (or a hole),
            # which causal attention without a mask would let real tokens see.
            if bool((keep[:, 1:] & ~keep[:, :-1]).any()):
                raise ValueError(f"{what}: attention_mask has a 0 before a 1 (left padding?); strider runs "
                                 "causal attention without a padding mask, so pad on the right: "
                                 "tokenizer.padding_side = 'right'")
            lab[~keep] = IGNORE_INDEX
        else:
            keep = torch.ones(rows, length, dtype=torch.bool)
        out_mask = None
        if rows < c.batch or length < c.seq or not bool(keep.all()):
            out_mask = torch.zeros(c.batch, c.seq, dtype=torch.int64)
            out_mask[:rows, :length] = keep.to(torch.int64)
        out_ids = torch.zeros(c.batch, c.seq, dtype=torch.int64)
        out_ids[:rows, :length] = ids.to(torch.int64)
        # The engine's labels are aligned with its inputs: position t predicts labels[t + 1].
        out_lab = torch.full((c.batch, c.seq), IGNORE_INDEX, dtype=torch.int64)
        out_lab[:rows, :length - 1] = lab[:, 1:]
        if position_ids is None:
            return out_ids, out_lab, None, out_mask
        pos = torch.as_tensor(position_ids)
        if pos.dim() == 1:
            pos = pos.unsqueeze(0)
        if pos.shape != ids.shape or pos.dtype.is_floating_point or pos.dtype == torch.bool:
            raise ValueError(f"{what}: position_ids must be integers of input_ids' shape {tuple(ids.shape)}, got "
                             f"{tuple(pos.shape)} {pos.dtype}")
        if bool((pos < 0).any()) or bool((pos >= c.seq).any()):
            raise ValueError(f"{what}: position_ids must lie in [0, seq = {c.seq}), got values from "
                             f"{int(pos.min())} to {int(pos.max())}")
        out_pos = torch.arange(c.seq, dtype=torch.int64).repeat(c.batch, 1)
        out_pos[:rows, :length] = pos.to(torch.int64)
        if length < c.seq:
            out_pos[:rows, length:] = out_pos[:rows, length - 1:length] + torch.arange(1, c.seq - length + 1)
        return out_ids, out_lab, out_pos, out_mask

    # -- training ------------------------------------------------------------------------------------------
    def step(self, input_ids, labels=None, attention_mask=None, position_ids=None, *, ref_logps=None,
             advantages=None, old_logps=None) -> StepResult:
        """One optimizer step over [batch, seq] (micro_batch x accumulation sequences); labels default to
        input_ids. The loss is the mean over every valid token of the batch. position_ids: rows that pack
        documents, each counting from 0 where it starts (transformers' packed position_ids,
        DataCollatorWithFlattening's): a token attends only within its document; needs
        EngineConfig.packed_documents.

        With an objective past sft (EngineConfig.objective), as TRL 1.16 defines it:
        dpo, simpo, orpo: the rows are N chosen sequences followed by their N rejected ones (TRL's
        concatenated order), the prompt's labels -100; dpo takes ref_logps, [rows]: each row's log-probability
        sum under the reference model (engine.logprobs(..., reference=True): LoRA's frozen base, or with
        keep_reference the starting weights). grpo: advantages [rows], old_logps [rows, length - 1] (the sampling policy's per-token
        log-probabilities, as logprobs(per_token=True) gives them; None: on-policy) and, with beta > 0,
        ref_logps [rows, length - 1]. The result's metrics hold TRL's figures."""
        ids, lab, pos, mask = self._prepare("step", input_ids, labels, attention_mask, position_ids)
        extra = objective_step_args(self.config, input_ids, ref_logps, advantages, old_logps)
        self.last_result = StepResult.from_report(*self._engine.step(ids, lab, pos, mask, **extra))
        return self.last_result

    def evaluate(self, input_ids, labels=None, attention_mask=None, position_ids=None, *, ref_logps=None,
                 advantages=None, old_logps=None) -> float:
        """The loss of the current weights on one batch, without a gradient or an update: the mean cross-entropy
        over its valid tokens, or with an objective past SFT (EngineConfig.objective) that objective's loss as
        step() would report it, taking step()'s rows and inputs (ref_logps, advantages, old_logps);
        last_eval_metrics then holds its figures under TRL's names (rewards/accuracies, ...)."""
        ids, lab, pos, mask = self._prepare("evaluate", input_ids, labels, attention_mask, position_ids)
        if self.config.objective == "sft":
            objective_step_args(self.config, input_ids, ref_logps, advantages, old_logps)  # refuses any given
            return float(self._engine.evaluate(ids, lab, pos, mask))
        extra = objective_step_args(self.config, input_ids, ref_logps, advantages, old_logps)
        loss, metrics = self._engine.evaluate_objective(ids, lab, pos, mask, **extra)
        self.last_eval_metrics = dict(metrics)
        return float(loss)

    @torch.no_grad()
    def logprobs(self, input_ids, labels=None, attention_mask=None, position_ids=None,
                 per_token: bool = False, reference: bool = False) -> torch.Tensor:
        """Log-probabilities of the labels under the current weights, without a gradient or an update, as
        the engine's streamed head computes them (fp32 log-sum-exp over the vocabulary): per row, the sum
        over its targets (labels != -100 where attention_mask is 1, shifted inside as transformers shifts
        them) of log p(label | prefix), float32 [rows]; per_token=True: [rows, length - 1], 0 where the
        target is -100 or padding. Arguments as evaluate's; a row without a target sums to 0. TRL's DPO
        and GRPO take these sums and per-token values. reference=True: under the reference model, which for
        a PEFT LoRA model is its frozen base (as under PEFT's disable_adapter()), refused with modules_to_save
        (their starting values are not kept); in full fine-tuning the starting weights, from the frozen copy
        EngineConfig(keep_reference=True) keeps (in RAM and in every checkpoint), refused without it."""
        ids, lab, pos, mask = self._prepare("logprobs", input_ids, labels, attention_mask, position_ids)
        shape = torch.as_tensor(input_ids).shape  # _prepare took it: [length] or [rows, length]
        rows, length = (1, shape[0]) if len(shape) == 1 else shape
        tokens = self._engine.logprobs(ids, lab, pos, mask, reference)[:rows, :length - 1]
        return tokens.clone() if per_token else tokens.sum(dim=1)

    # -- weights ---------------------------------------------------------------------------------------------
    def param_names(self):
        return list(self._names)

    def param(self, name: str) -> torch.Tensor:
        """The fp32 master of one parameter, after every pending update."""
        self._engine.finish()
        return self._engine.param(name)

    def plan(self) -> dict:
        """The plan this engine runs by (strider.plan of its model and config): the window it chose for
        window 0, token_tile, kept activations, device and host bytes, and `why`."""
        return plan(json.loads(self._model_config_json), self.config)

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken (a resumed engine counts the saved run's)."""
        return int(self._engine.steps_done())

    def is_aliased(self, name: str) -> bool:
        """Whether the model's parameter `name` is (still) a view of the engine's compute copy (never for a
        base held quantized)."""
        if self._engine.held_quantized(name):
            return False
        p = self._params()[name]
        return p.data_ptr() == self._engine.compute_view(name).data_ptr() and \
            p.dtype == self.compute_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.config.dtype]

    @torch.no_grad()
    def sync_to_model(self):
        """Waits for pending updates, after which the model's parameters (the engine's compute copy) hold
        the trained weights. Returns the model. A parameter rebound away from the engine since (e.g. by
        model.to(dtype)) gets the trained fp32 master copied in, cast to its dtype."""
        self._engine.finish()
        for name, p in self._params().items():
            if name in self._released and p.numel() == 0:
                p.data = self._engine.param(name).to(self._released[name])
            elif not self.is_aliased(name):
                p.copy_(self._engine.param(name).to(p.dtype))
        return self.model

    # -- training state -----------------------------------------------------------------------------------
    def save(self, path, extra: Optional[dict] = None, write_model: bool = True) -> str:
        """Saves the full training state into directory `path` (engine/checkpoint/train_checkpoint.h, published
        atomically; an existing checkpoint there is replaced): every fp32 master, Adam m and v, the step
        count, the model and engine configs and `extra` (any JSON-serialisable dict of your own, e.g. the
        data position; Engine.resume gives it back). With write_model, also config.json and
        model.safetensors (the compute dtype) that from_pretrained loads. A PEFT LoRA model's checkpoint holds
        the trained tensors' state and the frozen base's fingerprint only, and with write_model the adapter
        (adapter_config.json, adapter_model.safetensors: PeftModel.from_pretrained loads it). Waits for
        pending updates."""
        path = os.fspath(path)
        try:
            extra_json = json.dumps({} if extra is None else extra)
        except (TypeError, ValueError) as e:
            raise ValueError(f"Engine.save: extra must be JSON-serialisable: {e}") from e
        self._engine.save_checkpoint(path, self._model_config_json, extra_json, bool(write_model), self._base_model)
        return path

    def load(self, path, allow_changed: Sequence[str] = (), verify_checksums: bool = True):
        """Loads a training checkpoint into this engine (masters, m, v, step count), so that the model's
        parameters hold the checkpoint's weights; returns its `extra`. Validated first (model, maths
        config unless named in allow_changed, every tensor and checksum): a refusal is a ValueError
        naming the file and field, and changes nothing."""
        extra = self._load(path, allow_changed, verify_checksums)
        self.last_result = None
        if verify_checksums:
            # The state loaded is checked; the model copy beside it is only exported, so it is reported.
            for problem in inspect_checkpoint(path)["model_problems"]:
                warnings.warn(f"the exportable model in {os.fspath(path)} is damaged: {problem}; the training "
                              "state is intact and loaded, and the next save writes a new copy")
        return extra

    def _load(self, path, allow_changed, verify_checksums):
        return json.loads(self._engine.load_checkpoint(os.fspath(path), [str(f) for f in allow_changed],
                                                       bool(verify_checksums)))

    def trace(self, path) -> str:
        """Writes the timeline so far as Chrome trace JSON (Perfetto, chrome://tracing opens it)."""
        self._engine.write_trace(str(path))
        return str(path)

    def finish(self):
        """Waits for every pending optimizer update. A base held quantized (EngineConfig.base_format) is put
        back into the model: its released tensors get their dequantized values, in their own dtype. A
        parameter rebound away from the engine's compute copy (model.to(dtype) during training) gets the
        trained fp32 master, cast to its dtype, as sync_to_model gives it: the model never keeps weights
        older than the engine's."""
        self._engine.finish()
        if self._released or not all(self.is_aliased(name) for name in self._names):
            self.sync_to_model()
