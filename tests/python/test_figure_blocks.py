"""bench/figure_blocks.py, the one finder of the pages' figure blocks, and bench/readme_figures.py rendering
every block from a run's logs (made up here: the figures are not the point, the plumbing is). Plain Python: no
build needed."""
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

if str(REPO_ROOT / "bench") not in sys.path:  # as when a bench script runs: its neighbours import
    sys.path.insert(0, str(REPO_ROOT / "bench"))
import figure_blocks  # noqa: E402

README = "Intro: <!-- figures:begin inline -->old<!-- figures:end --> words.\n"
DOCS = "# Page\n\n<!-- figures:begin table -->\n| a |\n<!-- figures:end -->\nAfter.\n"


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(README)
    (tmp_path / "docs" / "measured.md").write_text(DOCS)
    return tmp_path


def test_a_block_is_found_in_the_readme_or_a_docs_page(tree):
    assert figure_blocks.find_block("inline", tree / "README.md") == (tree / "README.md", "old")
    assert figure_blocks.find_block("table", tree / "README.md") == (tree / "docs" / "measured.md", "\n| a |\n")


def test_replace_keeps_the_page_and_the_blocks_shape(tree):
    assert figure_blocks.replace_block("inline", "new", tree / "README.md")
    assert figure_blocks.replace_block("table", "| b |", tree / "README.md")
    assert not figure_blocks.replace_block("table", "| b |", tree / "README.md")  # already there
    assert (tree / "README.md").read_text() == README.replace("old", "new")
    assert (tree / "docs" / "measured.md").read_text() == DOCS.replace("| a |", "| b |")


def test_a_missing_block_names_the_block_and_the_pages(tree):
    with pytest.raises(SystemExit) as e:
        figure_blocks.find_block("nowhere", tree / "README.md")
    msg = str(e.value)
    assert "'nowhere'" in msg and str(tree / "README.md") in msg and str(tree / "docs" / "measured.md") in msg


def test_a_block_in_two_pages_names_both(tree):
    (tree / "docs" / "again.md").write_text(DOCS)
    with pytest.raises(SystemExit, match="found in .*again.md, .*measured.md"):
        figure_blocks.find_block("table", tree / "README.md")


def test_the_projects_pages_hold_known_blocks_each_once():
    seen = {}
    for page in figure_blocks.pages():
        for name in figure_blocks.blocks(page.read_text()):
            assert name in figure_blocks.COMMANDS, f"{page}: block '{name}' has no command in figure_blocks.COMMANDS"
            assert name not in seen, f"block '{name}' is in {seen.get(name)} and {page}"
            seen[name] = page


def test_readme_figures_writes_the_predict_blocks_from_their_logs(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    rows = []
    for name in ("predict-dp", "predict-pool", "predict-past-ram"):
        body = f"| {name} |\n| x |"
        (logs / f"{name}.log").write_text(f"a row\n{figure_blocks.marked(name, body)}\n")
        rows.append(f"{name}\t0\t0\t1.0\t.venv/bin/python bench/{name.replace('-', '_')}.py\n")
    (logs / "commands.tsv").write_text("".join(rows))
    script = REPO_ROOT / "bench" / "readme_figures.py"
    r = subprocess.run([sys.executable, script, logs, "--parts", "predict", "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "block.predict-pool:" in r.stdout and "<block of 2 lines>" in r.stdout

    (logs / "predict-pool.log").write_text("it printed no block\n")
    r = subprocess.run([sys.executable, script, logs, "--parts", "predict", "--check"], capture_output=True, text=True)
    assert r.returncode == 1 and "MISSING block.predict-pool" in r.stdout


# ---- bench/readme_figures.py on a whole run's logs, made up: every block renders, --check holds -----------------

PLAN = {"step_s": 2.0, "tokens_per_s": 4096.0, "lower_bound_s": 1.5, "overlap_efficiency": 0.9, "critical_lane": "compute",
        "saved_layers": 4, "saved_host_bytes": 2**33, "host_pinned_bytes": 2**37, "host_bytes": 2**37,
        "why": ["32 blocks: 32 layers", "cache units of one layer (218103808 parameters)"], "unit_bytes": 2**31,
        "lane_busy_s": {"optimizer": 1.2, "nvme write": 3.0}, "vocab_shards": 4, "nvme_blocks": [1, 2],
        "nvme_bytes": 2**38, "model": "Llama (8.03B parameters)",
        "other_formats": [{"optimizer_state": "fp32", "host_bytes": 2**38, "nvme_blocks": 5}]}
REFUSED = {"feasible": False, "reason": "needs 300.5 GiB of pinned host RAM, 140.2 GiB of it the frozen base"}
RUNS = {
    "profile": {"command": "profile", "step_s": 0.25, "tokens_per_s": 1.0, "critical_lane": "compute",
                "lanes": {lane: {"busy_fraction": 0.5} for lane in ("compute", "h2d", "d2h", "optimizer")},
                "overlap_efficiency": 0.9, "model_flops_per_s": 1.3e11, "executed_flops_per_s": 1.3e11, "params": 5.4e6},
    "bench_step": {"bench": "step", "offload_over_resident": 1.05, "overlap_efficiency": 0.99, "critical_lane": "compute"},
    "bench_calibrate": {"bench": "calibrate", "ratio": 0.997,
                        "configs": [{"ratio": 0.997, "accumulation": 2}, {"ratio": 0.97, "accumulation": 1}]},
    "bench_adam": {"bench": "adam", "isa": "avx512", "roofline_ratio": 0.93, "vs_torch": 1.3, "q8_roofline_ratio": 0.46,
                   "q8_speedup": 1.85, "deepspeed": "0.19.8", "vs_deepspeed": 1.06,
                   "runs": [{"roofline_ratio": 0.99, "vs_torch": 1.8, "q8_params_per_s": 1.1e9, "ours_params_per_s": 9.6e8,
                             "q8_roofline_ratio": 0.47, "q8_speedup": 2.1, "q8_loops_params_per_s": 5.5e8,
                             "params": 16e6, "threads": 1, "vs_deepspeed": 1.4}]},
    "bench_nvme": {"bench": "nvme", "write_vs_fio": 1.0, "read_vs_fio": 0.96, "fio_write_max_over_min": 1.5,
                   "fio_read_max_over_min": 1.2, "size_bytes": 2**31, "pairs": 6,
                   "configs": [{"write": {"ratio": 1.1}, "read": {"ratio": 1.1}, "chunk_mib": 1, "depth": 8}]},
    "bench_nvme_extents": {"bench": "nvme", "pairs": 4, "configs": [
        {"read": {"ratio": 0.98, "store_gbs": {"median": 2.6}, "fio_gbs": {"median": 2.65}}, "write": {"ratio": 0.88},
         "extent_bytes": 2**28, "inflight_extents": 2, "chunk_mib": 1, "depth": 32}]},
    "bench_vs_torch": {"bench": "vs_torch", "strider_over_torch": 1.3, "torch_tokens_per_s": 292.0,
                       "strider_tokens_per_s": 392.0, "loss_max_rel_diff": 7e-5, "rounds": 5, "steps": 11, "threads": 2,
                       "seq": 256, "micro_batch": 2, "accumulation": 2, "window": 2, "params": 135e6, "ratios": [1.0, 1.6],
                       "torch_peak_rss_bytes": 4e9, "strider_peak_rss_bytes": 4e9},
}
DEMO_TEXT = "eval loss before training: 7.67\n  device: 15.0 MiB of 24 MiB\nwindow K = 2\n  8 blocks: ...\n"


def whole_run(logs):
    import json
    import readme_extract
    logs.mkdir()
    rows = []
    for part, commands in readme_extract.PARTS.items():
        for c in commands:
            refused = c.endswith("ram-only") or c == readme_extract.PLAN_LORA_REFUSED
            if part == "plan":
                text = json.dumps(REFUSED if refused else PLAN)
            elif part == "predict":
                text = figure_blocks.marked(c, f"| {c} |\n| row |")
            else:
                text = DEMO_TEXT if c == "demo" else json.dumps(RUNS[c])
            (logs / f"{c}.log").write_text(f"{text}\n")
            rows.append(f"{c}\t{int(refused)}\t{int(refused)}\t1.0\tcommand {c}\n")
    (logs / "commands.tsv").write_text("".join(rows))
    (logs / "demo-metrics.jsonl").write_text("".join(
        json.dumps({"loss": 7.0 - i, "tokens_per_s": 4000 + i, "peak_device_bytes": 15 << 20, "eval_loss": 7.1 - i})
        + "\n" for i in range(3)))
    (logs / "machine.json").write_text(json.dumps({"date": "2026-12-06", "commit": "abc1234", "nproc": 2,
                                                   "cpu_model": "a CPU", "mem_gib": 24.0, "tmp_disk": "/tmp on x"}))


def test_readme_figures_renders_every_block_of_a_whole_run(tmp_path):
    whole_run(tmp_path / "logs")
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("".join(f"<!-- figures:begin {n} -->\nold\n<!-- figures:end -->\n"
                                                for n in figure_blocks.COMMANDS if n != "predict-pool"))
    (tmp_path / "docs" / "pool.md").write_text("<!-- figures:begin predict-pool -->\nold\n<!-- figures:end -->\n")
    script = REPO_ROOT / "bench" / "readme_figures.py"
    r = subprocess.run([sys.executable, script, tmp_path / "logs", "--check", "--update-readme", tmp_path / "README.md"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    pages = {n: b for p in figure_blocks.pages(tmp_path / "README.md") for n, b in figure_blocks.blocks(p.read_text()).items()}
    assert pages["gpu"] == pages["quality"] == "\nold\n"  # not this script's
    assert pages["predict-pool"] == "\n| predict-pool |\n| row |\n"
    assert "step 0.250 s, compute 50.0%" in pages["profile"]
    assert all(b != "\nold\n" for n, b in pages.items() if n not in ("gpu", "quality"))

    (tmp_path / "logs" / "bench_step.log").write_text("it printed no JSON line\n")  # yet exited 0
    r = subprocess.run([sys.executable, script, tmp_path / "logs", "--check"], capture_output=True, text=True)
    assert r.returncode == 1 and "MISSING step.offload_over_resident (block measured)" in r.stdout
