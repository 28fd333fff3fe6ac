"""The process's peak host memory, measured, against the plan's host_peak_bytes:
`strider finetune` on the CPU device loads a real checkpoint, trains and
saves; the kernel's count of its peak resident memory (ru_maxrss) must
be within the figure the plan printed before the run started, and the figure
not padded past 1.25x of it. With layers' compute copies on NVMe the run's
exported model is also the all-in-RAM run's, byte for byte; so with its layers
cut into sub-layer pieces (--mlp-pieces), against the same cut all in RAM."""
import re
import subprocess
import sys

import pytest

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    d = tmp_path_factory.mktemp("peak-model")
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).float().save_pretrained(d)  # ~52M parameters, fp32: a 210 MB file
    return d


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory):
    """Many small layers and a small vocabulary: the layers' compute copies are most of its RAM, so a limit
    that all of its optimizer state on NVMe does not meet moves some of them to NVMe too."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    d = tmp_path_factory.mktemp("peak-deep-model")
    cfg = LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=16, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=4096, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).float().save_pretrained(d)  # ~14M parameters
    return d


# A child's ru_maxrss starts from its parent's memory at fork (the forked copy's high-water mark survives
# exec), so a strider started by pytest would count pytest's own gigabyte (torch, transformers, this
# module's model). A small Python in between forks it instead and reports its children's peak.
LAUNCHER = ("import resource, subprocess, sys\n"
            "rc = subprocess.call(sys.argv[1:])\n"
            "print(f'LAUNCHER child maxrss kB {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}', flush=True)\n"
            "sys.exit(rc)\n")


def run_measured(cmd):
    """Runs cmd; returns (stdout, peak resident bytes of that process alone)."""
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, *map(str, cmd)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out
    m = re.search(r"^LAUNCHER child maxrss kB (\d+)$", out, re.M)
    assert m, out
    return out, int(m.group(1)) * 1024  # Linux reports kB


def planned_peak(out):
    m = re.search(r"at its peak the process holds ~([\d.]+) (B|KiB|MiB|GiB)", out)
    assert m, out
    return float(m.group(1)) * UNITS[m.group(2)]


def refusal_figure(cmd, pattern):
    """Runs a command the plan must refuse; returns the bytes its reason names by `pattern`."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    m = re.search(pattern + r"([\d.]+) (B|KiB|MiB|GiB)", r.stderr)
    assert r.returncode != 0 and m, r.stderr
    return float(m.group(1)) * UNITS[m.group(2)]


def nvme_limit(cmd, nvme_dir, compute):
    """A --host-ram (MiB) for `cmd` that puts most blocks' state on NVMe: one that leaves the arena 300 MiB,
    far less than the model's state. --host-ram bounds the whole process, so first ask the plan what the
    rest of it holds (a limit below that is refused, naming it, before anything is allocated). With
    `compute`, then the least arena it trains in (every block's state and every layer's compute copy on
    NVMe), and a limit a little above that: most layers' compute copies go to NVMe too. (--host-ram is the
    machine's: strider plans within it less 5% left to the OS.)"""
    nvme = ["--nvme", str(nvme_dir)]
    rest = refusal_figure(cmd + ["--host-ram", "1MiB", *nvme], r"is below what the process holds besides its pinned arena: ")
    if not compute:
        return int(rest / 2**20) + 300
    machine_mib = lambda b: int(b / 2**20 / 0.95) + 1  # noqa: E731
    least = refusal_figure(cmd + ["--host-ram", f"{machine_mib(rest + 2**20)}MiB", *nvme], r"needs ")
    return machine_mib(rest + least + 4 * 2**20)


@pytest.mark.parametrize("tier", ["ram", "nvme", "nvme-compute", "nvme-compute-cut"])
def test_peak_rss_is_within_the_plans_host_peak(strider_binary, model_dir, deep_model_dir, tmp_path, tier):
    compute = tier.startswith("nvme-compute")
    model = deep_model_dir if compute else model_dir
    cmd = [str(strider_binary("strider")), "finetune", "--model", str(model), "--device", "cpu",
           "--device-budget", "256MiB", "--seq", "64", "--micro-batch", "2", "--accumulation", "2",
           "--steps", "2", "--eval-batches", "0", "--work-dir", str(tmp_path / "work"), "--out",
           str(tmp_path / "out")]
    if tier == "nvme-compute-cut":  # each layer its attention half and 2 MLP slices (704 rows: fp32 state)
        cmd += ["--mlp-pieces", "2", "--optimizer-state", "fp32"]
    if tier != "ram":
        limit_mib = nvme_limit(cmd, tmp_path / "nvme", compute)
        cmd += ["--host-ram", f"{limit_mib}MiB", "--nvme", str(tmp_path / "nvme")]
    out, rss = run_measured(cmd)
    peak = planned_peak(out)
    print(f"{tier}: planned host peak {peak / 2**20:.0f} MiB, measured peak RSS {rss / 2**20:.0f} MiB")
    assert rss <= peak, out
    assert peak <= 1.25 * rss, out
    if tier != "ram":
        assert "on NVMe" in out and peak <= limit_mib * 2**20, out  # the limit bounds the planned peak
    if compute:
        assert re.search(r"the compute copies of \d+ of 16 layers on NVMe too", out), out
        # The same run all in RAM exports the same bytes. (Formats, clipping, chaos and pools against the
        # resident run: tests/engine/test_engine.cpp.)
        ram = list(cmd[:cmd.index("--host-ram")])
        ram[ram.index("--out") + 1] = str(tmp_path / "out-ram")
        ram[ram.index("--work-dir") + 1] = str(tmp_path / "work-ram")
        r = subprocess.run(ram, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        files = lambda d: [f.read_bytes() for f in sorted(d.glob("*.safetensors"))]  # noqa: E731
        assert files(tmp_path / "out") and files(tmp_path / "out") == files(tmp_path / "out-ram")
