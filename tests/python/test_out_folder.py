"""The folder `strider finetune --out` leaves, through the real binary: written whole beside --out and switched in
with one rename, so it holds exactly what the run wrote (never an earlier run's adapter beside a new model, or new
weights beside an old config); a --out holding files strider did not write is refused before the first step unless
--overwrite-out; the run's own checkpoints under --out survive the switch, even one interrupted (issue 63: data
lost 6, trains silently wrong 1)."""
import json
import shutil
import time

from test_cli_faults import ok, run, strider  # noqa: F401  (strider: the fixture)
from test_cli_paths import tiny_model_and_tokens


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def manifest(out):
    return json.loads((out / "strider-out.json").read_text())["files"]


def test_a_foreign_out_is_refused_before_the_first_step_unless_overwrite_out(strider, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("someone's notes")
    (out / "model.safetensors").write_text("an earlier save, not strider's")
    r = run(strider, tmp_path, "--steps", "1", "--out", str(out))
    assert r.returncode != 0
    assert "holds files strider did not write there (model.safetensors, notes.txt)" in r.stderr, r.stderr[-1000:]
    assert "--overwrite-out" in r.stderr and "step    1" not in r.stdout
    assert (out / "notes.txt").read_text() == "someone's notes" and names(out) == ["model.safetensors", "notes.txt"]
    assert names(tmp_path).count(".out.strider-new") == 0

    r = run(strider, tmp_path, "--steps", "1", "--out", str(out), "--overwrite-out")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "replaces --out" in r.stderr and "model.safetensors, notes.txt" in r.stderr
    assert "replaced the earlier --out: model.safetensors, notes.txt" in r.stdout
    assert names(out) == ["config.json", "model.safetensors", "strider-out.json"]
    assert manifest(out) == ["config.json", "model.safetensors"]
    assert ".out.strider-new" not in names(tmp_path)


def test_an_earlier_strider_output_is_replaced_whole_and_the_runs_checkpoints_stay(strider, tmp_path):
    out = tmp_path / "out"
    ok(strider, tmp_path, "--steps", "1", "--out", str(out))
    first = (out / "model.safetensors").read_bytes()
    # What a run stopped by a signal without --checkpoint-dir leaves under --out.
    (out / "strider-checkpoints").mkdir()
    (out / "strider-checkpoints" / "keep.txt").write_text("a checkpoint")
    r = run(strider, tmp_path, "--steps", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "holds an earlier strider output; the final save replaces it as a whole" in r.stderr
    assert "replaced the earlier --out: config.json, model.safetensors, strider-out.json" in r.stdout
    assert names(out) == ["config.json", "model.safetensors", "strider-checkpoints", "strider-out.json"]
    assert (out / "strider-checkpoints" / "keep.txt").read_text() == "a checkpoint"
    assert (out / "model.safetensors").read_bytes() != first
    assert ".out.strider-new" not in names(tmp_path)


def test_checkpoints_an_interrupted_switch_left_beside_out_are_moved_back(strider, tmp_path):
    out = tmp_path / "out"
    ok(strider, tmp_path, "--steps", "1", "--out", str(out))
    # A kill between the exchange and moving the checkpoints back: the earlier folder, with them, beside --out.
    left = tmp_path / ".out.strider-new"
    (left / "strider-checkpoints").mkdir(parents=True)
    (left / "strider-checkpoints" / "keep.txt").write_text("a checkpoint")
    (left / "model.safetensors").write_text("the earlier folder's weights")
    r = run(strider, tmp_path, "--steps", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"moved {left / 'strider-checkpoints'} back to {out / 'strider-checkpoints'}" in r.stderr
    assert (out / "strider-checkpoints" / "keep.txt").read_text() == "a checkpoint"
    assert ".out.strider-new" not in names(tmp_path)


def test_a_save_that_completed_but_was_not_switched_in_is_switched_in_at_the_next_start(strider, tmp_path):
    out = tmp_path / "out"
    ok(strider, tmp_path, "--steps", "1", "--out", str(out))
    # A kill after the save's manifest and before its exchange: the complete new folder beside --out.
    done = tmp_path / ".out.strider-new"
    shutil.copytree(out, done)
    (done / "marker.txt").write_text("the newer save")
    time.sleep(0.05)
    (done / "strider-out.json").write_text(json.dumps({"written_by": "strider finetune",
                                                       "files": ["config.json", "marker.txt", "model.safetensors"]}))
    r = run(strider, tmp_path, "--steps", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"note: switched in {done} as --out {out}" in r.stderr
    # This run's save then replaced the folder switched in, as an earlier strider output.
    assert "replaced the earlier --out: config.json, marker.txt, model.safetensors, strider-out.json" in r.stdout
    assert names(out) == ["config.json", "model.safetensors", "strider-out.json"]
    assert ".out.strider-new" not in names(tmp_path)


def test_full_training_and_lora_into_one_out_leave_no_stale_files(strider, tmp_path):
    """Full training into a LoRA run's --out leaves no adapter that from_pretrained would apply, and LoRA into
    a full run's --out leaves no model.safetensors beside the adapter."""
    model, data = tiny_model_and_tokens(tmp_path)
    out = tmp_path / "out"
    common = ("--model", str(model), "--data", str(data), "--steps", "1", "--out", str(out))
    ok(strider, tmp_path, *common, "--lora", "r=4,alpha=8,targets=all-linear")
    assert "adapter_model.safetensors" in names(out) and "model.safetensors" not in names(out)
    ok(strider, tmp_path, *common)
    assert "adapter_model.safetensors" not in names(out) and "adapter_config.json" not in names(out)
    assert "model.safetensors" in names(out)
    ok(strider, tmp_path, *common, "--lora", "r=4,alpha=8,targets=all-linear", "--merge")
    assert "model.safetensors" not in names(out) and "adapter_config.json" in names(out)
    assert "merged/model.safetensors" in manifest(out) and "adapter_model.safetensors" in manifest(out)
    assert set(names(out)) == {p.split("/")[0] for p in manifest(out)} | {"strider-out.json"}
