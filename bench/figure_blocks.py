"""The figure blocks of strider's pages, and the one finder every tool that writes one uses.

A block is `<!-- figures:begin NAME -->BODY<!-- figures:end -->` in README.md or a docs/*.md page; each
NAME is there once. COMMANDS says, for each block, the command that writes it: bench/readme_figures.sh
reruns all of them but the last two (quality: half an hour; gpu: a GPU machine, quoted by hand).

    from figure_blocks import replace_block      # bench/ is the script's folder: on sys.path
    replace_block("predict-dp", body)            # in whichever page holds it
"""
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!-- figures:begin ([\w-]+) -->(.*?)<!-- figures:end -->", re.S)

_ALL = "bench/readme_figures.sh --update-readme"
COMMANDS = {
    **{name: _ALL for name in ("machine", "demo-model", "demo-plan", "profile", "measured", "predict-8b",
                               "predict-precision", "predict-nvme", "predict-lora", "formats", "ram-8b")},
    "predict-dp": ".venv/bin/python bench/predict_dp.py --update-readme",
    "predict-pool": ".venv/bin/python bench/predict_pool.py --update-readme",
    "predict-past-ram": ".venv/bin/python bench/predict_past_ram.py --update-readme",
    "quality": ".venv/bin/python bench/quality_formats.py --out DIR --update-readme",
    "gpu": "gpu_check/gpu_check.sh OUT_DIR on a GPU machine, its gpu_check.json quoted by hand",
}


def pages(readme=None):
    """README.md (or the README given) and the docs/*.md pages beside it."""
    readme = Path(readme) if readme else REPO / "README.md"
    return [readme] + sorted((readme.parent / "docs").glob("*.md"))


def blocks(text):
    """name -> body of every block in a page's (or a log's) text."""
    return {m.group(1): m.group(2) for m in MARKER.finditer(text)}


def find_block(name, readme=None):
    """(page, body) of block NAME; exits naming the pages searched when none or two hold it."""
    found = []
    for page in pages(readme):
        body = blocks(page.read_text()).get(name)
        if body is not None:
            found.append((page, body))
    if len(found) != 1:
        where = ", ".join(str(p) for p, _ in found) or "none of " + ", ".join(str(p) for p in pages(readme))
        raise SystemExit(f"figure block '{name}' (<!-- figures:begin {name} --> ... <!-- figures:end -->) "
                         f"must be in exactly one page: found in {where}")
    return found[0]


def replace_block(name, body, readme=None):
    """Rewrites block NAME with body where it is (an inline block stays inside its sentence); True if it
    changed."""
    page, old = find_block(name, readme)
    inner = body if "\n" not in old else f"\n{body}\n"
    text = page.read_text()
    new = MARKER.sub(lambda m: f"<!-- figures:begin {name} -->{inner}<!-- figures:end -->" if m.group(1) == name
                     else m.group(0), text)
    if new != text:
        page.write_text(new)
    print(f"figure block {name}: {page} {'updated' if new != text else 'already holds it'}", file=sys.stderr)
    return new != text


def marked(name, body):
    """The block as a script prints it, so that bench/readme_figures.py finds it in that script's log."""
    return f"<!-- figures:begin {name} -->\n{body}\n<!-- figures:end -->"
