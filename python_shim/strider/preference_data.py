"""`python -m strider.data --mode preference`: TRL's preference rows to a preference token file.

The rows are TRL's preference formats (prompt/chosen/rejected as text or as conversations; chosen/rejected
alone with an implicit shared prompt, which TRL splits off), read with `datasets` (JSON lines, parquet, arrow
or a save_to_disk folder). They are tokenized by TRL 1.16's own DPOTrainer code and cut by its own
DataCollatorForPreference (max_length = --seq, its truncation_mode), so the sequences are those a TRL DPO run
trains on. Each pair is two documents, each alone in a window of --seq tokens: its chosen sequence (the
prompt, no target, then the chosen completion) and its rejected one, padded (io/token_data.h, word 8 "pairs";
the loader shuffles pairs, never rows, and lays each step out as its pairs' chosen rows, then their rejected
ones)."""
import os

import numpy as np

from strider.data import PADDING, _pad_id, write_token_file


def _rows(input_path):
    import datasets
    path = os.fspath(input_path)
    if os.path.isdir(path):
        return datasets.load_from_disk(path)
    ext = os.path.splitext(path)[1].lower()
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}.get(ext)
    if kind is None:
        raise ValueError(f"{path}: --mode preference reads JSON lines, parquet or arrow rows (or a save_to_disk "
                         "folder) of prompt/chosen/rejected")
    return datasets.load_dataset(kind, data_files=path, split="train")


class _Tokenizing:
    """What trl.DPOTrainer._prepare_dataset reads of its trainer."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer


def tokenize_pairs(tokenizer, rows, args, split):
    """TRL's preference rows tokenized by TRL's own DPOTrainer code (prompt_ids, chosen_ids, rejected_ids), under
    the trl.DPOConfig `args`; `split` is "train" or "eval" (TRL's progress text)."""
    from trl.trainer.dpo_trainer import DPOTrainer
    return DPOTrainer._prepare_dataset(_Tokenizing(tokenizer), rows, tokenizer, args, split)


def pair_collator(tokenizer, max_length, truncation_mode):
    """TRL's DataCollatorForPreference: a batch's chosen rows, then its rejected ones, right-padded and cut to
    max_length as TRL cuts them; completion_mask marks the targets."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    return DataCollatorForPreference(pad_token_id=_pad_id(tokenizer), max_length=max_length,
                                     truncation_mode=truncation_mode)


def prepare_preference(tokenizer, input_path, output_path, seq, truncation_mode="keep_start"):
    """Writes the preference token file output_path from the rows of input_path; returns a summary."""
    from trl import DPOConfig
    if not seq or seq < 2:
        raise ValueError("--mode preference puts each sequence alone in a window: give --seq (the engine's)")
    rows = _rows(input_path)
    missing = {"chosen", "rejected"} - set(rows.column_names)
    if missing:
        raise ValueError(f"{input_path}: no {' or '.join(sorted(missing))} column: preference rows are "
                         f"prompt/chosen/rejected (TRL's format), the file has {', '.join(rows.column_names)}")
    args = DPOConfig(output_dir=os.devnull, report_to=[], use_cpu=True, bf16=False, max_length=seq,
                     truncation_mode=truncation_mode, dataset_num_proc=None)
    tokenized = tokenize_pairs(tokenizer, rows, args, "train")
    pad = _pad_id(tokenizer)
    collate = pair_collator(tokenizer, seq, truncation_mode)
    n = len(tokenized)
    if n == 0:
        raise ValueError(f"{input_path}: no preference rows")
    ids = np.full(2 * n * seq + 1, pad, np.int64)  # one more token ends the file (the loader reads seq + 1)
    mask = np.full(2 * n * seq + 1, PADDING, np.uint8)
    lengths, cut = [], 0
    for i in range(n):
        row = tokenized[i]
        full = len(row["prompt_ids"]) + max(len(row["chosen_ids"]), len(row["rejected_ids"]))
        cut += full > seq
        batch = collate([row])  # [chosen, rejected], right-padded to the longer, cut to seq as TRL cuts
        for k in range(2):
            length = int(batch["attention_mask"][k].sum())
            at = (2 * i + k) * seq
            ids[at:at + length] = batch["input_ids"][k, :length].numpy()
            mask[at:at + length] = batch["completion_mask"][k, :length].numpy()  # the prompt is no target
            lengths.append(length)
    write_token_file(output_path, ids, mask, [k * seq for k in range(2 * n)], vocab_size=len(tokenizer),
                     example_seq=seq, pairs=True)
    lengths = np.asarray(lengths)
    return dict(output=str(output_path), mode="preference", pairs=n, seq=seq, truncation_mode=truncation_mode,
                pairs_cut=int(cut), length_median=float(np.median(lengths)), length_max=int(lengths.max()),
                padding_fraction=float((seq - lengths).sum() / (2 * n * seq)), vocab_size=len(tokenizer))
