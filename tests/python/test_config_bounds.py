"""`strider plan --model config.json` refuses a config whose numbers no machine
could hold, at once and naming the file, the field and its range, instead of
looping over (or allocating for) a trillion layers."""
import json
import subprocess
import time

import pytest

# A small Llama that plans in a moment on the default 24 GiB budget.
TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 1024}

# The whole run, process start included; the refusal itself takes
# microseconds. A config that reached a loop over 10^12 layers would take hours.
QUICK_S = 10


@pytest.fixture
def strider(strider_binary):
    return strider_binary("strider")


def plan(strider, tmp_path, **fields):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, **fields}))
    start = time.monotonic()
    proc = subprocess.run([str(strider), "plan", "--model", str(path), "--predict", "none"],
                          capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - start, path


def test_the_tiny_config_plans(strider, tmp_path):
    proc, _, _ = plan(strider, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "2 layers" in proc.stdout


@pytest.mark.parametrize("fields, says", [
    ({"num_hidden_layers": 1_000_000_000_000},
     "field 'num_hidden_layers' = 1000000000000 is outside [1, 100000]"),
    ({"num_hidden_layers": 100_000_000}, "field 'num_hidden_layers' = 100000000 is outside [1, 100000]"),
    # json.dumps(1e12) writes 1000000000000.0: a float, not an integer.
    ({"num_hidden_layers": 1e12}, "field 'num_hidden_layers' = 1000000000000.0 is a floating-point number; "
                                  "it must be an integer in [1, 100000]"),
    ({"vocab_size": 2**64 - 1}, "field 'vocab_size' = 18446744073709551615 is outside [1, 16777216]"),
    ({"hidden_size": 2**21, "head_dim": 16}, "field 'hidden_size' = 2097152 is outside [1, 1048576]"),
    ({"num_attention_heads": 0}, "field 'num_attention_heads' = 0 is outside [1, 65536]"),
    ({"rms_norm_eps": 0}, "field 'rms_norm_eps' = 0 is outside (0, 1]"),
    # Every field in range, their product past any machine.
    ({"num_hidden_layers": 100000, "hidden_size": 2**20, "intermediate_size": 2**22},
     "past the 1e+14 strider accepts"),
])
def test_plan_refuses_sizes_past_any_machine(strider, tmp_path, fields, says):
    proc, elapsed, path = plan(strider, tmp_path, **fields)
    assert proc.returncode != 0
    assert f"{path}: " in proc.stderr
    assert says in proc.stderr, proc.stderr
    assert elapsed < QUICK_S, f"took {elapsed:.1f} s"


@pytest.mark.parametrize("override, says", [
    ("h2d_gbps=1e-30", "h2d_gbps=1e-30 is outside [0.0001, 100000]"),
    ("peak_tflops=1e30", "peak_tflops=1e30 is outside [0.0001, 100000]"),
    ("cpu_adam_params_per_s=1", "cpu_adam_params_per_s=1 is outside [1000, 1e+13]"),
    ("copy_latency_us=1e12", "copy_latency_us=1e12 is outside [0, 1e+08]"),
])
def test_predict_refuses_rates_no_machine_has(strider, tmp_path, override, says):
    # A typo'd rate would predict "0 tokens/s, 3.2e31 s/step"; refused by name, and a slow one still plans.
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    proc = subprocess.run([str(strider), "plan", "--model", str(path), "--predict", f"rtx4090,{override}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and says in proc.stderr and "what a machine can be" in proc.stderr, proc.stderr
    slow = subprocess.run([str(strider), "plan", "--model", str(path), "--predict", "rtx4090,h2d_gbps=0.01"],
                          capture_output=True, text=True, timeout=120)
    assert slow.returncode == 0, slow.stderr
