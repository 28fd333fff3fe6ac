"""io/token_data against an independent Python reading of its documented
format and batch rule (io/token_data.h): numpy writes the files, st_tool
reads them (and rewrites them byte for byte), and the batches, shuffle order
and resume match a reference written from the header comment alone: here, and
for the shuffle order strider.data.window_order (what benches use to replay a
run's batches).
"""
import json
import subprocess

import numpy as np
import pytest
from strider.data import window_order

MAGIC = int.from_bytes(b"STRDTOKN", "little")


def write_tokens(path, ids, token_bytes=2, mask=None, docs=None, vocab=0, magic=MAGIC, version=1):
    h = np.zeros(128, "<u8")
    flags = (1 if mask is not None else 0) | (2 if docs is not None else 0)
    h[0], h[1], h[2], h[3], h[4], h[5], h[6] = (magic, version, token_bytes, len(ids), flags,
                                                0 if docs is None else len(docs), vocab)
    with open(path, "wb") as f:
        f.write(h.tobytes())
        body = np.asarray(ids, "<u2" if token_bytes == 2 else "<u4").tobytes()
        f.write(body + b"\0" * (-len(body) % 8))
        if mask is not None:
            m = np.asarray(mask, "u1").tobytes()
            f.write(m + b"\0" * (-len(m) % 8))
        if docs is not None:
            f.write(np.asarray(docs, "<u8").tobytes())


def reference_batches(ids, mask, docs, batch, seq, seed, steps, shuffle=True):
    ids = np.asarray(ids, np.int64)
    doc_set = set(docs or [])
    windows = (len(ids) - 1) // seq
    epoch, cursor = 0, 0
    order = window_order(windows, seed, 0) if shuffle else list(range(windows))
    out = []
    for _ in range(steps):
        inputs, labels, positions, attention = [], [], [], []
        for _ in range(batch):
            if cursor == windows:
                epoch, cursor = epoch + 1, 0
                order = window_order(windows, seed, epoch) if shuffle else list(range(windows))
            s = order[cursor] * seq
            cursor += 1
            first = 0  # a position counts from its document's start in the window (or the window's)
            for t in range(seq):
                tgt = s + t + 1
                inputs.append(int(ids[s + t]))
                if t > 0 and s + t in doc_set:
                    first = t
                positions.append(t - first)
                ignore = (mask is not None and mask[tgt] != 1) or tgt in doc_set
                labels.append(-100 if ignore else int(ids[tgt]))
                attention.append(0 if mask is not None and mask[s + t] == 2 else 1)  # 2: padding
        out.append({"inputs": inputs, "labels": labels, "positions": positions, "attention": attention,
                    "padded": 0 in attention, "epoch": epoch, "cursor": cursor})
    return out


def run_tool(tool, *args, ok=True):
    proc = subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True, timeout=60)
    if ok:
        assert proc.returncode == 0, f"st_tool {args} failed: {proc.stderr}"
    return proc


def batches(tool, path, **kw):
    args = ["tok-batches", path]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [v])
    return [json.loads(line) for line in run_tool(tool, *args).stdout.splitlines()]


def chat_data(n_docs=40, seed=0):
    rng = np.random.default_rng(seed)
    ids, mask, docs = [], [], []
    for _ in range(n_docs):
        prompt, answer = rng.integers(3, 12), rng.integers(2, 9)
        docs.append(len(ids))
        ids += rng.integers(0, 50000, prompt + answer).tolist()
        mask += [0] * prompt + [1] * answer
    return ids, mask, docs


@pytest.mark.parametrize("token_bytes", [2, 4])
def test_numpy_file_reads_and_rewrites_byte_identically(strider_binary, tmp_path, token_bytes):
    tool = strider_binary("st_tool")
    ids, mask, docs = chat_data()
    if token_bytes == 4:
        ids = [i + 70000 for i in ids]
    src, dst = tmp_path / "np.tok", tmp_path / "ours.tok"
    write_tokens(src, ids, token_bytes, mask, docs, vocab=200000 if token_bytes == 4 else 50000)
    info = json.loads(run_tool(tool, "tok-info", src).stdout)
    assert info == {"token_bytes": token_bytes, "num_tokens": len(ids), "flags": 3,
                    "num_docs": len(docs), "vocab_size": 200000 if token_bytes == 4 else 50000}
    run_tool(tool, "tok-copy", src, dst)
    assert dst.read_bytes() == src.read_bytes()


def test_plain_stream_rewrites_byte_identically(strider_binary, tmp_path):
    tool = strider_binary("st_tool")
    src, dst = tmp_path / "np.tok", tmp_path / "ours.tok"
    write_tokens(src, list(range(1, 1000, 3)))
    run_tool(tool, "tok-copy", src, dst)
    assert dst.read_bytes() == src.read_bytes()


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("kind", ["chat", "documents", "stream"])
def test_batches_match_the_documented_rule(strider_binary, tmp_path, shuffle, kind):
    tool = strider_binary("st_tool")
    ids, mask, docs = chat_data()
    if kind != "chat":  # documents alone: only boundaries give -100; stream: nothing does
        mask = None
    if kind == "stream":
        docs = None
    path = tmp_path / "chat.tok"
    write_tokens(path, ids, 2, mask, docs)
    windows = (len(ids) - 1) // 16
    steps = windows // 3 + 4  # past the end of the first epoch
    kw = dict(batch=3, seq=16, seed=1234, steps=steps)
    got = batches(tool, path, **kw, **({} if shuffle else {"no_shuffle": True}))
    want = reference_batches(ids, mask, docs, shuffle=shuffle, **kw)
    assert got == want
    assert got[-1]["epoch"] == 1
    assert any(-100 in b["labels"] for b in got) == (kind != "stream")


def test_resume_from_state_continues_exactly(strider_binary, tmp_path):
    tool = strider_binary("st_tool")
    ids, mask, docs = chat_data(seed=1)
    path = tmp_path / "chat.tok"
    write_tokens(path, ids, 2, mask, docs)
    full = batches(tool, path, batch=2, seq=8, seed=5, steps=40)
    for k in (0, 7, 33):
        state = full[k]
        resumed = batches(tool, path, batch=2, seq=8, seed=5, steps=40 - k - 1,
                          epoch=state["epoch"], cursor=state["cursor"])
        assert resumed == full[k + 1:]


@pytest.mark.parametrize("case,says", [
    ("magic", ["'magic'"]),
    ("version", ["'version' is 3"]),
    ("count", ["'num_tokens'", "truncated"]),
    ("vocab", ["token 2", "vocab size 100"]),
])
def test_bad_files_give_errors_naming_file_and_field(strider_binary, tmp_path, case, says):
    tool = strider_binary("st_tool")
    path = tmp_path / f"{case}.tok"
    ids = [1, 2, 300, 4, 5]
    if case == "magic":
        write_tokens(path, ids, magic=42)
    elif case == "version":
        write_tokens(path, ids, version=3)
    elif case == "count":
        write_tokens(path, ids)
        path.write_bytes(path.read_bytes()[:-8])
    else:
        write_tokens(path, ids)
    args = ["tok-info", path] + (["--vocab", 100] if case == "vocab" else [])
    proc = run_tool(tool, *args, ok=False)
    assert proc.returncode == 1
    assert str(path) in proc.stderr
    for s in says:
        assert s in proc.stderr
