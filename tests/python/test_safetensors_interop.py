"""io/safetensors against the reference: files the `safetensors` package and
`transformers` write load bit-identically through our reader, and files our
writer produces (single and sharded, with index) load in both.

The C++ side is driven through tests/io/st_tool (see its header comment).
"""
import json
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

TORCH_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def raw_bytes(t: "torch.Tensor") -> bytes:
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def run_tool(tool, *args, ok=True):
    proc = subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True, timeout=120)
    if ok:
        assert proc.returncode == 0, f"st_tool {args} failed: {proc.stderr}"
    return proc


def dump(tool, path, raw_dir):
    raw_dir.mkdir(exist_ok=True)
    return json.loads(run_tool(tool, "dump", path, "--raw", raw_dir).stdout)


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "w.f32": torch.randn(3, 5, generator=g),
        "w.f64": torch.randn(4, generator=g, dtype=torch.float64),
        "w.f16": torch.randn(2, 3, 4, generator=g).half(),
        "w.bf16": torch.randn(7, 3, generator=g).bfloat16(),
        "ids.i64": torch.arange(-3, 6, dtype=torch.int64),
        "ids.i32": torch.arange(10, dtype=torch.int32).reshape(2, 5),
        "ids.i16": torch.tensor([-32768, 0, 32767], dtype=torch.int16),
        "ids.i8": torch.tensor([-128, 1, 127], dtype=torch.int8),
        "bytes.u8": torch.arange(0, 255, 3, dtype=torch.uint8),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }


def check_dump_matches(d, tensors, raw_dir):
    assert set(d["tensors"]) == set(tensors)
    for name, t in tensors.items():
        info = d["tensors"][name]
        assert info["dtype"] == TORCH_TO_ST[t.dtype], name
        assert info["shape"] == list(t.shape), name
        assert pathlib.Path(info["raw"]).read_bytes() == raw_bytes(t), name


def test_files_written_by_safetensors_load_bit_identically(strider_binary, tmp_path):
    tool = strider_binary("st_tool")
    tensors = sample_tensors()
    path = tmp_path / "ref.safetensors"
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt", "who": "pytest"})
    d = dump(tool, path, tmp_path / "raw")
    check_dump_matches(d, tensors, tmp_path / "raw")
    assert d["metadata"] == {"format": "pt", "who": "pytest"}


@pytest.mark.parametrize("shard_bytes", [0, 200])
def test_files_we_write_load_in_safetensors(strider_binary, tmp_path, shard_bytes):
    tool = strider_binary("st_tool")
    tensors = sample_tensors()
    src = tmp_path / "src.safetensors"
    safetensors_torch.save_file(tensors, str(src), metadata={"format": "pt"})
    out = tmp_path / "out"
    out.mkdir()
    files = json.loads(run_tool(tool, "copy", src, out, "--shard-bytes", shard_bytes).stdout)
    assert sorted(p.name for p in out.iterdir()) == sorted(files)  # no temp files left
    if shard_bytes:
        assert len(files) > 2 and files[-1] == "model.safetensors.index.json"
        index = json.loads((out / files[-1]).read_text())
        assert set(index["weight_map"]) == set(tensors)
        assert index["metadata"]["total_size"] == sum(len(raw_bytes(t)) for t in tensors.values())
        shard_of = index["weight_map"]
    else:
        assert files == ["model.safetensors"]
        shard_of = {name: "model.safetensors" for name in tensors}
    for name, t in tensors.items():
        with safe_open(str(out / shard_of[name]), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            got = f.get_tensor(name)
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert raw_bytes(got) == raw_bytes(t), name
    # And our reader reads back what our writer wrote.
    d = dump(tool, out, tmp_path / "raw2")
    check_dump_matches(d, tensors, tmp_path / "raw2")


def tiny_llama(tmp_path, max_shard_size):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    src = tmp_path / "hf"
    model.save_pretrained(str(src), max_shard_size=max_shard_size)
    return transformers, model, src


def test_sharded_transformers_checkpoint_round_trips(strider_binary, tmp_path):
    tool = strider_binary("st_tool")
    transformers, model, src = tiny_llama(tmp_path, "8KB")
    assert (src / "model.safetensors.index.json").exists(), "expected a sharded checkpoint"
    state = {k: v for k, v in model.state_dict().items()}

    # transformers' shards load bit-identically through the index.
    d = dump(tool, src, tmp_path / "raw")
    assert len(d["files"]) > 1
    for name, info in d["tensors"].items():
        assert pathlib.Path(info["raw"]).read_bytes() == raw_bytes(state[name]), name
    assert set(d["tensors"]) == set(json.loads(
        (src / "model.safetensors.index.json").read_text())["weight_map"])

    # Our sharded rewrite loads in transformers to the same parameters.
    out = tmp_path / "ours"
    out.mkdir()
    run_tool(tool, "copy", src, out, "--shard-bytes", 6000)
    assert (out / "model.safetensors.index.json").exists()
    shutil.copy(src / "config.json", out / "config.json")
    reloaded = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    for name, t in reloaded.state_dict().items():
        assert torch.equal(t, state[name]), name


def test_malformed_file_gives_error_naming_file_and_tensor(strider_binary, tmp_path):
    tool = strider_binary("st_tool")
    path = tmp_path / "bad.safetensors"
    safetensors_torch.save_file({"a": torch.zeros(4), "b": torch.ones(8)}, str(path))
    blob = path.read_bytes()
    path.write_bytes(blob[:-4])  # truncate the last tensor
    proc = run_tool(tool, "dump", path, ok=False)
    assert proc.returncode == 1
    assert str(path) in proc.stderr and "data_offsets" in proc.stderr
    assert "'a'" in proc.stderr or "'b'" in proc.stderr
