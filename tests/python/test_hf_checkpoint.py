"""engine/model/hf_folder against transformers: a tiny model saved by
`save_pretrained` (one file or sharded, fp32 or bf16) goes through
`ckpt_tool roundtrip` (load into a real ParamStore, write back block by
block) and `from_pretrained` of our output gives the original tensors
exactly. `ckpt_tool check` refuses a checkpoint with a tensor removed, naming it.

The C++ side is tests/engine/ckpt_tool (see its header comment).
"""
import json
import shutil
import subprocess

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def tiny_model(arch: str, dtype):
    """A randomly initialised tiny model; every parameter (norms too) random,
    so a tensor loaded from the wrong place cannot pass for the right one."""
    common = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)
    if arch == "llama":
        config = transformers.LlamaConfig(tie_word_embeddings=False, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "olmo2":  # post-norms, whole-projection q/k norms
        config = transformers.Olmo2Config(pad_token_id=0, **common)
        cls = transformers.Olmo2ForCausalLM
    elif arch == "gemma3":  # four norms a layer, q/k norms, tied
        config = transformers.Gemma3TextConfig(head_dim=16, pad_token_id=0, sliding_window=8, **common)
        cls = transformers.Gemma3ForCausalLM
    else:
        config = transformers.Qwen3Config(tie_word_embeddings=True, head_dim=16, **common)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model.to(dtype), cls


def run_tool(tool, *args, ok=True):
    proc = subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True, timeout=120)
    if ok:
        assert proc.returncode == 0, f"ckpt_tool {args} failed: {proc.stderr}"
    return proc


def load_ours(cls, path, dtype):
    model, info = cls.from_pretrained(path, dtype=dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model


def assert_same_tensors(got, want):
    g, w = got.state_dict(), want.state_dict()
    assert set(g) == set(w)
    for name in w:
        assert g[name].dtype == w[name].dtype, name
        assert torch.equal(g[name], w[name]), name


DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "olmo2", "gemma3"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_roundtrip_through_param_store_is_exact(strider_binary, tmp_path, arch, sharded, dtype):
    tool = strider_binary("ckpt_tool")
    model, cls = tiny_model(arch, DTYPES[dtype])
    src, out = tmp_path / "src", tmp_path / "out"
    model.save_pretrained(src, max_shard_size=20_000 if sharded else "5GB")
    assert (src / "model.safetensors.index.json").exists() == sharded

    args = ["roundtrip", src, out, "--dtype", dtype]
    if sharded:
        args += ["--shard-bytes", 20_000]
    summary = json.loads(run_tool(tool, *args).stdout)
    assert summary["params"] == sum(p.numel() for p in model.parameters())
    assert (out / "model.safetensors.index.json").exists() == sharded
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == {"f32": "float32", "bf16": "bfloat16"}[dtype]
    if arch in ("qwen3", "gemma3"):  # tied: transformers saves no lm_head, neither do we
        names = safetensors_names(out)
        assert "lm_head.weight" not in names

    assert_same_tensors(load_ours(cls, out, DTYPES[dtype]), model)


def test_fp32_to_bf16_rounds_like_torch(strider_binary, tmp_path):
    tool = strider_binary("ckpt_tool")
    model, cls = tiny_model("llama", torch.float32)
    model.save_pretrained(tmp_path / "src")
    run_tool(tool, "roundtrip", tmp_path / "src", tmp_path / "out", "--dtype", "bf16")
    assert_same_tensors(load_ours(cls, tmp_path / "out", torch.bfloat16), model.to(torch.bfloat16))


def safetensors_names(path):
    from safetensors import safe_open
    names = set()
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    return names


def test_check_accepts_a_good_checkpoint_and_names_a_missing_tensor(strider_binary, tmp_path):
    tool = strider_binary("ckpt_tool")
    model, _ = tiny_model("qwen3", torch.bfloat16)
    good, bad = tmp_path / "good", tmp_path / "bad"
    model.save_pretrained(good)
    proc = run_tool(tool, "check", good)
    assert "Qwen3ForCausalLM" in proc.stdout and "tied embeddings" in proc.stdout

    removed = "model.layers.1.mlp.up_proj.weight"
    tensors = safetensors_torch.load_file(str(good / "model.safetensors"))
    assert removed in tensors
    del tensors[removed]
    bad.mkdir()
    safetensors_torch.save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(good / "config.json", bad / "config.json")
    proc = run_tool(tool, "check", bad, ok=False)
    assert proc.returncode == 1
    assert removed in proc.stderr and "missing" in proc.stderr and str(bad) in proc.stderr

    # A roundtrip of the bad checkpoint fails the same way and writes nothing.
    proc = run_tool(tool, "roundtrip", bad, tmp_path / "out", ok=False)
    assert proc.returncode == 1 and removed in proc.stderr
    assert not (tmp_path / "out").exists()
