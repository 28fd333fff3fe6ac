"""strider.StriderTrainer: `transformers.Trainer` whose optimizer steps run on strider.

    args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=500,
                             learning_rate=1e-5, lr_scheduler_type="cosine", warmup_steps=20, report_to=[])
    trainer = strider.StriderTrainer(model=model, args=args, train_dataset=ds, data_collator=collator, seq=1024)
    trainer = strider.StriderTrainer(model=model, args=args, train_dataset="train.tokens", seq=1024)
    trainer.train()
    trainer.save_model("finetuned")          # the trained weights (the model's parameters are strider's)
    trainer.train(resume_from_checkpoint=True)   # a later run: continues from the last checkpoint-N

Every batch the Trainer's dataloader yields is one optimizer step: one
`engine.step(input_ids, labels, attention_mask)` over [micro_batch x
accumulation, seq]. The Trainer keeps its loop, callbacks, logging,
evaluation and checkpoint schedule; what it would do to the weights is
replaced:

- training_step runs engine.step and returns its loss (the Trainer logs it as
  usual); grad_norm and learning_rate in the logs are the engine's, and in
  fp16 (fp16=True, or EngineConfig(dtype="fp16")) so is loss_scale: the
  engine scales the loss itself (GradScaler's rule), so the Trainer's own
  scaler never runs.
- The Trainer's optimizer holds one private scalar, never a model parameter,
  and its step does nothing, so neither it nor its scheduler can touch the
  weights. The learning-rate schedule is strider's (EngineConfig).
- The model stays on the CPU (strider streams blocks to the GPU itself): the
  Trainer's and accelerate's device placement are switched off.
- evaluate() is the mean loss over every valid token of the eval set,
  computed by engine.evaluate.
- The model's parameters are the engine's compute copy (strider.Engine
  rebinds them, in the compute dtype), so save_model() and checkpoints only
  wait for pending updates (engine.finish()) before save_pretrained writes
  the trained weights.
- Checkpoints: each checkpoint-N folder holds, besides the Trainer's files,
  strider's full training state in checkpoint-N/strider/ (fp32 masters, Adam
  m and v, step count: engine.save) in place of optimizer.pt.
  train(resume_from_checkpoint=path or True) loads it into the engine
  (engine.load) and the Trainer skips the batches already seen, so the run
  continues bit-identically. Resuming may change max_steps (the schedule's
  total_steps), with a warning under a linear or cosine schedule, whose
  decay it moves (`strider finetune --resume` asks for --allow-changed
  total_steps); any other change to the maths of the run is refused.
- Skipped steps: a step the numerics guard skips (non-finite loss or
  gradient) logs NaN, which the Trainer leaves out of its logged loss;
  max_skipped_steps of them in a row (default 3, as `strider finetune
  --max-skipped-steps`) stop the run with the reason. A batch without
  targets is skipped without counting, and so is an fp16 overflow (the
  engine's loss scale backs off; EngineConfig(dtype="fp16")). save_only_model=True checkpoints hold no
  strider state and cannot be resumed.
- A PEFT LoRA model (peft.get_peft_model) trains its adapters over its frozen
  base (strider.Engine takes it in place): save_model() and checkpoint-N
  folders hold the adapter PEFT saves, and checkpoint-N/strider/ the
  adapters' state and the base's fingerprint; a resume over another base is
  refused.

Data: any dataset the Trainer takes whose rows hold input_ids (and labels,
attention_mask, position_ids), or a token file (`python -m strider.data`
writes one): its path as train_dataset or eval_dataset is read as
strider.data.TokenDataset, windows of the engine's seq tokens. Rows that
pack documents (position_ids restarting, as TokenDataset's and
DataCollatorWithFlattening's do) keep each document's attention to itself;
the config the trainer builds sets packed_documents for them (a TokenDataset
whose documents start inside windows, or that collator).

The engine's config: pass `strider_config` (an EngineConfig), or let the
trainer build one from TrainingArguments (learning_rate, lr_scheduler_type
linear/cosine/constant/constant_with_warmup, warmup_steps, max_steps or the
epochs' step count, weight_decay, adam_beta1/2, adam_epsilon, max_grad_norm,
bf16 or fp16; per_device_train_batch_size is the micro-batch and
gradient_accumulation_steps the accumulation: the Trainer's micro-batches of
one optimizer step run as one engine step, its loss the mean over every valid
token of them) plus `seq`. With a strider_config, an argument set away from its
TrainingArguments default to something other than the config's value is
refused, as is anything strider cannot honour (several GPUs, optimizers other
than AdamW, load_best_model_at_end) and every
argument that changes a step's maths in a way strider's step does not
(label_smoothing_factor, neftune_noise_alpha, lr_scheduler_kwargs, optim_args,
optim_target_modules, bf16_full_eval, fp16_full_eval): MATHS_FIELDS lists
what is honoured and what is refused.
strider's weight decay spares norms and biases, as the Trainer's own AdamW
does (EngineConfig.decay_norms_and_biases=True decays them too).
"""
import dataclasses
import math
import os
import warnings
from typing import Optional

import torch
import transformers

from strider.config import EngineConfig
from strider.data import TokenDataset
from strider.engine import IGNORE_INDEX, Engine, inspect_checkpoint

# lr_scheduler_type -> (strider schedule, whether the Trainer's schedule warms up).
_SCHEDULES = {"linear": ("linear", True), "cosine": ("cosine", True), "constant": ("constant", False),
              "constant_with_warmup": ("constant", True)}
_ADAMW = ("adamw_torch", "adamw_torch_fused")
# The TrainingArguments fields that change the maths of a training or evaluation step: each is either
# honoured (the engine's config is built from it, or a given config must agree with it) or refused by
# name when set away from what strider does. tests/python/test_trainer.py checks both halves.
MATHS_FIELDS = {
    "honoured": ("learning_rate", "lr_scheduler_type", "warmup_steps", "max_steps",
                 "num_train_epochs", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
                 "max_grad_norm", "bf16", "fp16", "per_device_train_batch_size", "gradient_accumulation_steps",
                 "optim"),
    "refused": ("label_smoothing_factor", "neftune_noise_alpha",
                "lr_scheduler_kwargs", "optim_args", "optim_target_modules", "bf16_full_eval",
                "fp16_full_eval", "auto_find_batch_size"),
}
_BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
STATE_DIR = "strider"  # strider's training state inside a checkpoint-N folder
# Resuming may extend or shorten the run (the Trainer rebuilds its schedule from max_steps too).
_RESUME_MAY_CHANGE = ("total_steps",)


def _name(value) -> str:
    return str(getattr(value, "value", value))


class _NoUpdate(torch.optim.Optimizer):
    """The Trainer's optimizer slot. Its only parameter is a private scalar, so zero_grad, step and a
    scheduler act on nothing the model owns; strider's optimizer updates the weights."""

    def __init__(self, lr: float):
        super().__init__([torch.zeros(1, requires_grad=True)], dict(lr=lr))

    def step(self, closure=None):
        return None


class StriderTrainer(transformers.Trainer):
    """transformers.Trainer with strider doing every forward, backward and optimizer step."""

    def __init__(self, model=None, args=None, *, strider_config: Optional[EngineConfig] = None,
                 seq: Optional[int] = None, max_skipped_steps: int = 3, **kwargs):
        if model is None:
            raise ValueError("StriderTrainer needs model= (model_init is not supported: the engine is built "
                             "from the model once)")
        if args is None:
            raise ValueError("StriderTrainer needs args= (a TrainingArguments)")
        if kwargs.get("optimizers", (None, None)) != (None, None) or kwargs.get("optimizer_cls_and_kwargs"):
            raise ValueError("StriderTrainer: strider runs the optimizer (AdamW on fp32 masters); do not pass "
                             "optimizers= / optimizer_cls_and_kwargs=, set the EngineConfig instead")
        if strider_config is not None and not isinstance(strider_config, EngineConfig):
            raise TypeError(f"StriderTrainer: strider_config must be a strider.EngineConfig, got "
                            f"{type(strider_config).__name__}")
        self._check_args(args)
        if isinstance(max_skipped_steps, bool) or not isinstance(max_skipped_steps, int) or max_skipped_steps < 1:
            raise ValueError(f"StriderTrainer: max_skipped_steps = {max_skipped_steps!r}: expected an int >= 1")
        # As `strider finetune --max-skipped-steps`: that many steps in a row skipped by the numerics guard
        # stop the run; a batch without targets is not a fault and does not count.
        self.max_skipped_steps = max_skipped_steps
        self._skipped_in_a_row = 0
        self.engine = None
        for key in ("train_dataset", "eval_dataset"):  # a token file's path: its windows of the engine's seq
            if isinstance(kwargs.get(key), (str, os.PathLike)):
                window = strider_config.seq if strider_config is not None else seq
                if window is None:
                    raise ValueError(f"StriderTrainer: {key} = {str(kwargs[key])!r} is a token file; pass seq= "
                                     "(or a strider_config) to cut it into sequences")
                kwargs[key] = TokenDataset(kwargs[key], window)
        super().__init__(model=model, args=args, **kwargs)
        self.place_model_on_device = False
        config = self._config_from_args(strider_config, seq)
        # per_device_eval_batch_size may be larger than the engine's batch: evaluate() runs an eval batch in as
        # many engine batches as it needs.
        self.engine = Engine(model, config)

    # -- what strider cannot honour --------------------------------------------------------------------
    @staticmethod
    def _check_args(args):
        def refuse(what):
            raise ValueError(f"StriderTrainer: {what}")

        if args.place_model_on_device:
            refuse("place_model_on_device is True: strider keeps the model on the CPU and streams its blocks "
                   "to the GPU itself")
        if args.n_gpu > 1 or args.world_size > 1:
            refuse(f"n_gpu = {args.n_gpu}, world_size = {args.world_size}: strider trains on one device; run "
                   "one process with CUDA_VISIBLE_DEVICES naming one GPU")
        if _name(args.optim) not in _ADAMW:
            refuse(f"optim = {_name(args.optim)!r}: strider's optimizer is AdamW on fp32 masters "
                   f"(optim {' or '.join(_ADAMW)}; EngineConfig.optimizer picks adamw or adam)")
        if args.auto_find_batch_size:
            refuse("auto_find_batch_size = True: the batch is fixed by the engine's config")
        # What changes the maths of a step that strider's step does not do: refused by name, never ignored.
        # (The fields the config is built from are checked in _config_from_args; MATHS_FIELDS lists both.)
        if args.label_smoothing_factor:
            refuse(f"label_smoothing_factor = {args.label_smoothing_factor}: strider's loss is the plain "
                   "cross-entropy over the labels (its head computes it block by block, not from the "
                   "Trainer's logits); set it to 0")
        if args.neftune_noise_alpha is not None:
            refuse(f"neftune_noise_alpha = {args.neftune_noise_alpha}: strider adds no noise to the "
                   "embeddings; leave it None")
        if args.lr_scheduler_kwargs:
            refuse(f"lr_scheduler_kwargs = {args.lr_scheduler_kwargs!r}: strider's schedules take no extra "
                   "arguments (EngineConfig.schedule, warmup_steps, total_steps)")
        if args.optim_args:
            refuse(f"optim_args = {args.optim_args!r}: strider's AdamW takes lr, betas, eps and weight_decay "
                   "from their own arguments")
        if args.optim_target_modules is not None:
            refuse(f"optim_target_modules = {args.optim_target_modules!r}: strider updates every trained "
                   "parameter with AdamW")
        for flag in ("bf16_full_eval", "fp16_full_eval"):
            if getattr(args, flag):
                refuse(f"{flag} = True: strider evaluates in the engine's compute dtype "
                       "(EngineConfig.dtype), as it trains")
        if args.load_best_model_at_end:
            refuse("load_best_model_at_end = True is not supported; the best checkpoint's folder "
                   "(trainer.state.best_model_checkpoint) loads with from_pretrained, or into an engine "
                   "with engine.load(<checkpoint>/strider)")

    def _config_from_args(self, given: Optional[EngineConfig], seq: Optional[int]) -> EngineConfig:
        args = self.args
        defaults = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)}
        kind = _name(args.lr_scheduler_type)
        if given is None:
            if seq is None:
                raise ValueError("StriderTrainer: pass seq= (the tokens per sequence the engine is built for) "
                                 "or a strider_config")
            if kind not in _SCHEDULES:
                raise ValueError(f"StriderTrainer: lr_scheduler_type = {kind!r}: strider schedules are "
                                 f"{', '.join(_SCHEDULES)}")
            schedule, warms_up = _SCHEDULES[kind]
            total = self._total_steps()
            if schedule != "constant" and total <= 0:
                raise ValueError(f"StriderTrainer: {self._no_last_step(kind)}")
            warmup = args.get_warmup_steps(max(total, 0)) if warms_up else 0
            return EngineConfig(seq=seq, micro_batch=self._rows(args.per_device_train_batch_size),
                                accumulation=args.gradient_accumulation_steps,
                                dtype="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
                                lr=args.learning_rate,
                                schedule=schedule, warmup_steps=warmup,
                                total_steps=total if schedule != "constant" else 0,
                                weight_decay=args.weight_decay, clip_norm=args.max_grad_norm,
                                betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                packed_documents=self._packs_documents(), device="cpu" if args.use_cpu else "auto",
                                **self._objective_fields())
        given.validate()
        if not given.packed_documents and self._packs_documents():
            raise ValueError("StriderTrainer: the data packs several documents in a sequence (a token file's "
                             "documents start inside its windows, or DataCollatorWithFlattening), but "
                             "strider_config.packed_documents is False; set it to True so that each document "
                             "attends only to itself (as transformers does with packed position_ids)")
        if seq is not None and seq != given.seq:
            raise ValueError(f"StriderTrainer: seq = {seq} but strider_config.seq = {given.seq}; give one")
        step_rows = self._rows(args.per_device_train_batch_size) * args.gradient_accumulation_steps
        if step_rows != given.batch:
            raise ValueError(f"StriderTrainer: per_device_train_batch_size x gradient_accumulation_steps = "
                             f"{args.per_device_train_batch_size} x {args.gradient_accumulation_steps} "
                             f"({step_rows} sequences a step), but one strider step takes micro_batch x "
                             f"accumulation = {given.micro_batch} x {given.accumulation} = {given.batch} sequences; "
                             "make them equal")
        # The config owns the optimizer and schedule; an argument moved off its default to another value
        # is a second, contradicting answer.
        mapped = dict(learning_rate=given.lr, weight_decay=given.weight_decay, max_grad_norm=given.clip_norm,
                      adam_beta1=given.betas[0], adam_beta2=given.betas[1], adam_epsilon=given.eps)
        for name, want in mapped.items():
            have = getattr(args, name)
            if have != defaults[name] and have != want:
                field = {"learning_rate": "lr", "max_grad_norm": "clip_norm", "adam_epsilon": "eps"}.get(
                    name, "betas" if name.startswith("adam_beta") else name)
                raise ValueError(f"StriderTrainer: TrainingArguments.{name} = {have} but the strider config's "
                                 f"{field} is {want}; the config decides, so drop the argument or make them equal")
        for flag in ("bf16", "fp16"):
            if getattr(args, flag) and given.dtype != flag:
                raise ValueError(f"StriderTrainer: {flag} = True but strider_config.dtype = {given.dtype!r}")
        if kind != _name(defaults["lr_scheduler_type"]) and _SCHEDULES.get(kind, (None,))[0] != given.schedule:
            raise ValueError(f"StriderTrainer: lr_scheduler_type = {kind!r} but strider_config.schedule = "
                             f"{given.schedule!r}; the config decides")
        if args.warmup_steps != defaults["warmup_steps"] and given.schedule != "constant" and \
                args.get_warmup_steps(given.total_steps) != given.warmup_steps:
            raise ValueError(f"StriderTrainer: warmup_steps = {args.warmup_steps} but strider_config."
                             f"warmup_steps = {given.warmup_steps}; the config decides")
        return given

    # -- what a subclass for another objective changes (strider.dpo_trainer) -------------------------------
    def _rows(self, batch_size: int) -> int:
        """The sequences a batch of `batch_size` (TrainingArguments' per-device batch size) holds."""
        return batch_size

    def _objective_fields(self) -> dict:
        """The EngineConfig fields of the objective, for a config built from the arguments."""
        return {}

    def _engine_step(self, inputs):
        """One engine step on a batch of the train dataloader."""
        return self.engine.step(*self._batch(inputs, "train"))

    def _packs_documents(self) -> bool:
        """Whether the batches will pack documents in rows (position_ids that restart): a TokenDataset whose
        documents start inside its windows, or transformers' DataCollatorWithFlattening."""
        data = [d for d in (self.train_dataset, self.eval_dataset) if isinstance(d, TokenDataset)]
        flattening = getattr(transformers, "DataCollatorWithFlattening", None)
        return any(d.packs_documents for d in data) or (
            flattening is not None and isinstance(self.data_collator, flattening))

    def _no_last_step(self, kind) -> str:
        """Why the run's step count, which a decaying schedule needs, is not known or not positive."""
        args = self.args
        if args.max_steps <= 0 and args.num_train_epochs <= 0:
            return (f"num_train_epochs = {args.num_train_epochs} and max_steps = {args.max_steps}: the run has no "
                    "step to train; set max_steps or num_train_epochs above 0")
        try:
            rows = len(self.train_dataset)
        except TypeError:
            return (f"lr_scheduler_type {kind!r} decays to 0 at the last step, which is unknown: the "
                    f"train_dataset ({type(self.train_dataset).__name__}) has no length; set max_steps")
        if rows == 0:
            return "the train_dataset has no rows: there is no step to train"
        return (f"num_train_epochs = {args.num_train_epochs} of {rows} rows at per_device_train_batch_size = "
                f"{args.per_device_train_batch_size} is no whole step; set max_steps or more epochs")

    def _total_steps(self) -> int:
        """Optimizer steps of the whole run, as the Trainer will count them (0: unknown)."""
        args = self.args
        if args.max_steps > 0:
            return args.max_steps
        try:
            rows = len(self.train_dataset)
        except TypeError:
            return 0
        batches = rows // args.per_device_train_batch_size if args.dataloader_drop_last \
            else math.ceil(rows / args.per_device_train_batch_size)
        per_epoch = max(math.ceil(batches / args.gradient_accumulation_steps), 1)  # the Trainer's count
        return math.ceil(args.num_train_epochs * per_epoch)

    # -- placement: the model stays on the CPU ---------------------------------------------------------
    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        # accelerate.prepare would move the model (and batches) to the GPU; strider streams the weights.
        self.accelerator.device_placement = False

    def _move_model_to_device(self, model, device):
        return None

    # -- the optimizer step ------------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = _NoUpdate(self.engine.config.lr)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, lambda _: 1.0)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _batch(self, inputs, what):
        extra = sorted(set(inputs) - set(_BATCH_KEYS))
        if extra or "input_ids" not in inputs:
            raise ValueError(f"StriderTrainer.{what}: strider takes batches of {', '.join(_BATCH_KEYS)} "
                             f"(input_ids required); this one has {sorted(inputs)}")
        return tuple(None if inputs.get(k) is None else torch.as_tensor(inputs[k]).cpu() for k in _BATCH_KEYS)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The Trainer's batches for one optimizer step (gradient_accumulation_steps of them, fewer at an
        epoch's end): kept, so that the step's first training_step runs them as one engine step."""
        samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._step_batches = list(samples)
        return samples, num_items

    def _merged(self, batches):
        """The step's batches as one, each padded on the right to the longest (labels -100, mask 0)."""
        if len(batches) == 1:
            return batches[0]
        length = max(torch.as_tensor(b["input_ids"]).shape[-1] for b in batches)
        fill = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0}
        out = {}
        for key in batches[0]:
            parts = []
            for b in batches:
                t = torch.as_tensor(b[key])
                pad = length - t.shape[-1]
                if pad and key == "position_ids":  # positions go on counting
                    t = torch.cat([t, t[:, -1:] + torch.arange(1, pad + 1)], dim=1)
                elif pad:
                    t = torch.nn.functional.pad(t, (0, pad), value=fill.get(key, 0))
                parts.append(t)
            out[key] = torch.cat(parts)
        if "attention_mask" not in out:  # a batch without a mask: its padding is what the merge added
            out["attention_mask"] = torch.cat([torch.nn.functional.pad(
                torch.ones_like(torch.as_tensor(b["input_ids"])),
                (0, length - torch.as_tensor(b["input_ids"]).shape[-1])) for b in batches])
        return out

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.args.gradient_accumulation_steps > 1:
            # The Trainer calls this once per micro-batch; strider's step takes them all at once (its own
            # accumulation, its loss the mean over every valid token of them), on the first call. The others
            # add nothing to the logged loss.
            batches = getattr(self, "_step_batches", None)
            if batches is not None and not batches:  # a later micro-batch of a step already run
                return torch.tensor(0.0, device=self.args.device)
            if batches is not None:  # None: called outside the Trainer's loop, on this batch alone
                self._step_batches = []
                inputs = self._merged(batches)
        result = self._engine_step(inputs)
        # fp16's overflow (the loss scale backed off) is not a divergence, as in `strider finetune`.
        if result.skipped and not result.no_targets and not result.overflow:
            self._skipped_in_a_row += 1
            if self._skipped_in_a_row >= self.max_skipped_steps:
                where = (f"; first non-finite gradient: block {result.nonfinite_block} ({result.nonfinite_tensor})"
                         if result.nonfinite_block >= 0 else "")
                raise RuntimeError(
                    f"StriderTrainer: the run diverged: {self._skipped_in_a_row} steps in a row were skipped "
                    f"(max_skipped_steps {self.max_skipped_steps}), the last because the {result.skip_reason}"
                    f"{where}; the model stays at strider step {result.step}. Lower learning_rate (or raise "
                    "warmup_steps) and resume from the last checkpoint")
        elif not result.skipped:
            self._skipped_in_a_row = 0
        # A skipped step's loss is NaN (a batch without targets has none at all): the Trainer leaves it out
        # of the logged mean (logging_nan_inf_filter).
        loss = float("nan") if result.loss is None else result.loss
        return torch.tensor(loss, device=self.args.device)

    def log(self, logs, *args, **kwargs):
        last = self.engine.last_result if self.engine is not None else None
        if last is not None and "loss" in logs and self.engine.config.dtype == "fp16":
            logs = {**logs, "loss_scale": last.loss_scale}
        return super().log(logs, *args, **kwargs)

    def _clip_grad_norm(self, model):
        return self.engine.last_result.grad_norm  # strider clipped at clip_norm inside the step

    def _get_grad_norm(self, model, grad_norm=None):
        return self.engine.last_result.grad_norm if grad_norm is None else grad_norm

    def _get_learning_rate(self):
        last = self.engine.last_result
        return self.engine.config.lr if last is None else last.lr

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        if trial is not None:
            raise ValueError("StriderTrainer: hyperparameter search is not supported (one engine per trainer)")
        # fp16 on a GPU: accelerate makes a GradScaler, and its step would unscale the placeholder optimizer,
        # which no loss it scaled reached ("Attempted step but _scale is None"). The engine scales its own
        # loss, so the Trainer's scaler goes before the Trainer wraps the optimizer with it.
        self.accelerator.scaler = None
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    # -- evaluation ------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Mean loss over every valid token of the eval set (engine.evaluate on each batch); a token file's
        path is read as TokenDataset windows of the engine's seq."""
        if isinstance(eval_dataset, (str, os.PathLike)):
            eval_dataset = TokenDataset(eval_dataset, self.engine.config.seq)
        total, valid = 0.0, 0
        rows = self.engine.config.batch  # an eval batch of more rows runs in several engine batches
        for inputs in self.get_eval_dataloader(eval_dataset):
            batch = self._batch(inputs, "evaluate")
            for at in range(0, batch[0].shape[0], rows):
                ids, labels, mask, positions = (None if t is None else t[at:at + rows] for t in batch)
                lab = (ids if labels is None else labels).clone()
                if mask is not None:
                    lab[mask == 0] = IGNORE_INDEX
                n = int((lab[..., 1:] != IGNORE_INDEX).sum())
                if n:
                    total += self.engine.evaluate(ids, labels, mask, positions) * n
                    valid += n
        metrics = {f"{metric_key_prefix}_loss": total / valid if valid else float("nan")}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # -- saving --------------------------------------------------------------------------------------------
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False):
        if self.engine is not None:
            # The parameters are the engine's compute copy: the last updates may still be running.
            self.engine.sync_to_model()
        super().save_model(output_dir, _internal_call=_internal_call)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self.engine.finish()  # predict() runs the model itself, on the engine's weights
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _save_optimizer_and_scheduler(self, output_dir):
        # In place of optimizer.pt (the Trainer's optimizer is a placeholder): strider's full state.
        self.engine.save(os.path.join(output_dir, STATE_DIR), extra={"global_step": self.state.global_step},
                         write_model=False)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Resuming: strider's state (weights included) from checkpoint-N/strider/; the model's own files
        in the folder are the same weights and are not read."""
        state = os.path.join(resume_from_checkpoint, STATE_DIR)
        if not os.path.isdir(state) and not os.path.isdir(state + ".old"):
            raise ValueError(f"StriderTrainer: {resume_from_checkpoint} holds no strider training state "
                             f"({state} is missing): it was not written by a StriderTrainer, or with "
                             "save_only_model=True; resume from a checkpoint a StriderTrainer saved, or start "
                             "a new run from its weights (from_pretrained)")
        # Checked before loading, so a refusal changes nothing.
        info = inspect_checkpoint(state)
        # The Trainer's global_step counts skipped steps too (a batch without targets, a non-finite loss),
        # strider's step count does not: the state records the global_step it was saved at.
        saved_step = info["extra"].get("global_step", info["step"])
        hf_state = os.path.join(resume_from_checkpoint, transformers.trainer.TRAINER_STATE_NAME)
        if os.path.isfile(hf_state):
            step = transformers.TrainerState.load_from_json(hf_state).global_step
            if step != saved_step:
                raise ValueError(f"StriderTrainer: {hf_state} says global_step {step} but {state} was saved at "
                                 f"global_step {saved_step}; the checkpoint folder mixes two runs")
        self.engine.load(state, allow_changed=_RESUME_MAY_CHANGE)
        was, now = info["engine_config"].get("total_steps"), self.engine.config.total_steps
        if was != now and self.engine.config.schedule != "constant":
            # As `strider finetune --resume` says it (which asks for --allow-changed total_steps).
            warnings.warn(f"StriderTrainer: the run saved in {state} decayed its {self.engine.config.schedule} "
                          f"learning rate to 0 at step {was}; max_steps now makes that {now}, which changes the "
                          "learning rate of every step from here on")

    def _load_optimizer_and_scheduler(self, checkpoint):
        return None  # _load_from_checkpoint loaded strider's optimizer state; the placeholders hold none
