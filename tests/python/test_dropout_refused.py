"""A model whose config.json asks for dropout (attention_dropout, hidden_dropout, Phi-3's embd_pdrop and
resid_pdrop, attn_pdrop) is refused by name, on the command line and in Python: strider trains without
dropout, and a model trained otherwise than its config says would be trained wrong in silence."""
import json
import subprocess

import pytest
import torch
import transformers

import strider  # noqa: E402  (tests/python/conftest.py puts python_shim/ on sys.path)
from conftest import require_op_library  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
FIELDS = ("attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "attn_pdrop")


@pytest.fixture(scope="module")
def strider_cli(strider_binary):
    return strider_binary("strider")


@pytest.mark.parametrize("field", FIELDS)
def test_the_command_line_refuses_dropout_by_name(strider_cli, tmp_path, field):
    path = tmp_path / "config.json"
    for value, refused in ((0.5, True), (0.0, False)):
        path.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **TINY, field: value}))
        proc = subprocess.run([str(strider_cli), "plan", "--model", str(path), "--predict", "none"],
                              capture_output=True, text=True, timeout=120)
        if refused:
            assert proc.returncode != 0
            assert f"{path}: field '{field}' = 0.5: strider trains without dropout" in proc.stderr, proc.stderr
        else:
            assert proc.returncode == 0, proc.stderr


def test_finetune_refuses_a_checkpoint_with_dropout_before_any_step(strider_cli, tmp_path):
    cfg = transformers.LlamaConfig(**TINY, attention_dropout=0.1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    proc = subprocess.run([str(strider_cli), "finetune", "--model", str(tmp_path / "model"), "--device", "cpu",
                           "--seq", "16", "--steps", "1", "--eval-batches", "0", "--work-dir", str(tmp_path / "w"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "field 'attention_dropout' = 0.1" in proc.stderr, proc.stderr
    assert not any((tmp_path / "out").glob("*"))


def test_the_python_engine_refuses_dropout_by_name():
    require_op_library()
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, attention_dropout=0.5))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="field .attention_dropout. = 0.5: strider trains without dropout"):
        strider.Engine(model, strider.EngineConfig(seq=16, device="cpu"))
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())  # untouched
