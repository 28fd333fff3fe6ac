"""Rows of a Hugging Face dataset, as the documents `python -m strider.data` tokenizes.

Where they come from (strider.data's --format, by default from the name):
  JSON lines   .jsonl / .json: one object per line
  parquet      .parquet: what the Hub serves datasets as (read with pyarrow)
  arrow        .arrow: an Arrow IPC stream or file, what datasets' cache and save_to_disk write; or a
               save_to_disk folder, whose state.json lists its .arrow files in order
A row is one document, by its columns, the first of these it has:
  messages               a conversation, [{"role", "content"}, ...]: rendered by the chat template, the
                         assistant turns are the targets
  conversations          ShareGPT's [{"from", "value"}, ...] (from: human/user, gpt/assistant, system): the
                         same, its roles mapped
  prompt and completion  strings: the prompt's tokens, then the completion's and EOS, which are the targets
                         (TRL's prompt-completion form); lists of messages: one conversation, prompt first
  text                   a plain document, every token a target
"""
import json
from pathlib import Path

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
COLUMNS = "messages, conversations, prompt and completion, or text"


def record_format(path):
    """The --format 'auto' gives path: chat (JSON lines), parquet or arrow; None for anything else."""
    p = Path(path)
    if p.is_dir() or p.suffix == ".arrow":
        return "arrow"
    if p.suffix == ".parquet":
        return "parquet"
    if p.suffix in (".jsonl", ".json"):
        return "chat"
    return None


def document(row, where):
    """One row as (kind, item): ("chat", messages), ("completion", (prompt, completion)) or ("text", text).
    `where` names the row in errors (file:line, or file row N)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with {COLUMNS}, got {type(row).__name__}")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: expected {{\"messages\": [...]}} with at least one message")
        for i, m in enumerate(msgs):
            missing = [k for k in ("role", "content") if not isinstance(m, dict) or k not in m]
            if missing:
                raise ValueError(f"{where}: message {i + 1} has no {' and no '.join(missing)} (a message is "
                                 "{\"role\": ..., \"content\": ...})")
        return "chat", msgs
    if "conversations" in row:
        turns = row["conversations"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) and "from" in t and "value" in t
                                                               for t in turns):
            raise ValueError(f"{where}: conversations must be a non-empty list of {{\"from\", \"value\"}} turns")
        unknown = sorted({t["from"] for t in turns} - set(SHAREGPT_ROLES))
        if unknown:
            raise ValueError(f"{where}: conversations role {unknown[0]!r} is none of {', '.join(SHAREGPT_ROLES)}")
        return "chat", [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return "completion", (prompt, completion)
        if isinstance(prompt, list) and isinstance(completion, list) and completion:
            return "chat", prompt + completion
        raise ValueError(f"{where}: prompt and completion must both be strings, or both lists of messages")
    if "text" in row:
        if isinstance(row["text"], str):
            return "text", row["text"]
        got = "null" if row["text"] is None else type(row["text"]).__name__
        raise ValueError(f"{where}: text is {got}, not a string")
    raise ValueError(f"{where}: a row needs {COLUMNS}; this one has {', '.join(sorted(row)) or 'no column'}")


def _arrow_files(path):
    """The .arrow files of an arrow input: the file itself, or a save_to_disk folder's, in its order."""
    p = Path(path)
    if not p.is_dir():
        return [p]
    state = p / "state.json"
    if (p / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: a folder per split
        splits = sorted(q.name for q in p.iterdir() if (q / "state.json").is_file())
        raise ValueError(f"{p} holds several splits ({', '.join(splits)}); give one split's folder, e.g. "
                         f"{p / (splits[0] if splits else 'train')}")
    if not state.is_file():
        found = sorted(q.name for q in p.iterdir() if q.suffix in (".arrow", ".parquet"))
        raise ValueError(f"{p}: a folder without state.json is not a datasets.save_to_disk folder; give one of "
                         f"its files instead ({', '.join(found[:4]) or 'none found'})")
    try:
        files = [p / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{state}: no _data_files list of {{\"filename\": ...}} ({e})") from None
    for f in files:
        if not f.is_file():
            raise ValueError(f"{state} names {f.name}, which is not in {p}")
    return files


def _arrow_batches(f):
    """The record batches of an Arrow IPC stream (what datasets writes) or file."""
    import pyarrow as pa
    try:
        stream = pa.ipc.open_stream(pa.memory_map(str(f)))
    except pa.ArrowInvalid:
        stream = None
    if stream is not None:
        yield from stream
        return
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(f)))
    except pa.ArrowInvalid as e:
        raise ValueError(f"{f}: not an Arrow IPC stream or file ({e})") from None
    for i in range(reader.num_record_batches):
        yield reader.get_batch(i)


def rows(path, fmt):
    """(row, where) for each row of a parquet or arrow input, `where` naming it for errors."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # the environment pins pyarrow; an install without it says what to add
        raise ValueError(f"{path}: reading {fmt} needs pyarrow (pip install pyarrow)") from None
    if fmt == "parquet":
        try:
            sources = [(Path(path), pq.ParquetFile(str(path)).iter_batches(batch_size=1024))]
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{path}: not a parquet file ({e})") from None
    else:
        sources = [(f, _arrow_batches(f)) for f in _arrow_files(path)]
    for f, batches in sources:
        n = 0
        for batch in batches:
            for row in batch.to_pylist():
                n += 1
                yield row, f"{f} row {n}"


def row_count(path, fmt):
    """Rows of a parquet input from its footer (the progress bar's total); None for arrow (an IPC stream
    says its length only once read) or a file pyarrow cannot open (rows() then says why)."""
    if fmt != "parquet":
        return None
    try:
        import pyarrow.parquet as pq
        return pq.ParquetFile(str(path)).metadata.num_rows
    except Exception:  # noqa: BLE001
        return None
