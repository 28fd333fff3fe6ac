"""strider.StriderDPOTrainer: TRL's DPOTrainer, its arguments and its data, with strider doing every step.

    args = trl.DPOConfig(output_dir="out", per_device_train_batch_size=4, max_steps=500, learning_rate=5e-7,
                         beta=0.1, max_length=1024, report_to=[])
    trainer = strider.StriderDPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer)
    trainer.train()
    trainer.train(resume_from_checkpoint=True)   # a later run: continues from the last checkpoint-N

Why a trainer of its own rather than StriderTrainer taking a DPOConfig: a TRL user's code is
`DPOTrainer(model, args=DPOConfig(...), train_dataset=..., processing_class=...)`, and this is that line with
one name changed. The data is TRL's too: the dataset (prompt/chosen/rejected, as text or as conversations,
an implicit prompt split off) is tokenized by TRL's own DPOTrainer code and batched by TRL's
DataCollatorForPreference (chosen rows, then their rejected rows), so the sequences strider trains on are the
ones TRL would. What differs is where the step runs (strider.Engine, EngineConfig(objective="dpo"), which
is TRL 1.16's loss: docs/objectives.md) and the reference:

- The reference log-probabilities are always precomputed before the first step (TRL's
  precompute_ref_log_probs): under the model's starting weights, or for a PEFT LoRA model under its frozen
  base (its adapters disabled). They are the same numbers TRL's reference model gives, and no second copy of
  the weights is made. Each checkpoint-N/strider/ folder holds them (reference_logps.pt, keyed by the
  tokenized pairs' hash), and a resume takes them from there: never recomputed from trained
  weights, refused when missing or made for other data.
- per_device_train_batch_size counts pairs, as in TRL: a step is 2 x that many sequences, and the engine's
  batch is built for it (micro_batch; pass a strider_config to split it into accumulation).
- The logs carry TRL's names (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
  logps/chosen, logps/rejected),
  averaged over each logging interval as TRL averages them.

Refused by name, as anything strider does not do: loss types other than sigmoid, ipo, hinge and robust,
several loss types, f-divergences other than reverse KL, ld_alpha, use_weighting, sync_ref_model, a
ref_model, padding_free and router_aux_loss_coef (strider takes the model config's). An eval_dataset is
evaluated as TRL evaluates it (eval_loss and eval_rewards/*, each the mean over the eval batches), its
reference precomputed with the training set's and kept in each checkpoint.
"""
import hashlib
import os
from typing import Optional

import torch

from strider.config import EngineConfig
from strider.preference_data import pair_collator, tokenize_pairs
from strider.trainer import STATE_DIR, StriderTrainer

REFERENCE_FILE = "reference_logps.pt"  # inside checkpoint-N/strider/
_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected")


def _check_dpo_args(args):
    import trl

    def refuse(what):
        raise ValueError(f"StriderDPOTrainer: {what}")

    if not isinstance(args, trl.DPOConfig):
        refuse(f"args must be a trl.DPOConfig, got {type(args).__name__}")
    losses = list(args.loss_type) if isinstance(args.loss_type, (list, tuple)) else [args.loss_type]
    if len(losses) != 1 or losses[0] not in _LOSS_TYPES:
        refuse(f"loss_type = {args.loss_type!r}: strider's DPO takes one of {', '.join(_LOSS_TYPES)}")
    if args.loss_weights is not None:
        refuse(f"loss_weights = {args.loss_weights!r}: strider's DPO takes one loss type, unweighted")
    if args.f_divergence_type != "reverse_kl":
        refuse(f"f_divergence_type = {args.f_divergence_type!r}: strider's DPO is the reverse-KL one")
    if args.ld_alpha is not None:
        refuse(f"ld_alpha = {args.ld_alpha}: length-desensitized DPO is not built")
    if args.use_weighting:
        refuse("use_weighting = True: WPO's weighting is not built")
    if args.sync_ref_model:
        refuse("sync_ref_model = True: strider's reference is the starting weights, precomputed once")
    if args.padding_free:
        refuse("padding_free = True: strider's DPO takes one sequence per row (right padding)")
    if args.router_aux_loss_coef is not None:
        refuse(f"router_aux_loss_coef = {args.router_aux_loss_coef}: strider adds the model config's "
               "router_aux_loss_coef x the load-balancing loss (set it there)")
    return losses[0]


class StriderDPOTrainer(StriderTrainer):
    """trl.DPOTrainer's interface and data on strider.Engine (EngineConfig(objective="dpo"))."""

    def __init__(self, model=None, args=None, train_dataset=None, eval_dataset=None, processing_class=None, *,
                 seq: Optional[int] = None, strider_config: Optional[EngineConfig] = None, **kwargs):
        self._loss_type = _check_dpo_args(args)
        if args is not None and args.gradient_accumulation_steps != 1:
            raise ValueError(f"StriderDPOTrainer: gradient_accumulation_steps = {args.gradient_accumulation_steps} "
                             "is not taken yet: strider accumulates itself; set per_device_train_batch_size to "
                             "the pairs of a whole step (the engine's micro_batch x accumulation / 2) and "
                             "gradient_accumulation_steps = 1")
        if kwargs.get("ref_model") is not None:
            raise ValueError("StriderDPOTrainer: ref_model is not taken: the reference is the model's starting "
                             "weights (a PEFT LoRA model: its frozen base), whose log-probabilities are "
                             "precomputed before the first step")
        kwargs.pop("ref_model", None)
        if processing_class is None:
            raise ValueError("StriderDPOTrainer needs processing_class= (the tokenizer TRL tokenizes the pairs "
                             "with)")
        if train_dataset is None:
            raise ValueError("StriderDPOTrainer needs a train_dataset of prompt/chosen/rejected rows")
        seq = seq if seq is not None else (strider_config.seq if strider_config is not None else args.max_length)
        if seq is None:
            raise ValueError("StriderDPOTrainer: DPOConfig.max_length is None; pass seq= (the tokens per "
                             "sequence the engine is built for)")
        if args.max_length is not None and args.max_length > seq:
            raise ValueError(f"StriderDPOTrainer: max_length = {args.max_length} is more than seq = {seq}")
        tokenized = tokenize_pairs(processing_class, train_dataset, args, "train")
        if eval_dataset is not None:
            eval_dataset = tokenize_pairs(processing_class, eval_dataset, args, "eval")
        collator = pair_collator(processing_class, args.max_length, args.truncation_mode)
        self._metrics = {k: [] for k in _METRICS}
        self._reference = {}  # split -> (chosen, rejected): each pair's reference sums
        self._data_key = {}  # split -> _fingerprint
        super().__init__(model=model, args=args, strider_config=strider_config,
                         seq=None if strider_config is not None else seq, train_dataset=tokenized,
                         eval_dataset=eval_dataset, data_collator=collator, processing_class=processing_class, **kwargs)
        c = self.engine.config
        want = dict(objective="dpo", beta=args.beta, loss_type=self._loss_type,
                    label_smoothing=args.label_smoothing if self._loss_type == "robust" else 0.0)
        have = {k: getattr(c, k) for k in want}
        if have != want:
            raise ValueError(f"StriderDPOTrainer: strider_config's {have} are not the DPOConfig's {want}")

    # -- what differs from StriderTrainer ------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """The DPO loss and TRL's figures over the eval set (engine.evaluate, no update), as trl.DPOTrainer
        logs them: each the mean over the eval batches. The reference is the eval pairs' under the starting
        weights: computed now before the first step, else precomputed when training began."""
        if eval_dataset is not None:
            raise ValueError("StriderDPOTrainer.evaluate: pass the eval set as eval_dataset= when making the "
                             "trainer (its reference log-probabilities are computed under the starting weights)")
        data = self.eval_dataset
        if data is None:
            raise ValueError("StriderDPOTrainer.evaluate: no eval_dataset was given")
        if "ref_chosen_logps" not in data.column_names:
            if self.engine._engine.steps_done() > 0:
                raise ValueError("StriderDPOTrainer.evaluate: the eval set has no reference log-probabilities, and "
                                 "the weights are trained: they are never computed from trained weights")
            self._add_reference(*self._reference_logps(data), split="eval")
        sums = {}
        pairs_at_once = self.engine.config.batch // 2  # an eval batch of more pairs runs in several engine batches
        for inputs in self.get_eval_dataloader(self.eval_dataset):
            ids, mask = inputs["input_ids"].cpu(), inputs["attention_mask"].cpu()
            labels = ids.masked_fill(inputs["completion_mask"].cpu() == 0, -100)
            ref = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]]).float().cpu()
            pairs = ids.shape[0] // 2
            batch = {}  # each figure is a mean over the batch's pairs: the parts' means weighted by their pairs
            for at in range(0, pairs, pairs_at_once):
                rows = [*range(at, min(at + pairs_at_once, pairs)), *range(pairs + at, pairs + min(at + pairs_at_once, pairs))]
                loss = self.engine.evaluate(ids[rows], labels[rows], mask[rows], ref_logps=ref[rows])
                for k, v in {"loss": loss, **self.engine.last_eval_metrics}.items():
                    batch[k] = batch.get(k, 0.0) + v * len(rows) / (2 * pairs)
            for k, v in batch.items():
                if k == "loss" or k in _METRICS:
                    sums.setdefault(k, []).append(v)
        metrics = {f"{metric_key_prefix}_{k}": sum(v) / len(v) for k, v in sums.items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _rows(self, batch_size: int) -> int:
        return 2 * batch_size  # TRL's batch counts pairs: each is a chosen and a rejected sequence

    def _objective_fields(self) -> dict:
        args = self.args
        return dict(objective="dpo", beta=args.beta, loss_type=self._loss_type,
                    label_smoothing=args.label_smoothing if self._loss_type == "robust" else 0.0)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:  # what DataCollatorForPreference reads
            self._signature_columns = ["prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps",
                                       "ref_rejected_logps"]

    def _engine_step(self, inputs):
        if "ref_chosen_logps" not in inputs:
            raise RuntimeError("StriderDPOTrainer: a batch without reference log-probabilities (train() adds "
                               "them before the first step)")
        ids, mask = inputs["input_ids"].cpu(), inputs["attention_mask"].cpu()
        labels = ids.masked_fill(inputs["completion_mask"].cpu() == 0, -100)  # the prompt is no target
        ref = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]]).float().cpu()
        result = self.engine.step(ids, labels, mask, ref_logps=ref)
        for k in _METRICS:
            if k in result.metrics:
                self._metrics[k].append(result.metrics[k])
        return result

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:  # a training log: TRL's figures, averaged over the interval
            for k, values in self._metrics.items():
                if values:
                    logs[k] = sum(values) / len(values)
                values.clear()
        return super().log(logs, *args, **kwargs)

    # -- the reference -------------------------------------------------------------------------------------
    def _reference_logps(self, dataset):
        """Each pair's reference log-probability sums (chosen, rejected), in dataset order, from the engine's
        current weights: the starting ones (a LoRA model: its frozen base, whatever its adapters)."""
        chosen, rejected = [], []
        pairs = self.engine.config.batch // 2
        lora = bool(self.engine.config.lora) or hasattr(self.model, "peft_config")
        for start in range(0, len(dataset), pairs):
            batch = self.data_collator([dataset[i] for i in range(start, min(len(dataset), start + pairs))])
            ids, mask = batch["input_ids"], batch["attention_mask"]
            labels = ids.masked_fill(batch["completion_mask"] == 0, -100)
            sums = self.engine.logprobs(ids, labels, mask, reference=lora)
            n = ids.shape[0] // 2
            chosen.append(sums[:n])
            rejected.append(sums[n:])
        return torch.cat(chosen), torch.cat(rejected)

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        data = self.train_dataset
        # A resume takes them from the checkpoint (_load_from_checkpoint, which the Trainer calls before it
        # makes the dataloader); a new run computes them under the starting weights, before the first step.
        if "ref_chosen_logps" not in data.column_names and not resume_from_checkpoint:
            self._add_reference(*self._reference_logps(data))
            if self.eval_dataset is not None and "ref_chosen_logps" not in self.eval_dataset.column_names:
                self._add_reference(*self._reference_logps(self.eval_dataset), split="eval")
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)

    def _add_reference(self, chosen, rejected, split="train"):
        name = f"{split}_dataset"
        data = getattr(self, name)
        data = data.remove_columns([c for c in ("ref_chosen_logps", "ref_rejected_logps") if c in data.column_names])
        data = data.add_column("ref_chosen_logps", chosen.tolist())
        setattr(self, name, data.add_column("ref_rejected_logps", rejected.tolist()))
        self._reference[split] = (chosen, rejected)

    def _save_optimizer_and_scheduler(self, output_dir):
        super()._save_optimizer_and_scheduler(output_dir)
        chosen, rejected = self._reference["train"]
        saved = {"fingerprint": self._fingerprint(), "chosen": chosen, "rejected": rejected}
        if "eval" in self._reference:
            saved["eval_chosen"], saved["eval_rejected"] = self._reference["eval"]
            saved["eval_fingerprint"] = self._fingerprint("eval")
        torch.save(saved, os.path.join(output_dir, STATE_DIR, REFERENCE_FILE))

    def _fingerprint(self, split="train") -> str:
        """The tokenized pairs' own hash (a dataset's _fingerprint can be random for in-memory data): a
        resume's reference must be of these sequences, in this order."""
        if split not in self._data_key:
            h = hashlib.sha256()
            for name in ("prompt_ids", "chosen_ids", "rejected_ids"):
                for ids in getattr(self, f"{split}_dataset")[name]:
                    h.update(len(ids).to_bytes(8, "little"))
                    h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
            self._data_key[split] = h.hexdigest()[:16]
        return self._data_key[split]

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        path = os.path.join(resume_from_checkpoint, STATE_DIR, REFERENCE_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"StriderDPOTrainer: {path} is missing: the run's reference log-probabilities (of "
                             "its starting weights) are not recomputed from trained ones; resume from a "
                             "checkpoint a StriderDPOTrainer saved")
        saved = torch.load(path)
        if saved["fingerprint"] != self._fingerprint():
            raise ValueError(f"StriderDPOTrainer: {path} holds the reference of other data (fingerprint "
                             f"{saved['fingerprint']}, this dataset's {self._fingerprint()}); resume with the "
                             "run's own train_dataset and DPOConfig")
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        self._add_reference(saved["chosen"], saved["rejected"])
        if self.eval_dataset is not None:
            if saved.get("eval_fingerprint") != self._fingerprint("eval"):
                raise ValueError(f"StriderDPOTrainer: {path} holds no reference for this eval_dataset (the run "
                                 "saved none, or for another); resume with the run's own eval_dataset, or none")
            self._add_reference(saved["eval_chosen"], saved["eval_rejected"], split="eval")
