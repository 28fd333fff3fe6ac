"""strider.EngineConfig is a class an editor can read: scripts/gen_engine_config.py writes its fields, their
types and their help into python_shim/strider/config.py from engine/config/config_fields.json, and the
committed file must be what the script writes from the committed declaration."""
import importlib.util
import json
import subprocess
import sys
import typing
from pathlib import Path

import strider
from strider.config import DECLARATION

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gen_engine_config.py"


def generator():
    spec = importlib.util.spec_from_file_location("gen_engine_config", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_py_is_what_the_declaration_generates():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_declaration_changed_without_the_generator_is_caught(tmp_path, capsys):
    gen = generator()
    changed = json.loads(gen.DECLARATION.read_text())
    seq = next(f for f in changed["fields"] if f["name"] == "seq")
    seq["default"] = 2048
    seq["help"] = "tokens per sequence, changed"
    gen.DECLARATION = tmp_path / "config_fields.json"
    gen.DECLARATION.write_text(json.dumps(changed))
    assert gen.main(["--check"]) == 1
    out = capsys.readouterr()
    assert "+    seq: int = 2048" in out.out and '"""tokens per sequence, changed"""' in out.out
    assert "run scripts/gen_engine_config.py" in out.err


def test_every_field_has_its_declared_type_default_and_help():
    hints = typing.get_type_hints(strider.EngineConfig)
    source = (REPO / "python_shim" / "strider" / "config.py").read_text()
    for f in DECLARATION["fields"]:
        group = f.get("python", True)
        if group is False:
            assert f["name"] not in hints
            continue
        name = group if isinstance(group, str) else f["name"]
        assert name in hints, name
        if isinstance(group, str):
            continue
        if f["type"] == "choice":
            assert typing.get_origin(hints[name]) is typing.Literal and typing.get_args(hints[name]) == tuple(
                f["choices"]), name
        # The help is the field's docstring, under its line (wrapped: compare the first words).
        line = next(i for i, text in enumerate(source.splitlines()) if text.startswith(f"    {name}: "))
        doc = source.splitlines()[line + 1].strip().lstrip('"')
        assert f["help"].startswith(doc[:40].rstrip('"')), name
    assert typing.get_args(hints["betas"]) == (float, float)
