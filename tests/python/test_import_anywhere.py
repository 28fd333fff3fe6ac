"""After scripts/setup.sh, the checkout's environment imports its own strider package from any directory
(issue 67: only from the repository's root, through a path file that added the working directory's
python_shim/): .venv is this checkout's thin environment over the shared one, its path file naming this
checkout's python_shim/ by its absolute path."""
import os
import subprocess

from conftest import REPO_ROOT


def test_import_strider_and_run_its_data_tool_from_another_directory(tmp_path):
    python = REPO_ROOT / ".venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(python), "-c", "import strider, torch, transformers; print(strider.__file__)"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(REPO_ROOT / "python_shim" / "strider" / "__init__.py")
    r = subprocess.run([str(python), "-m", "strider.data", "--help"], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=120)
    assert r.returncode == 0 and "--chat-template" in r.stdout, r.stderr
    # Another checkout's python_shim/ in the working directory is not taken for this one's.
    (tmp_path / "python_shim" / "strider").mkdir(parents=True)
    (tmp_path / "python_shim" / "strider" / "__init__.py").write_text("raise ImportError('the wrong checkout')\n")
    r = subprocess.run([str(python), "-c", "import strider; print(strider.__file__)"], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().startswith(str(REPO_ROOT)), r.stderr
