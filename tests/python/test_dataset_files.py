"""Hugging Face dataset files as `python -m strider.data` input: JSON lines, parquet, Arrow and a
save_to_disk folder give the same token file, row by row, whatever the row's form (messages, ShareGPT
conversations, prompt and completion, text); bad rows and folders are refused naming the row or the file."""
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from strider import data as sd
from test_data_prep import tokenizer, tokenizer_dir  # noqa: F401  (fixtures)

CHAT = [{"role": "user", "content": "hello how are you"}, {"role": "assistant", "content": "be brief please"}]
ROWS = [
    {"messages": CHAT},
    {"conversations": [{"from": "human", "value": "hello how are you"}, {"from": "gpt", "value": "be brief please"}]},
    {"prompt": "the cat sat on", "completion": "the mat"},
    {"text": "the answer is four"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_arrow(path, rows, stream=True):
    """An Arrow IPC stream (what datasets writes) or file, one column per key."""
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink:
        with (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, table.schema) as w:
            w.write_table(table)


def by_row(tok, rows, tmp_path, name):
    """One token file per row (each row alone: the four forms have different columns)."""
    out = []
    for k, row in enumerate(rows):
        write_jsonl(tmp_path / f"{name}{k}.jsonl", [row])
        sd.prepare(tok, tmp_path / f"{name}{k}.jsonl", tmp_path / f"{name}{k}.tokens", progress=False)
        out.append(sd.read_token_file(tmp_path / f"{name}{k}.tokens"))
    return out


@pytest.fixture
def tok(tokenizer):  # noqa: F811  (test_data_prep's tiny tokenizer)
    return tokenizer


def test_each_row_form_becomes_a_document_with_its_targets(tmp_path, tok):
    chat, sharegpt, completion, text = by_row(tok, ROWS, tmp_path, "r")
    # ShareGPT's turns are the same conversation.
    assert chat["ids"].tolist() == sharegpt["ids"].tolist() and chat["mask"].tolist() == sharegpt["mask"].tolist()
    assert 0 < chat["mask"].sum() < len(chat["ids"])
    # Prompt and completion: the prompt's tokens (no target), then the completion's and EOS (targets).
    head = tok("the cat sat on")["input_ids"]
    tail = tok("the mat", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert completion["ids"].tolist() == head + tail
    assert completion["mask"].tolist() == [0] * len(head) + [1] * len(tail)
    # Text alone: a plain document, no mask in the file (every token counts).
    assert text["ids"].tolist() == tok("the answer is four")["input_ids"] + [tok.eos_token_id]
    assert text["mask"] is None


def test_jsonl_parquet_arrow_and_a_saved_folder_give_the_same_file(tmp_path, tok, tokenizer_dir):  # noqa: F811
    rows = [ROWS[0], {"messages": CHAT[:1] + [{"role": "assistant", "content": "sure"}]}] * 3
    write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=2)
    write_arrow(tmp_path / "d.arrow", rows)
    write_arrow(tmp_path / "f.arrow", rows, stream=False)
    saved = tmp_path / "saved"  # datasets' save_to_disk: its shards in state.json's order
    saved.mkdir()
    write_arrow(saved / "data-00000-of-00002.arrow", rows[:4])
    write_arrow(saved / "data-00001-of-00002.arrow", rows[4:])
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00002.arrow"},
                                                                  {"filename": "data-00001-of-00002.arrow"}]}))
    (saved / "dataset_info.json").write_text("{}")
    want = None
    for src in ("d.jsonl", "d.parquet", "d.arrow", "f.arrow", "saved"):
        summary = sd.prepare(tok, tmp_path / src, tmp_path / f"{src}.tokens", progress=False)
        got = sd.read_token_file(tmp_path / f"{src}.tokens")
        got = (got["ids"].tolist(), got["mask"].tolist(), got["doc_starts"].tolist())
        assert summary["documents"] == 6, src
        assert want is None or got == want, src
        want = got
    # The command line reads them by their names too.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-m", "strider.data", "--tokenizer", tokenizer_dir, "--input",
                          tmp_path / "d.parquet", "--output", tmp_path / "cli.tokens", "--quiet"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["format"] == "parquet"
    assert np.array_equal(sd.read_token_file(tmp_path / "cli.tokens")["ids"], want[0])


def test_bad_rows_and_files_are_named(tmp_path, tok):
    cases = [
        ([{"question": "q", "answer": "a"}], "row 1: a row needs messages, conversations, prompt and completion, "
                                             "or text; this one has answer, question"),
        ([{"conversations": [{"from": "robot", "value": "x"}]}], "role 'robot' is none of"),
        ([{"prompt": "p", "completion": ["x"]}], "must both be strings, or both lists of messages"),
        ([{"text": "a"}, {"text": None}], r"bad.parquet row 2: text is null, not a string"),
        ([{"messages": [{"role": "user"}]}], r"bad.parquet row 1: message 1 has no content"),
    ]
    for rows, match in cases:
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
        with pytest.raises(ValueError, match=match):
            sd.prepare(tok, tmp_path / "bad.parquet", tmp_path / "bad.tokens", progress=False)
    write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"question": "q"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a row needs"):
        sd.prepare(tok, tmp_path / "bad.jsonl", tmp_path / "bad.tokens", progress=False)
    write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"messages": [{"content": "hi"}]}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: message 1 has no role"):
        sd.prepare(tok, tmp_path / "bad.jsonl", tmp_path / "bad.tokens", progress=False)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="junk.parquet: not a parquet file"):
        sd.prepare(tok, tmp_path / "junk.parquet", tmp_path / "bad.tokens", progress=False)
    (tmp_path / "junk.arrow").write_bytes(b"not arrow either")
    with pytest.raises(ValueError, match="junk.arrow: not an Arrow IPC stream or file"):
        sd.prepare(tok, tmp_path / "junk.arrow", tmp_path / "bad.tokens", progress=False)
    folder = tmp_path / "hub"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), folder / "train-00000-of-00001.parquet")
    with pytest.raises(ValueError, match="not a datasets.save_to_disk folder; give one of its files instead "
                                         r"\(train-00000-of-00001.parquet\)"):
        sd.prepare(tok, folder, tmp_path / "bad.tokens", progress=False)
    (folder / "dataset_dict.json").write_text('{"splits": ["train"]}')  # DatasetDict.save_to_disk's
    (folder / "train").mkdir()
    (folder / "train" / "state.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds several splits \(train\); give one split's folder, e.g. .*train"):
        sd.prepare(tok, folder, tmp_path / "bad.tokens", progress=False)
    assert not (tmp_path / "bad.tokens").exists()
