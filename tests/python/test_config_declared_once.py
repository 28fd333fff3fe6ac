"""The configuration is declared once (engine/config/config_fields.json): the command line's options, the Python
strider.EngineConfig and the engine config JSON share its names, ranges and defaults; the built-in demo
model takes its own values only for what the command line leaves unset, and says so."""
import json
import re
import subprocess

import pytest

import strider
from strider.config import DECLARATION


@pytest.fixture
def strider_cli(strider_binary):
    return strider_binary("strider")


def help_defaults(cli, command):
    """{flag: default text} from `strider <command> --help` (CLI11: "--seq INT:in [1, 16777216]=1024")."""
    out = subprocess.run([str(cli), command, "--help"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return dict(re.findall(r"^\s+(--[a-z0-9-]+) [A-Z]+(?::[^=\n]*?)?=(\S+)", out, re.M))


def python_default(field):
    c = strider.EngineConfig()
    group = field.get("python", True)
    if isinstance(group, str):
        members = [f["name"] for f in DECLARATION["fields"] if f.get("python") == group]
        return getattr(c, group)[members.index(field["name"])]
    return getattr(c, field["name"])


@pytest.mark.parametrize("command", ["finetune", "profile"])
def test_command_line_and_python_share_the_declared_defaults(strider_cli, command):
    shown = help_defaults(strider_cli, command)
    checked = 0
    for f in DECLARATION["fields"]:
        if "flag" not in f or f["flag"] not in shown:
            continue
        checked += 1
        text = shown[f["flag"]]
        if f["type"] in ("int", "number"):
            assert float(text) == float(f["default"]), f["name"]
        else:
            assert text == str(f["default"]), f["name"]
        if f.get("python", True) is not False:
            assert python_default(f) == f["default"], f["name"]
    assert checked >= 20, shown  # every option of a training run is the declaration's


def test_python_fields_are_the_declarations():
    names = {f.name for f in __import__("dataclasses").fields(strider.EngineConfig)}
    declared = {f["name"] for f in DECLARATION["fields"] if f.get("python", True) is True}
    groups = {f["python"] for f in DECLARATION["fields"] if isinstance(f.get("python"), str)}
    assert names == declared | groups
    # The fine-tuning defaults (the demo's are the command line's, for the built-in model only).
    c = strider.EngineConfig()
    assert (c.lr, c.schedule, c.warmup_steps, c.weight_decay, c.betas) == (1e-5, "constant", 0, 0, (0.9, 0.999))


def test_a_bad_value_is_refused_the_same_way_in_python_and_on_the_command_line(strider_cli):
    with pytest.raises(ValueError, match=r"EngineConfig.seq = 0: is outside \[1, 16777216\]"):
        strider.EngineConfig(seq=0)
    proc = subprocess.run([str(strider_cli), "finetune", "--seq", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--seq: 0 is outside [1, 16777216]" in proc.stderr


def plan_json(cli, *args):
    out = subprocess.run([str(cli), "plan", "--json", "--predict", "none", *args], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out)


def test_the_demo_model_takes_its_own_values_and_says_so(strider_cli):
    demo = DECLARATION["demo"]["values"]
    plan = plan_json(strider_cli)
    assert plan["demo_settings"].startswith("demo settings (" + DECLARATION["demo"]["why"])
    assert f"--seq {demo['seq']}" in plan["demo_settings"]
    assert (plan["seq"], plan["micro_batch"], plan["accumulation"]) == (demo["seq"], demo["micro_batch"],
                                                                         demo["accumulation"])
    # What the command line gives wins, and is not listed.
    plan = plan_json(strider_cli, "--seq", "64")
    assert plan["seq"] == 64 and "--seq" not in plan["demo_settings"]
    # A pretrained model takes the declared defaults.
    plan = plan_json(strider_cli, "--model", "llama-3.1-8b")
    assert "demo_settings" not in plan
    seq = next(f["default"] for f in DECLARATION["fields"] if f["name"] == "seq")
    assert plan["seq"] == seq
