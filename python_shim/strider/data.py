"""Token files for strider, from text or chat data, through a Hugging Face tokenizer.

    python -m strider.data --tokenizer <dir> --input corpus.txt --output train.tokens
    python -m strider.data --tokenizer <dir> --input chats.jsonl --output sft.tokens   # chat: loss mask

Inputs (--format, default from the name: .jsonl/.json -> chat, .parquet -> parquet, .arrow or a
folder -> arrow, else lines):
  lines    one document per line (blank lines skipped)
  text     the whole file is one document
  chat     JSON lines, one row each
  parquet  a Hugging Face dataset's parquet file (pyarrow), one row each
  arrow    a datasets Arrow file, or a save_to_disk folder, one row each
A row (strider/records.py) is {"messages": [{"role": ..., "content": ...}, ...]}, rendered with the
tokenizer's chat template: the loss mask is 1 on assistant turns (their content and the template's
end-of-turn tokens) and 0 on system, user and template prompt tokens; or ShareGPT's "conversations",
the same; or "prompt" and "completion" (the completion and EOS are the targets); or "text" (a plain
document).

Layout (--mode):
  packed   the documents back to back, one stream that the loader cuts into
           --seq windows: no padding; each document attends only to itself,
           its positions counting from its start (the engine's
           packed_documents, which `strider finetune` turns on for such a
           file), and a document may run across two windows
  example  each document alone in a window of exactly --seq tokens: cut to
           --seq, or padded after its end (mask byte 2: no target, attention
           mask 0, so a mixture of experts' load-balancing loss leaves it out);
           what one example per sequence means in transformers' SFT recipes
The summary line reports the documents' lengths (min, median, max), the
target fraction and, given --seq, the windows, the documents longer than a
window (cut in example mode, split across windows in packed mode) and the
padding.

The output is io/token_data.h's format, version 1, written with numpy per its
header comment: uint16 ids when the vocabulary fits (<= 65536 ids), else
uint32; document starts always (the loader never predicts across them); a loss
mask for chat data. The engine's command line (`strider finetune --data`),
TokenDataset (a map-style dataset of seq-token windows: what StriderTrainer
takes, or a token file's path itself) and TokenBatches below read it.
"""
import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np

from strider import records
from strider.chat_templates import TEMPLATES, chat_template, require_chat_template

MAGIC = int.from_bytes(b"STRDTOKN", "little")
VERSION = 1
HEADER_BYTES = 1024
FLAG_MASK, FLAG_DOCS = 1, 2
IGNORE_INDEX = -100
PADDING = 2  # the mask byte of a padding token: no target, and no input (attention mask 0)


def _pad8(n):
    return b"\0" * (-n % 8)


def write_token_file(path, ids, mask=None, doc_starts=None, vocab_size=0, example_seq=0, pairs=False):
    """Writes a token file (io/token_data.h), atomically: a temp file in the same folder, fsync, rename.

    ids: token ids; mask: None (every token a target) or one byte per id: 1 a target, 0 not (a prompt), 2
    padding (no target, attention mask 0; PADDING); doc_starts: None or strictly
    increasing indices < len(ids); vocab_size: recorded (0: not recorded), and every id must be below it;
    example_seq: the seq each document was cut or padded to (--mode example), which every reader must use
    (0: a packed stream, any seq); pairs: preference pairs (--mode preference), window 2i pair i's chosen
    sequence and 2i + 1 its rejected one, each a document alone in its example_seq window.
    """
    if pairs and (not example_seq or doc_starts is None or len(doc_starts) % 2):
        raise ValueError(f"write_token_file({path}): pairs are documents two by two, each alone in an example_seq "
                         "window")
    if isinstance(example_seq, bool) or not isinstance(example_seq, int) or example_seq < 0:
        raise ValueError(f"write_token_file({path}): example_seq = {example_seq!r}: expected an int >= 0")
    ids = np.asarray(ids, dtype=np.int64).ravel()
    n = len(ids)
    if n and ids.min() < 0:
        raise ValueError(f"write_token_file({path}): negative token id {int(ids.min())}")
    top = int(ids.max()) + 1 if n else 0
    if vocab_size and top > vocab_size:
        raise ValueError(f"write_token_file({path}): token id {top - 1} is not below vocab_size {vocab_size}")
    token_bytes = 2 if max(vocab_size, top) <= 1 << 16 else 4
    if top > 1 << 32:
        raise ValueError(f"write_token_file({path}): token id {top - 1} does not fit in uint32")
    flags = 0
    if mask is not None:
        mask = np.asarray(mask, dtype=np.uint8).ravel()
        if len(mask) != n or (mask > PADDING).any():
            raise ValueError(f"write_token_file({path}): the mask needs one byte of 0, 1 or 2 (padding) per token "
                             f"({n}), got {len(mask)} values, largest {int(mask.max()) if len(mask) else None}")
        flags |= FLAG_MASK
    if doc_starts is not None:
        doc_starts = np.asarray(doc_starts, dtype=np.uint64).ravel()
        if len(doc_starts) and (doc_starts[-1] >= n or (np.diff(doc_starts.astype(np.int64)) <= 0).any()):
            raise ValueError(f"write_token_file({path}): document starts must increase strictly and be < {n}")
        flags |= FLAG_DOCS
    h = np.zeros(128, "<u8")
    h[0], h[1], h[2], h[3], h[4] = MAGIC, VERSION, token_bytes, n, flags
    h[5] = 0 if doc_starts is None else len(doc_starts)
    h[6] = vocab_size
    h[7] = example_seq
    h[8] = int(bool(pairs))
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(h.tobytes())
            body = ids.astype("<u2" if token_bytes == 2 else "<u4").tobytes()
            f.write(body + _pad8(len(body)))
            if mask is not None:
                f.write(mask.tobytes() + _pad8(n))
            if doc_starts is not None:
                f.write(doc_starts.astype("<u8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def read_token_file(path):
    """A token file's contents: dict(ids, mask (None if absent), doc_starts (None if absent), vocab_size,
    token_bytes, example_seq (0: packed), pairs); ids and mask are read-only memory maps. Checks the header and the
    file's size."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ValueError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte token file header")
    h = np.fromfile(path, dtype="<u8", count=128)
    if h[0] != MAGIC:
        raise ValueError(f"{path}: not a strider token file (magic {int(h[0]):#x})")
    if h[1] != VERSION:
        raise ValueError(f"{path}: token file version {int(h[1])}; this reader knows version {VERSION}")
    token_bytes, n, flags, num_docs, vocab, example_seq = (int(x) for x in h[2:8])
    pairs = int(h[8])
    if token_bytes not in (2, 4) or flags & ~3 or pairs > 1 or h[9:].any():
        raise ValueError(f"{path}: bad header (token_bytes {token_bytes}, flags {flags}, pairs {pairs}, reserved "
                         f"words 9-127 {'not ' if h[9:].any() else ''}all 0)")
    body = token_bytes * n
    want = HEADER_BYTES + body + len(_pad8(body))
    mask_off = want if flags & FLAG_MASK else None
    if mask_off is not None:
        want += n + len(_pad8(n))
    docs_off = want if flags & FLAG_DOCS else None
    if docs_off is not None:
        want += 8 * num_docs
    if size != want:
        raise ValueError(f"{path}: {size} bytes, but its header describes {want}")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    ids = mm[HEADER_BYTES:HEADER_BYTES + body].view("<u2" if token_bytes == 2 else "<u4")
    mask = mm[mask_off:mask_off + n] if mask_off is not None else None
    docs = mm[docs_off:docs_off + 8 * num_docs].view("<u8") if docs_off is not None else None
    return dict(ids=ids, mask=mask, doc_starts=docs, vocab_size=vocab, token_bytes=token_bytes,
                example_seq=example_seq, pairs=bool(pairs))


# -- tokenizing ---------------------------------------------------------------------------------------


def window_order(num_windows, seed, epoch):
    """The order in which `strider finetune --seed seed` visits a token file's windows in one epoch
    (io/token_data.h's window_order): Fisher-Yates driven by splitmix64 seeded with seed ^ (epoch *
    0xD1B54A32D192ED03), j = next() % (i + 1) for i from the last window down."""
    m64 = (1 << 64) - 1
    order = list(range(num_windows))
    x = (seed ^ (epoch * 0xD1B54A32D192ED03)) & m64
    for i in range(num_windows, 1, -1):
        x = (x + 0x9E3779B97F4A7C15) & m64
        z = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
        z ^= z >> 31
        j = z % i
        order[i - 1], order[j] = order[j], order[i - 1]
    return order


def encode_document(tokenizer, text, append_eos=True):
    """A document's ids: the tokenizer's own special tokens (e.g. BOS) and, with append_eos, EOS at the
    end, so that the model learns where a document stops."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    eos = tokenizer.eos_token_id
    if append_eos and eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    return ids


def encode_chat(tokenizer, messages):
    """(ids, mask) of one conversation rendered by the tokenizer's chat template; mask 1 on assistant turns.

    Each assistant turn's characters are found by rendering the conversation up to it (with the generation
    prompt) and through it: the text between the two is the assistant's. The whole conversation is then
    tokenized once, and a token is a target if it starts inside an assistant turn. This needs a template
    whose rendering of a conversation's prefix is a prefix of the whole (true of the common ones; a template
    that is not is refused with the turn that broke it) and a fast tokenizer (character offsets)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("chat data needs a fast tokenizer (PreTrainedTokenizerFast) for character offsets")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        raise ValueError("a conversation must be a list of {'role': ..., 'content': ...} messages")
    require_chat_template(tokenizer, repr(getattr(tokenizer, "name_or_path", "")))
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[:i + 1], False)
        if not (through.startswith(before) and full.startswith(through)):
            raise ValueError(f"the chat template's rendering of messages[:{i}] is not a prefix of the whole "
                             "conversation, so the assistant's tokens cannot be located")
        spans.append((len(before), len(through)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return ids, mask


def encode_completion(tokenizer, prompt, completion):
    """(ids, mask) of a prompt-completion row: the prompt's tokens (with the tokenizer's special tokens,
    e.g. BOS) then the completion's and EOS; mask 1 on the completion and EOS. Each part is tokenized
    alone, so no token straddles the two."""
    head = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    tail = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None and (not tail or tail[-1] != eos):
        tail.append(eos)
    return head + tail, [0] * len(head) + [1] * len(tail)


def _documents(path, fmt):
    """((kind, item), progress) for each document of the input (records.document's kinds; None for a
    blank line); progress in bytes for lines, text and chat, in rows for parquet and arrow."""
    if fmt in ("parquet", "arrow"):
        for row, where in records.rows(path, fmt):
            yield records.document(row, where), 1
        return

    def utf8(raw, where):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 (byte {e.start} of {'the file' if where == str(path) else 'the line'}"
                             f" is 0x{raw[e.start]:02x}); convert the file to UTF-8 first") from None

    if fmt == "text":
        raw = Path(path).read_bytes()
        text = utf8(raw, str(path))
        yield ("text", text), len(raw)
        return
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = utf8(raw, f"{path}:{lineno}").strip()
            if not line:
                yield None, len(raw)
                continue
            if fmt == "lines":
                yield ("text", line), len(raw)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
            yield records.document(record, f"{path}:{lineno}"), len(raw)


def _pad_id(tokenizer):
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def prepare(tokenizer, input_path, output_path, fmt="auto", append_eos=True, progress=True, mode="packed",
            seq=None):
    """Tokenizes input_path into the token file output_path (mode packed or example; see the module's
    docstring); returns a summary dict with the report."""
    from tqdm.auto import tqdm

    if fmt == "auto":
        fmt = records.record_format(input_path) or "lines"
    if fmt not in ("lines", "text", "chat", "parquet", "arrow"):
        raise ValueError(f"format {fmt!r} is not lines, text, chat, parquet or arrow")
    if Path(input_path).is_dir() and fmt != "arrow":
        raise ValueError(f"{input_path} is a folder: only a datasets.save_to_disk folder is read (format arrow)")
    if mode not in ("packed", "example"):
        raise ValueError(f"mode {mode!r} is not packed or example")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 2):
        raise ValueError(f"seq = {seq!r}: expected an int >= 2 (the tokens of one training sequence)")
    if mode == "example" and seq is None:
        raise ValueError("mode example pads or cuts each document to one sequence: give seq (--seq), the "
                         "engine's sequence length")
    docs, masks = [], []
    by_rows = fmt in ("parquet", "arrow")
    total = records.row_count(input_path, fmt) if by_rows else os.path.getsize(input_path)
    write_mask = False  # a chat or prompt-completion row: the file gets a loss mask
    with tqdm(total=total, unit="rows" if by_rows else "B", unit_scale=not by_rows, disable=not progress,
              desc=f"tokenizing {Path(input_path).name}") as bar:
        for item, consumed in _documents(input_path, fmt):
            bar.update(consumed)
            if item is None:
                continue
            kind, value = item
            if kind == "chat":
                doc, doc_mask = encode_chat(tokenizer, value)
            elif kind == "completion":
                doc, doc_mask = encode_completion(tokenizer, *value)
            else:
                doc, doc_mask = encode_document(tokenizer, value, append_eos), None
            write_mask = write_mask or doc_mask is not None
            if not doc:
                continue
            docs.append(np.asarray(doc, np.int64))
            masks.append(np.ones(len(doc), np.uint8) if doc_mask is None else np.asarray(doc_mask, np.uint8))
    if not docs:
        raise ValueError(f"{input_path}: no tokens (empty input?)")
    lengths = np.array([len(d) for d in docs], np.int64)
    vocab = len(tokenizer)
    report = dict(documents=len(docs), length_min=int(lengths.min()), length_median=float(np.median(lengths)),
                  length_max=int(lengths.max()))
    if mode == "example":
        # One window per document: cut to seq, or padded after it (the padding is no target, and its
        # attention mask is 0: mask byte PADDING). One more padding token ends the file: the C++ loader reads
        # a window's seq + 1 tokens (io/token_data.h; the last one is only a label), so without it the last
        # document would make no window there.
        pad = _pad_id(tokenizer)
        all_ids = np.full(len(docs) * seq + 1, pad, np.int64)
        all_mask = np.full(len(docs) * seq + 1, PADDING, np.uint8)
        for k, (d, m) in enumerate(zip(docs, masks)):
            n = min(len(d), seq)
            all_ids[k * seq:k * seq + n] = d[:n]
            all_mask[k * seq:k * seq + n] = m[:n]
        starts = [k * seq for k in range(len(docs))]
        report.update(seq=seq, windows=len(docs), cut=int((lengths > seq).sum()),
                      tokens_cut=int(np.maximum(lengths - seq, 0).sum()),
                      padding_fraction=float(np.maximum(seq - lengths, 0).sum() / (len(docs) * seq)))
        write_mask = True  # the padding is no target
    else:
        all_ids = np.concatenate(docs)
        all_mask = np.concatenate(masks)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
        if seq is not None:
            ends = np.cumsum(lengths)
            # A document split across windows: its first and last token fall in different windows.
            split = (np.asarray(starts) // seq) != ((ends - 1) // seq)
            report.update(seq=seq, windows=int(all_ids.size // seq), split=int(split.sum()),
                          tokens_unused=int(all_ids.size % seq))
    write_token_file(output_path, all_ids, all_mask if write_mask else None, starts, vocab_size=vocab,
                     example_seq=seq if mode == "example" else 0)
    summary = dict(output=str(output_path), format=fmt, mode=mode, tokens=int(all_ids.size), vocab_size=vocab,
                   token_bytes=2 if vocab <= 1 << 16 else 4, **report)
    if write_mask:
        targets = all_mask == 1
        summary["target_fraction"] = float(targets.sum() / (len(docs) * seq if mode == "example" else all_mask.size))
        if not targets.any():
            # Every batch would be skipped for want of a target: said now, not after a run that learns nothing.
            warnings.warn(f"{input_path}: no assistant turn in any conversation (nor a completion), so {output_path} "
                          "has no target token: a run on it trains nothing (every batch is skipped). Chat data needs "
                          "assistant messages; for plain text use --format lines or text")
            summary["warning"] = "no target tokens"
    return summary


# -- batches for a Python training loop -----------------------------------------------------------------


class TokenDataset:
    """A token file as a map-style dataset (torch.utils.data.Dataset's protocol): item i is window i of seq
    tokens, dict(input_ids, labels, position_ids), int64 tensors in transformers' convention (labels not
    shifted), so transformers.Trainer's default collator batches it. A label is -100 where the loss mask is 0
    and where a document starts (never predict a document's first token from the one before). position_ids
    count from 0 at each document start in the window (and at the window's start): packed position_ids, with
    which strider (EngineConfig.packed_documents) and transformers keep each document's attention to itself.
    A file with padding (--mode example) adds attention_mask, 0 on the padding. The tokens past the last whole
    window are not used. strider.StriderTrainer takes one, or a token file's
    path, as train_dataset or eval_dataset."""

    def __init__(self, path, seq):
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
            raise ValueError(f"TokenDataset: seq = {seq!r}: expected an int >= 1")
        f = read_token_file(path)
        if f["pairs"]:
            raise ValueError(f"{path}: a preference file (--mode preference: chosen and rejected sequences in "
                             "pairs), which `strider finetune --objective dpo` (simpo, orpo) reads; from Python, "
                             "strider.StriderDPOTrainer takes TRL's preference rows themselves")
        if f["example_seq"] and f["example_seq"] != seq:
            cut = f["example_seq"]
            raise ValueError(f"{path}: made with --mode example --seq {cut} (each document alone in a window of "
                             f"{cut} tokens), read at seq {seq}: its examples would "
                             f"{'split across' if seq < cut else 'share'} windows; use seq {cut}, or remake the "
                             f"file with --seq {seq}")
        self.path = Path(path)
        self.ids, self.mask = f["ids"], f["mask"]
        self.vocab_size = f["vocab_size"]
        self.starts = np.zeros(len(self.ids), bool)
        if f["doc_starts"] is not None:
            self.starts[f["doc_starts"].astype(np.int64)] = True
        self.seq = seq
        self.num_windows = len(self.ids) // seq
        if self.num_windows == 0:
            raise ValueError(f"{path}: {len(self.ids)} tokens, fewer than one sequence of {seq}")
        # A document starting off a window's first token: windows pack documents.
        used = self.starts[:self.num_windows * seq].reshape(self.num_windows, seq)
        self.packs_documents = bool(used[:, 1:].any())
        self.has_padding = self.mask is not None and bool((np.asarray(self.mask) == PADDING).any())

    def __len__(self):
        return self.num_windows

    def window(self, w):
        """(input_ids, labels) of window w, int64 tensors of seq values."""
        return self.window_positions(w)[:2]

    def window_positions(self, w):
        """(input_ids, labels, position_ids) of window w, int64 tensors of seq values."""
        import torch
        s = w * self.seq
        ids = np.asarray(self.ids[s:s + self.seq], np.int64)
        labels = ids.copy()
        starts = self.starts[s:s + self.seq]
        drop = starts.copy()
        if self.mask is not None:
            drop |= np.asarray(self.mask[s:s + self.seq]) != 1
        labels[drop] = IGNORE_INDEX
        at = np.arange(self.seq, dtype=np.int64)
        positions = at - np.maximum.accumulate(np.where(starts, at, 0))
        return torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(positions)

    def window_attention(self, w):
        """The attention mask of window w: int64, 0 on padding, else 1."""
        import torch
        s = w * self.seq
        if self.mask is None:
            return torch.ones(self.seq, dtype=torch.int64)
        return torch.from_numpy((np.asarray(self.mask[s:s + self.seq]) != PADDING).astype(np.int64))

    def __getitem__(self, i):
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"TokenDataset: index {i!r} is not an int")
        if not -self.num_windows <= i < self.num_windows:
            raise IndexError(f"TokenDataset: window {i} of {self.num_windows} ({self.path})")
        w = int(i) % self.num_windows
        ids, labels, positions = self.window_positions(w)
        item = {"input_ids": ids, "labels": labels, "position_ids": positions}
        if self.has_padding:
            item["attention_mask"] = self.window_attention(w)
        return item


class TokenBatches:
    """[batch, seq] (input_ids, labels) from a token file, TokenDataset's windows stacked (labels not
    shifted); with positions=True, position_ids follow them, for Engine.step with
    EngineConfig.packed_documents; with attention=True, the attention mask comes last (0 on a padded file's
    padding, --mode example), for Engine.step's attention_mask (a mixture-of-experts model's load-balancing
    loss leaves the padding out, as transformers does). Pass them by name: (x, y, p, a) -> engine.step(x, y,
    position_ids=p, attention_mask=a). With shuffle, each epoch visits the windows in an order drawn from
    (seed, epoch); without, in file order. Endless: iterate with zip or itertools.islice."""

    def __init__(self, path, batch, seq, seed=0, shuffle=True, positions=False, attention=False):
        self.data = TokenDataset(path, seq)
        self.batch, self.seq, self.seed, self.shuffle = batch, seq, seed, shuffle
        self.positions, self.attention = positions, attention
        self.num_windows = len(self.data)
        if self.data.has_padding and not attention:
            warnings.warn(f"{path} has padding (written with --mode example): TokenBatches(..., attention=True) "
                          "yields its attention mask, which a mixture-of-experts model's load-balancing loss needs "
                          "to leave the padding out", stacklevel=2)

    def window(self, w):
        """(input_ids, labels) of window w, int64 tensors of seq values."""
        return self.data.window(w)

    def __iter__(self):
        import torch
        epoch = 0
        while True:
            order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_windows) if self.shuffle
                     else np.arange(self.num_windows))
            for i in range(0, len(order) - self.batch + 1, self.batch):
                windows = [int(w) for w in order[i:i + self.batch]]
                rows = [self.data.window_positions(w) for w in windows]
                out = [torch.stack([r[k] for r in rows]) for k in range(3 if self.positions else 2)]
                if self.attention:
                    out.append(torch.stack([self.data.window_attention(w) for w in windows]))
                yield tuple(out)
            epoch += 1


# -- command line ---------------------------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m strider.data", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer directory (AutoTokenizer)")
    p.add_argument("--input", required=True,
                   help="text file; JSON lines, parquet or arrow rows of a Hugging Face dataset (messages, "
                        "conversations, prompt and completion, or text); or a datasets.save_to_disk folder")
    p.add_argument("--output", required=True, help="the token file to write")
    p.add_argument("--format", default="auto", choices=["auto", "lines", "text", "chat", "parquet", "arrow"],
                   help="auto: chat for .jsonl/.json, parquet for .parquet, arrow for .arrow or a folder, else lines")
    p.add_argument("--no-eos", action="store_true", help="do not end text documents with the EOS token")
    p.add_argument("--mode", default="packed", choices=["packed", "example", "preference"],
                   help="packed: documents back to back, cut into --seq windows by the loader, each document "
                        "attending only to itself (the engine's packed_documents); example: each document alone "
                        "in a window of --seq tokens, cut or padded; preference: TRL's preference rows "
                        "(prompt/chosen/rejected, as text or conversations, or an implicit prompt), each pair's "
                        "chosen and rejected sequences as TRL's DPOTrainer makes them, each alone in a window of "
                        "--seq tokens (for --objective dpo, simpo or orpo)")
    p.add_argument("--truncation-mode", default="keep_start", choices=["keep_start", "keep_end"],
                   help="--mode preference: where a pair longer than --seq is cut (TRL's truncation_mode)")
    p.add_argument("--seq", type=int, default=None,
                   help="the engine's sequence length: needed by --mode example; with packed, the report says "
                        "how many documents run across two windows")
    p.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                   help=f"the chat template conversations are rendered with, in place of the tokenizer's (a base "
                        f"model's has none): a built-in ({', '.join(TEMPLATES)}) or a Jinja file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(a.tokenizer)
        if a.chat_template is not None:
            tokenizer.chat_template = chat_template(a.chat_template)
        if a.mode == "preference":
            from strider.preference_data import prepare_preference
            summary = prepare_preference(tokenizer, a.input, a.output, seq=a.seq, truncation_mode=a.truncation_mode)
            print(json.dumps(summary))
            return 0
        summary = prepare(tokenizer, a.input, a.output, a.format, append_eos=not a.no_eos, progress=not a.quiet,
                          mode=a.mode, seq=a.seq)
    except (ValueError, OSError) as e:
        print(f"strider.data: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
