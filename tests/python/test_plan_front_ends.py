"""One plan for every front end: strider.plan (what strider.Engine runs by, python_shim/engine_plan.h) and
`strider plan --json` give the same window, tile, checkpoints, kept activations and logits for the same model,
settings and device budget, on three models (dense Llama and Qwen2 shapes, a Qwen3 mixture of experts). The
settings reach both through PlanLimits::take_settings and the machine through set_device_rates ("cuda" and
`--predict none` both plan on the rtx4090's rates), so Python chooses nothing of its own."""
import json
import subprocess

import pytest

import strider  # noqa: E402  (tests/python/conftest.py puts python_shim/ on sys.path)
from conftest import require_op_library  # noqa: E402

require_op_library()


def llama_8b():
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False}


def qwen25_14b():
    return {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 5120, "intermediate_size": 13824,
            "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "tie_word_embeddings": False}


def qwen3_30b_a3b():
    return {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
            "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False}


# (activations, device budget, seq, micro_batch, accumulation): budgets and shapes where the plan keeps
# some layers' activations, all, or none, and the logits or not.
CASES = [("auto", "24GiB", 4096, 1, 8), ("saved", "24GiB", 2048, 2, 4), ("auto", "12GiB", 1024, 8, 1),
         ("recompute", "24GiB", 1024, 1, 1), ("auto", "80GiB", 8192, 1, 2)]
COMPARED = ("feasible", "window", "token_tile", "checkpoints_on_host", "expert_pieces", "mlp_pieces", "activations",
            "saved_blocks", "keep_logits", "device_buffer_bytes", "device_peak_bytes")


@pytest.fixture(scope="module")
def strider_cli(strider_binary):
    return strider_binary("strider")


@pytest.mark.parametrize("make", [llama_8b, qwen25_14b, qwen3_30b_a3b])
def test_python_and_the_command_line_plan_alike(strider_cli, tmp_path, make):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(make()))
    seen = []
    for activations, budget, seq, micro_batch, accumulation in CASES:
        proc = subprocess.run([str(strider_cli), "plan", "--model", str(path), "--gpu", budget, "--predict", "none",
                               "--seq", str(seq), "--micro-batch", str(micro_batch), "--accumulation",
                               str(accumulation), "--activations", activations, "--json"],
                              capture_output=True, text=True, timeout=300)
        assert proc.stdout, proc.stderr
        cli = json.loads(proc.stdout)
        py = strider.plan(make(), strider.EngineConfig(seq=seq, micro_batch=micro_batch, accumulation=accumulation,
                                                       activations=activations, device="cuda",
                                                       device_budget=budget))
        case = f"{make.__name__} {activations} {budget} seq {seq} x {micro_batch} x {accumulation}"
        assert {k: py[k] for k in COMPARED} == {k: cli[k] for k in COMPARED}, case
        seen.append(cli)
    # Not a comparison of two empty answers: the plans differ between the cases.
    assert any(p["feasible"] for p in seen)
    assert len({(tuple(p["saved_blocks"]), p["keep_logits"], p["window"]) for p in seen}) > 1


def test_an_engine_says_the_plan_it_runs_by():
    # Engine.plan(): strider.plan of the engine's own model and config, the window it chose for window 0.
    require_op_library()
    import torch
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    for window in (0, 3):
        config = strider.EngineConfig(seq=32, window=window, device="cpu", device_budget="64MiB")
        engine = strider.Engine(model, config)
        got = engine.plan()
        alone = strider.plan(dict(model.config.to_dict(), architectures=["LlamaForCausalLM"]), config)
        assert {k: got[k] for k in COMPARED} == {k: alone[k] for k in COMPARED}  # host bytes count the process now
        assert got["window"] == window if window else got["window"] >= 2
        # ... and the window it says is the one the engine runs with (its engine config, as built).
        assert got["window"] == json.loads(engine._engine.engine_config_json())["window"]
        ids = torch.randint(0, 256, (1, 32))
        assert engine.step(ids, ids.clone()).peak_device_bytes > 0
        engine.finish()
        del engine  # one engine on a model at a time
