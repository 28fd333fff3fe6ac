"""--config files are read by their specs: TOML as Python's tomllib reads it, INI as configparser does
(its strict default), through the real binary. Each file below is refused by strider exactly when the
reference refuses it, and where both read it, strider plans with the value the reference read."""
import configparser
import json
import subprocess
import tomllib

import pytest


@pytest.fixture
def strider(strider_binary):
    return strider_binary("strider")

TOML = {
    "plain": b"seq = 64\nmicro-batch = 2\n",
    "section": b"[plan]\nseq = 64\n",
    "comment": b"# settings\nseq = 64 # tokens\n",
    "string": b'seq = 64\ngpu = "20GiB"\n',
    "bool": b"seq = 64\npacked-documents = true\n",
    "literal string": b"seq = 64\ngpu = '20GiB'\n",
    "key twice": b"seq = 64\nseq = 32\n",
    "key twice in a section": b"[plan]\nseq = 64\nwindow = 3\nseq = 32\n",
    "table twice": b"[plan]\nseq = 64\n[plan]\nwindow = 3\n",
    "dotted then table": b"plan.seq = 64\n[plan]\nwindow = 3\n",
    "bare word": b"seq = 64\nwindow\n",
    "no value": b"seq =\n",
    "unterminated string": b'seq = 64\ngpu = "20GiB\n',
    "ini comment": b"; settings\nseq = 64\n",
    "key with a space": b"micro batch = 2\nseq = 64\n",
    "not utf-8": b"# r\xe9glages\nseq = 64\n",
    "bad escape": b'seq = 64\ngpu = "20\\qGiB"\n',
    "leading zero": b"seq = 064\n",
}

INI = {
    "plain": b"[plan]\nseq = 64\nmicro-batch = 2\n",
    "colon": b"[plan]\nseq: 64\n",
    "comments": b"; one\n# two\n[plan]\nseq = 64\n",
    "key twice": b"[plan]\nseq = 64\nseq = 32\n",
    "section twice": b"[plan]\nseq = 64\n[plan]\nwindow = 3\n",
    "bare word": b"[plan]\nseq = 64\nwindow\n",
    "no equals": b"[plan]\nseq 64\n",
}


def plan(strider, path):
    return subprocess.run([str(strider), "plan", "--config", str(path), "--json"], capture_output=True, timeout=60)


def check(strider, path, reference_error, seq):
    r = plan(strider, path)
    stderr = r.stderr.decode(errors="replace")
    if reference_error is not None:
        assert r.returncode != 0, (path.name, reference_error)
        assert f"--config {path}" in stderr and "line" in stderr, stderr
        return
    assert r.returncode == 0, (path.name, stderr)
    assert json.loads(r.stdout)["seq"] == seq


@pytest.mark.parametrize("name", sorted(TOML))
def test_a_toml_file_is_read_as_tomllib_reads_it(strider, tmp_path, name):
    path = tmp_path / "run.toml"
    path.write_bytes(TOML[name])
    try:
        doc = tomllib.loads(TOML[name].decode())
        error, seq = None, doc.get("seq", doc.get("plan", {}).get("seq"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        error, seq = e, None
    check(strider, path, error, seq)


@pytest.mark.parametrize("name", sorted(INI))
def test_an_ini_file_is_read_as_configparser_reads_it(strider, tmp_path, name):
    path = tmp_path / "run.ini"
    path.write_bytes(INI[name])
    parser = configparser.ConfigParser()  # strict: a key or section twice is an error
    try:
        parser.read_string(INI[name].decode())
        error, seq = None, parser.getint("plan", "seq")
    except configparser.Error as e:
        error, seq = e, None
    check(strider, path, error, seq)


def test_an_ini_file_may_hold_the_command_s_options_before_any_section(strider, tmp_path):
    """configparser wants a section first; strider's files hold one command's options at the top, in INI
    as in TOML."""
    path = tmp_path / "run.ini"
    path.write_bytes(b"; settings\nseq = 64\ngpu = 20GiB\n")
    r = plan(strider, path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["seq"] == 64


def test_a_value_no_option_takes_is_refused_naming_the_key(strider, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("seq = 64\nwhen = 1979-05-27\n")
    r = plan(strider, path)
    assert r.returncode != 0 and "when: a date or time is no option's value" in r.stderr.decode(), r.stderr
