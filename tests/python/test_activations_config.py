"""Kept activations from Python and the command line: strider.EngineConfig's
`activations` ("auto", "recompute", "saved") is checked like every field and
becomes the plan's saved_blocks (python_shim/engine_plan.h), as on the command line;
`strider plan --activations` shows the plan's choice."""
import json
import subprocess

import pytest
import torch

import strider  # noqa: E402  (tests/python/conftest.py puts python_shim/ on sys.path)
from strider.config import engine_settings  # noqa: E402

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}


def config(**over):
    return strider.EngineConfig(**{**dict(seq=16, micro_batch=2, accumulation=2, dtype="fp32", device="cpu"),
                                   **over})


def test_activations_is_checked_and_goes_to_the_binding():
    assert strider.EngineConfig().activations == "auto"
    for good in ("auto", "recompute", "saved"):
        assert config(activations=good).engine_dict()["activations"] == good
    for bad in ("keep", "", None, True):
        with pytest.raises(ValueError, match=r"EngineConfig\.activations = .*must be one of \('auto', "
                                             r"'recompute', 'saved'\)"):
            config(activations=bad)
    c = config()
    c.activations = "all"  # edited after construction: validate() catches it
    with pytest.raises(ValueError, match=r"EngineConfig\.activations = 'all'"):
        c.validate()


def test_saved_blocks_in_saved_state_are_placement_chosen_again():
    # A training checkpoint's engine config holds the layers that kept their activations; a resumed run
    # chooses again on its machine (by `activations`), so the saved list is not a config field.
    d = config(activations="saved").engine_dict()
    del d["activations"]
    d["saved_blocks"] = [1, 2, 3]
    c = strider.EngineConfig.from_engine_dict(d, device="cpu")
    assert c.activations == "auto"
    assert "saved_blocks" not in c.engine_dict()


def engine(mode, **over):
    try:
        strider.load_library()
    except ImportError as e:
        pytest.skip(str(e))
    return torch.classes.strider.Engine(json.dumps(TINY), config(activations=mode, **over).engine_settings(), "cpu", 0,
                                        False, 1)


def saved_blocks(e):
    return json.loads(e.engine_config_json())["saved_blocks"]


def test_the_engine_keeps_what_its_plan_chooses():
    # The binding chooses nothing itself: the engine keeps the activations and logits of the plan that
    # strider.plan shows (python_shim/engine_plan.h), the CPU device's rates measured once per process.
    layers = list(range(1, TINY["num_hidden_layers"] + 1))
    assert saved_blocks(engine("recompute")) == []
    assert saved_blocks(engine("saved")) == layers  # no RAM limit: every layer
    for mode in ("recompute", "saved", "auto"):
        chosen = json.loads(engine(mode).engine_config_json())
        plan = strider.plan(TINY, config(activations=mode))
        assert plan["activations"] == mode
        assert (chosen["saved_blocks"], chosen["keep_logits"]) == (plan["saved_blocks"], plan["keep_logits"])


def test_a_saved_block_outside_the_layers_is_refused():
    try:
        strider.load_library()
    except ImportError as e:
        pytest.skip(str(e))
    d = config().engine_dict()
    del d["activations"]
    for blocks, says in [([0], "'saved_blocks' = \\[0\\] holds 0"), ([4], "saved_blocks holds 4, which is not a decoder-layer "
                                                                "block \\(1..3\\)"), ([1, 1], "twice")]:
        with pytest.raises(ValueError, match=says):
            torch.classes.strider.Engine(json.dumps(TINY), engine_settings({**d, "saved_blocks": blocks}), "cpu", 0,
                                         False, 1)
    with pytest.raises(ValueError, match="activations 'keep' is not auto, recompute or saved"):
        torch.classes.strider.Engine(json.dumps(TINY), engine_settings({**d, "activations": "keep"}), "cpu", 0, False, 1)


@pytest.fixture
def strider_cli(strider_binary):
    return strider_binary("strider")


def plan(strider_cli, tmp_path, *args):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return subprocess.run([str(strider_cli), "plan", "--model", str(path), "--seq", "32", "--predict", "none",
                           *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("mode, layers", [("saved", 3), ("recompute", 0)])
def test_plan_shows_the_activations_choice(strider_cli, tmp_path, mode, layers):
    proc = plan(strider_cli, tmp_path, "--activations", mode, "--json")
    assert proc.returncode == 0, proc.stderr
    j = json.loads(proc.stdout)
    assert j["activations"] == mode
    assert j["saved_layers"] == layers
    assert j["saved_blocks"] == list(range(1, layers + 1))
    assert any(w.startswith("activations: ") for w in j["why"])
    text = plan(strider_cli, tmp_path, "--activations", mode)
    assert "activations: " in text.stdout


def test_plan_refuses_an_unknown_activations_mode(strider_cli, tmp_path):
    proc = plan(strider_cli, tmp_path, "--activations", "keep")
    assert proc.returncode != 0
    assert "--activations" in proc.stderr and "keep" in proc.stderr


def test_profile_reports_the_kept_activations_traffic(strider_cli, tmp_path):
    proc = subprocess.run([str(strider_cli), "profile", "--device", "cpu", "--seq", "32", "--micro-batch", "2",
                           "--accumulation", "2", "--skip-steps", "1", "--steps", "1", "--work-dir",
                           str(tmp_path / "work"), "--out", str(tmp_path / "prof"), "--no-png", "--activations",
                           "saved", "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    j = json.loads(proc.stdout)
    layers = j["saved_layers"]
    assert layers >= 1 and j["saved_blocks"] == list(range(1, layers + 1))
    act = j["activations"]
    # Out in forward, back in backward: the same bytes each way, part of the step's traffic.
    assert act["d2h_bytes"] > 0 and act["d2h_bytes"] == act["h2d_bytes"]
    assert act["d2h_bytes"] <= j["d2h_bytes_per_step"] and act["h2d_bytes"] <= j["h2d_bytes_per_step"]
    assert act["d2h_busy_s"] > 0 and act["h2d_busy_s"] > 0
    assert j["per_step"][0]["activations"]["d2h_bytes"] == act["d2h_bytes"]
    assert "of which kept activations" in proc.stderr


def test_kept_activations_and_logits_train_the_same_bits_from_python():
    """A transformers model trained through strider.Engine: every layer and the head keeping what their
    backward needs ("saved") gives the same losses and weights, bit for bit, as recomputing everything."""
    transformers = pytest.importorskip("transformers")
    try:
        strider.load_library()
    except ImportError as e:
        pytest.skip(str(e))
    cfg = transformers.LlamaConfig(**{k: v for k, v in TINY.items() if k != "architectures"})
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, TINY["vocab_size"], (4, 16), generator=g) for _ in range(3)]

    def train(mode):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        e = strider.Engine(model, config(dtype="bf16", activations=mode, device_budget="64MiB", chaos=True,
                                         lr=1e-3))
        losses = [e.step(ids, ids.clone()).loss for ids in batches]
        e.finish()
        chosen = json.loads(e._engine.engine_config_json())
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, chosen

    losses_kept, params_kept, kept = train("saved")
    losses_re, params_re, re = train("recompute")
    assert kept["saved_blocks"] == [1, 2, 3] and kept["keep_logits"]
    assert re["saved_blocks"] == [] and not re["keep_logits"]
    assert losses_kept == losses_re
    for name, p in params_re.items():
        assert torch.equal(params_kept[name], p), name
