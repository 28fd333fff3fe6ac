"""Rewrites one `<!-- figures:begin NAME -->` ... `<!-- figures:end -->` block of a README, for the bench
scripts that write their own block (bench/predict_dp.py, bench/predict_pool.py, bench/predict_past_ram.py)."""
import re
from pathlib import Path


def replace_block(readme: Path, name: str, block: str) -> None:
    marker = re.compile(rf"<!-- figures:begin {re.escape(name)} -->.*?<!-- figures:end -->", re.S)
    text = readme.read_text()
    if not marker.search(text):
        raise SystemExit(f"{readme} has no <!-- figures:begin {name} --> ... <!-- figures:end --> block")
    readme.write_text(marker.sub(lambda m: f"<!-- figures:begin {name} -->\n{block}\n<!-- figures:end -->", text))
    print(f"updated {readme}")
