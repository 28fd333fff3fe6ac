"""Two strider.Engines on one NVMe directory would tear each other's extents ("checksum mismatch ... restore
from a checkpoint" at the first engine's next step). The Python engine locks its nvme_dir as the command
line locks --nvme: a second engine, in this process or another, is refused naming the holder, and the first
trains on, its state intact."""
import subprocess
import sys
import textwrap

import pytest

import strider
from test_package import config, hf_batches, make_model


def test_a_second_engine_on_the_same_nvme_dir_is_refused_and_the_first_trains_on(tmp_path):
    nvme = tmp_path / "nvme"
    cfg = config(nvme_dir=str(nvme), nvme_blocks=[1, 2])
    batches = hf_batches(500, 3)
    first_model = make_model()
    first = strider.Engine(first_model, cfg)
    first.step(*batches[0])
    with pytest.raises(ValueError, match=r"nvme_dir .* is in use by another engine of this process"):
        strider.Engine(make_model(seed=1), cfg)
    # Another process: refused naming this one's pid.
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = {sys.path!r}
        import strider
        from test_package import config, make_model
        try:
            strider.Engine(make_model(seed=2), config(nvme_dir={str(nvme)!r}, nvme_blocks=[1, 2]))
        except ValueError as e:
            print(e)
            sys.exit(3)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr[-2000:]
    assert "is in use by another strider run" in r.stdout, r.stdout
    # The first engine's state is whole: its steps go on, the same as an engine that was alone.
    losses = [first.step(*b).loss for b in batches[1:]]
    first.finish()
    alone = strider.Engine(make_model(), config(nvme_dir=str(tmp_path / "alone"), nvme_blocks=[1, 2]))
    expected = [alone.step(*b).loss for b in batches][1:]
    alone.finish()
    assert losses == expected
