"""bench/figure_blocks.py, the one finder of the pages' figure blocks, and bench/readme_figures.py writing the
predict scripts' blocks from their logs. Plain Python: no build needed."""
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
