"""Writes the small files in this folder: valid seeds and malformed cases.

They seed the fuzz drivers (io/fuzz) and tests/io/test_*.cpp checks the error
each malformed one gives. Rerun after changing a case:
    .venv/bin/python tests/io/corpus/make_corpus.py
"""
import json
import os
import struct

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def st_bytes(header, data, pad=True, length=None):
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    n = len(text) if length is None else length
    return struct.pack("<Q", n) + text + data


def write(sub, name, blob):
    os.makedirs(os.path.join(HERE, sub), exist_ok=True)
    with open(os.path.join(HERE, sub, name), "wb") as f:
        f.write(blob)


def safetensors_cases():
    from safetensors.numpy import save
    valid = save({
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.arange(4, dtype=np.int16),
        "s": np.array(7, dtype=np.int64),
        "e": np.zeros((0, 5), dtype=np.uint8),
    }, metadata={"format": "pt"})
    write("safetensors", "valid_small.safetensors", valid)
    write("safetensors", "valid_empty.safetensors", st_bytes({}, b""))
    f32 = lambda name, shape, b, e: {name: {"dtype": "F32", "shape": shape, "data_offsets": [b, e]}}
    data16 = bytes(range(16))
    # Each malformed file: (name, bytes). The test holds the expected error text.
    cases = {
        "truncated": valid[:-5],
        "overlap": st_bytes({**f32("a", [2], 0, 8), **f32("b", [2], 4, 12)}, data16[:12]),
        "lying_dtype": st_bytes({"x": {"dtype": "F64", "shape": [2], "data_offsets": [0, 8]}}, data16[:8]),
        "unknown_dtype": st_bytes({"x": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, data16[:8]),
        "huge_header": struct.pack("<Q", 200_000_000) + b"{}" + b" " * 6,
        "header_past_eof": st_bytes({}, b"", length=4096),
        "not_json": struct.pack("<Q", 8) + b"{abc: 1}",
        "not_object": struct.pack("<Q", 8) + b"[1,2,3] ",
        "negative_shape": st_bytes({"neg": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, data16[:8]),
        "offset_out_of_range": st_bytes(f32("far", [4], 8, 24), data16),
        "gap": st_bytes({**f32("a", [1], 0, 4), **f32("b", [1], 8, 12)}, data16[:12]),
        "trailing_bytes": st_bytes(f32("a", [2], 0, 8), data16),
        "shape_overflow": st_bytes({"big": {"dtype": "F32", "shape": [2**62, 8], "data_offsets": [0, 0]}}, b""),
        "metadata_value": st_bytes({"__metadata__": {"k": 3}}, b""),
        "too_small": b"\x08\x00\x00",
    }
    for name, blob in cases.items():
        write("safetensors", f"bad_{name}.safetensors", blob)


def token_file(ids, token_bytes=2, mask=None, docs=None, vocab=0, header_edit=None, cut=0):
    h = np.zeros(128, "<u8")
    h[0] = int.from_bytes(b"STRDTOKN", "little")
    flags = (1 if mask is not None else 0) | (2 if docs is not None else 0)
    h[1], h[2], h[3], h[4], h[5], h[6] = 1, token_bytes, len(ids), flags, len(docs or []), vocab
    if header_edit:
        header_edit(h)
    dt = "<u2" if token_bytes == 2 else "<u4"
    out = h.tobytes() + np.asarray(ids, dt).tobytes()
    out += b"\0" * (-len(out) % 8)
    if mask is not None:
        out += np.asarray(mask, "u1").tobytes()
        out += b"\0" * (-len(out) % 8)
    if docs is not None:
        out += np.asarray(docs, "<u8").tobytes()
    return out[:len(out) - cut]


def token_cases():
    ids = [5, 1, 2, 3, 9, 4, 4, 7, 0]
    write("tokens", "valid_u16.tok", token_file(ids, vocab=10))
    write("tokens", "valid_u32_mask_docs.tok",
          token_file([70000, 1, 2, 3, 4], 4, mask=[1, 0, 1, 1, 0], docs=[0, 3]))
    cases = {
        "magic": token_file(ids, header_edit=lambda h: h.__setitem__(0, 1234)),
        "version": token_file(ids, header_edit=lambda h: h.__setitem__(1, 7)),
        "token_bytes": token_file(ids, header_edit=lambda h: h.__setitem__(2, 3)),
        "count": token_file(ids, header_edit=lambda h: h.__setitem__(3, 1000)),
        "count_huge": token_file(ids, header_edit=lambda h: h.__setitem__(3, 2**63)),
        "truncated": token_file(ids, cut=2),
        "vocab": token_file(ids, vocab=8),
        "docs_order": token_file(ids, docs=[0, 4, 2]),
        "mask_value": token_file(ids, mask=[1, 1, 3, 1, 1, 1, 1, 1, 1]),
        "short_header": token_file(ids)[:100],
        "reserved": token_file(ids, header_edit=lambda h: h.__setitem__(100, 1)),
    }
    for name, blob in cases.items():
        write("tokens", f"bad_{name}.tok", blob)


if __name__ == "__main__":
    safetensors_cases()
    token_cases()
