"""Classes of hostile input to `strider finetune`, through the real binary (issue 63): each case of a class, not
one example of it. Every output option aliased to every input option is refused before the first step with the
input unchanged; every file-reading option given a FIFO, a directory, a dangling symlink or a name that is not
UTF-8 ends before the first step (refused, naming the option) or trains, and never hangs; every setting a
checkpoint records (each maths setting of engine/config/config_fields.json on the command line, each number and
flag of config.json), changed on resume, is refused by name with every saved file unchanged, or allowed by
--allow-changed NAME, or (config.json's fields the model reader does not take) trains the same bits."""
import concurrent.futures
import hashlib
import json
import os
import pathlib
import shutil
import subprocess

import pytest

from test_cli_faults import strider  # noqa: F401  (the fixture)
from test_cli_paths import tiny_model_and_tokens

OUTPUTS_FILE = ("--trace", "--metrics")
OUTPUTS_DIR = ("--out", "--checkpoint-dir", "--nvme")
INPUTS = ("--model", "--data", "--eval-data", "--config")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def finetune(strider, tmp_path, *args, timeout=60):
    # One evaluation batch, so that --eval-data is read (with none it is not: a warning says so).
    cmd = [str(strider), "finetune", "--device", "cpu", "--seq", "16", "--micro-batch", "1", "--accumulation", "1",
           "--steps", "1", "--eval-batches", "1", *args]
    return subprocess.run(cmd, capture_output=True, timeout=timeout, cwd=tmp_path)


def digest(path):
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture
def inputs(tmp_path):
    model, data = tiny_model_and_tokens(tmp_path)
    eval_data = tmp_path / "eval.tokens"
    eval_data.write_bytes(data.read_bytes())
    conf = tmp_path / "c.toml"
    conf.write_text("lr = 1e-4\n")
    return {"--model": model, "--data": data, "--eval-data": eval_data, "--config": conf}


def given(inputs, **over):
    args = []
    for option in INPUTS:
        args += [option, str(over.get(option, inputs[option]))]
    return args


@pytest.mark.parametrize("output", OUTPUTS_FILE + OUTPUTS_DIR)
def test_every_output_over_every_input_is_refused_and_nothing_is_lost(strider, tmp_path, inputs, output):
    before = {option: digest(path) for option, path in inputs.items()}
    for option, path in inputs.items():
        # The input itself, and (a folder) a file inside it.
        targets = [path] + ([path / "model.safetensors"] if path.is_dir() else [])
        for target in targets:
            others = [] if output == "--out" else ["--out", str(tmp_path / "out")]
            r = finetune(strider, tmp_path, *given(inputs), *others, output, str(target))
            err = r.stderr.decode(errors="replace")
            assert r.returncode != 0, (output, option, target)
            assert output in err, (output, option, target, err[-1000:])
            assert b"step    1" not in r.stdout, (output, option, target)
    assert {option: digest(path) for option, path in inputs.items()} == before
    assert not (tmp_path / "out" / "model.safetensors").exists()


def hostile_paths(tmp_path):
    fifo = tmp_path / "a-fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "a-folder"
    folder.mkdir()
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nothing-here")
    return {"FIFO": fifo, "directory": folder, "dangling symlink": dangling}


@pytest.mark.parametrize("option", INPUTS)
def test_every_file_option_given_a_fifo_a_folder_or_a_dangling_link_ends_before_the_first_step(strider, tmp_path,
                                                                                               inputs, option):
    for kind, path in hostile_paths(tmp_path).items():
        if option == "--model" and kind == "directory":
            continue  # a model is a folder: an empty one is the next test's
        r = finetune(strider, tmp_path, *given(inputs, **{option: path}), "--out", str(tmp_path / "out"))
        err = r.stderr.decode(errors="replace")
        assert r.returncode != 0, (option, kind)
        assert b"step    1" not in r.stdout, (option, kind)
        assert str(path.name) in err or option in err, (option, kind, err[-1000:])
    # A model folder whose config.json is a FIFO, a folder, or missing.
    if option == "--model":
        for kind in ("FIFO", "directory", "missing"):
            model = tmp_path / f"model-{kind}"
            model.mkdir()
            if kind == "FIFO":
                os.mkfifo(model / "config.json")
            elif kind == "directory":
                (model / "config.json").mkdir()
            r = finetune(strider, tmp_path, *given(inputs, **{"--model": model}), "--out", str(tmp_path / "out"))
            err = r.stderr.decode(errors="replace")
            assert r.returncode != 0 and b"step    1" not in r.stdout, kind
            assert "config.json" in err, (kind, err[-1000:])


def test_an_input_nothing_would_read_is_refused(strider, tmp_path, inputs):
    r = subprocess.run([str(strider), "finetune", "--device", "cpu", "--steps", "1", "--eval-batches", "0",
                        *given(inputs), "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "step    1" not in r.stdout
    assert "--eval-data" in r.stderr and "--eval-batches is 0, so nothing would read it" in r.stderr


@pytest.mark.parametrize("option", INPUTS)
def test_every_file_option_under_a_name_that_is_not_utf8_is_refused_before_the_first_step_or_trains(
        strider, tmp_path, inputs, option):
    source = inputs[option]
    odd = tmp_path.joinpath(os.fsdecode(b"r\xe9glages-") + source.name)
    os.rename(source, odd)
    r = finetune(strider, tmp_path, *given(inputs, **{option: odd}), "--out", str(tmp_path / "out"))
    err = r.stderr.decode(errors="replace")
    if r.returncode != 0:
        assert b"step    1" not in r.stdout, err[-1000:]
        assert option in err or "UTF-8" in err, err[-1000:]
    else:
        assert (tmp_path / "out" / "strider-out.json").exists()


# Another value of every maths setting in engine/config/config_fields.json, on the command line, for a saved run
# of bf16, weight decay 0.1 (so that whether norms decay matters) and a linear schedule over 2 steps (so that
# --steps, total_steps, matters). A setting added to the declaration fails the test until it is given here.
SAVED = {"--device": "cpu", "--seq": "16", "--micro-batch": "1", "--accumulation": "1", "--eval-batches": "0",
         "--checkpoint-every": "1", "--steps": "2", "--dtype": "bf16", "--weight-decay": "0.1",
         "--schedule": "linear", "--warmup": "0", "--clip": "1.0"}
CHANGED = {
    "seq": {"--seq": "8"}, "micro_batch": {"--micro-batch": "2"}, "accumulation": {"--accumulation": "2"},
    "dtype": {"--dtype": "fp32"}, "loss_scale_growth_interval": {"--loss-scale-growth-interval": "100"},
    "vocab_chunk": {"--vocab-chunk": "64"}, "mlp_pieces": {"--mlp-pieces": "2"},
    "grad_transfer": {"--grad-transfer": "fp32"}, "lr": {"--lr": "1e-3"}, "schedule": {"--schedule": "cosine"},
    "warmup_steps": {"--warmup": "1"}, "total_steps": {"--steps": "3"}, "weight_decay": {"--weight-decay": "0.2"},
    "decay_norms_and_biases": {"--decay-norms-and-biases": None}, "clip_norm": {"--clip": "0.5"},
    "beta1": {"--beta1": "0.8"}, "beta2": {"--beta2": "0.99"}, "eps": {"--eps": "1e-6"},
    "optimizer": {"--optimizer": "adam"}, "optimizer_state": {"--optimizer-state": "q8"},
    "packed_documents": {"--packed-documents": "true"},
    # A setting whose other value this run cannot take at all: refused by name, before any resume.
    "matmul_accumulate": {"--matmul-accumulate": "fp16"},  # CUDA and --dtype fp16 only
}
# Needs --lora: changed over a LoRA run below. A base held in another format has other values, so the adapters
# would go on over another base: refused as another model is, and --allow-changed does not take its name.
LORA_ONLY = {"base_format": {"--base-format": "int8"}}
NOT_ALLOWED = {"base_format"}
# The objective's settings need a preference token file: tests/python/test_preference_cli.py changes them on a
# command-line resume, and tests/python/test_objectives.py changes each alone from Python; each is refused by name.
PYTHON_ONLY = {"objective", "loss_type", "beta", "label_smoothing", "simpo_gamma", "epsilon", "epsilon_high",
               "max_completion_length"}


def maths_fields():
    declared = json.loads((ROOT / "engine" / "config" / "config_fields.json").read_text())["fields"]
    return {f["name"] for f in declared if f["scope"] == "maths"}


def train(strider, tmp_path, options):
    cmd = [str(strider), "finetune"]
    for flag, value in options.items():
        cmd += [flag] if value is None else [f"{flag}={value}"]
    return subprocess.run(cmd, capture_output=True, timeout=120, cwd=tmp_path)


def resume_each(strider, tmp_path, changes, **run):
    """Saves a run at step 1 of 2, then resumes a copy of its checkpoints once per setting with another value:
    refused naming the setting with every saved file unchanged, then allowed by --allow-changed NAME."""
    model, data = tiny_model_and_tokens(tmp_path)
    common = {**SAVED, "--model": str(model), "--data": str(data), "--out": str(tmp_path / "out"), **run}
    saved = tmp_path / "saved"
    r = train(strider, tmp_path, {**common, "--checkpoint-dir": str(saved)})
    assert r.returncode == 0, r.stderr[-2000:]
    shutil.rmtree(saved / "step-00000002")
    before = saved_files(saved)

    def check(name, change):
        ck = tmp_path / f"ck-{name}"
        shutil.copytree(saved, ck)
        resume = {**common, "--checkpoint-dir": str(ck), "--out": str(tmp_path / f"out-{name}"), "--resume": None,
                  **change}
        r = train(strider, tmp_path, resume)
        err = r.stderr.decode(errors="replace")
        assert r.returncode != 0 and b"step    2" not in r.stdout, (name, err[-1000:])
        assert saved_files(ck) == before, name
        if name == "matmul_accumulate":
            assert "--matmul-accumulate" in err, err[-1000:]
            return
        assert f"{name}: checkpoint " in err and "--allow-changed" in err, (name, err[-1000:])
        r = train(strider, tmp_path, {**resume, "--allow-changed": name})
        if name in NOT_ALLOWED:
            err = r.stderr.decode(errors="replace")
            assert r.returncode != 0 and f"'{name}' is not a setting a resume may change" in err, err[-1000:]
            r = train(strider, tmp_path, resume)
            assert "no option lets the model change on resume" in r.stderr.decode(errors="replace")
            assert saved_files(ck) == before, name
            return
        out = r.stdout.decode(errors="replace")
        assert r.returncode == 0, (name, r.stderr.decode(errors="replace")[-1000:])
        assert "resumed from" in out and "at step 1" in out, (name, out[-1000:])

    two_at_a_time(check, changes.items())


def saved_files(root):
    """digest() of a checkpoints' folder, relative to it, less the lock (it names the run holding the folder)."""
    return {k.replace(str(root), ""): v for k, v in digest(root).items() if not k.endswith(".strider.lock")}


def two_at_a_time(check, cases):
    """check(*case) for every case, two processes at once (each its own folders): a failure is raised here."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(check, *case) for case in cases]:
            f.result()


def test_every_recorded_maths_setting_changed_on_resume_is_refused_by_name_unless_allowed(strider, tmp_path):
    assert set(CHANGED) | set(LORA_ONLY) | PYTHON_ONLY == maths_fields()
    resume_each(strider, tmp_path, CHANGED)


def test_a_lora_runs_base_format_changed_on_resume_is_refused_by_name_unless_allowed(strider, tmp_path):
    resume_each(strider, tmp_path, LORA_ONLY, **{"--lora": "r=4,alpha=8,targets=all-linear"})


def hub_model(tmp_path, arch):
    """A tiny checkpoint whose config.json spells out every field (not only those off transformers' defaults),
    so that each can be changed; a Qwen3-MoE with a dense layer and the router's loss on."""
    import torch
    import transformers
    common = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                          num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                          output_router_logits=True, router_aux_loss_coef=0.01)
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                         output_router_logits=True, router_aux_loss_coef=0.01)
    else:
        cfg = transformers.LlamaConfig(**common)
    torch.manual_seed(0)
    model = tmp_path / "model"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(model)
    (model / "config.json").write_text(cfg.to_json_string(use_diff=False))
    return model


def other_values(config):
    """(field, changed config) for each number and flag of config.json, and of its nested objects (RoPE's)."""
    for key, value in config.items():
        paths = [(key, k, v) for k, v in value.items()] if isinstance(value, dict) else [(key, None, value)]
        for outer, inner, v in paths:
            if isinstance(v, bool):
                new = not v
            elif isinstance(v, int):
                new = v * 2 if v else 1
            elif isinstance(v, float):
                new = v * 0.5 if v else 0.5
            else:
                continue  # names and lists: the architecture is compared by name, the lists as the layers they mark
            changed = json.loads(json.dumps(config))
            if inner is None:
                changed[outer] = new
            else:
                changed[outer][inner] = new
            yield (outer if inner is None else f"{outer}.{inner}"), changed


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mixtral"])
def test_every_config_json_field_changed_on_resume_is_refused_or_changes_nothing(strider, tmp_path, arch):
    """The model is the checkpoint's: a config.json field changed before a resume is refused before the next
    step, with every saved file unchanged, or (a field the model reader does not take: ids, the initializer's
    range, output flags) the resumed run trains the same bits as with the config unchanged. Fields the maths
    reads (the router's loss and top-k, RoPE, the norms' epsilon) are among the refused, so the test is not
    passed by a reader that takes nothing."""
    from safetensors.torch import load_file
    model = hub_model(tmp_path, arch)
    _, data = tiny_model_and_tokens(tmp_path / "tokens")
    common = {**SAVED, "--schedule": "constant", "--data": str(data)}
    saved = tmp_path / "saved"
    r = train(strider, tmp_path, {**common, "--model": str(model), "--checkpoint-dir": str(saved),
                                  "--out": str(tmp_path / "out")})
    assert r.returncode == 0, r.stderr[-2000:]
    shutil.rmtree(saved / "step-00000002")

    def resume(name, config):
        folder = tmp_path / f"model-{name}"
        shutil.copytree(model, folder)
        (folder / "config.json").write_text(json.dumps(config))
        ck = tmp_path / f"ck-{name}"
        shutil.copytree(saved, ck)
        out = tmp_path / f"out-{name}"
        r = train(strider, tmp_path, {**common, "--model": str(folder), "--checkpoint-dir": str(ck), "--resume": None,
                                      "--out": str(out)})
        return r, ck, out

    config = json.loads((model / "config.json").read_text())
    r, _, out = resume("same", config)
    assert r.returncode == 0, r.stderr[-2000:]
    reference = load_file(out / "model.safetensors")
    before = saved_files(saved)
    refused = set()

    def check(name, changed):
        r, ck, out = resume(name, changed)
        err = r.stderr.decode(errors="replace")
        if r.returncode != 0:
            refused.add(name)
            assert b"step    2" not in r.stdout, (name, err[-1000:])
            assert saved_files(ck) == before, name
            assert "strider" in err and ("config.json" in err or "another model" in err
                                         or name.split(".")[-1] in err), (name, err[-1000:])
        else:
            trained = load_file(out / "model.safetensors")
            assert all(trained[k].equal(reference[k]) for k in reference), (name, "accepted, and trained otherwise")

    two_at_a_time(check, other_values(config))
    read = {"rms_norm_eps", "rope_parameters.rope_theta", "num_attention_heads", "hidden_size"}
    if arch != "llama":
        read |= {"router_aux_loss_coef", "output_router_logits", "num_experts_per_tok"}
    if arch == "qwen3_moe":
        read |= {"norm_topk_prob", "decoder_sparse_step", "moe_intermediate_size"}
    if arch == "mixtral":
        read |= {"router_jitter_noise"}  # 0 -> 0.5: noise strider does not add
    assert read <= refused, read - refused


def test_an_open_file_limit_too_low_is_refused_by_name_before_anything_is_written(strider, tmp_path):
    """`ulimit -n 6` with NVMe printed ATen's 27-frame C++ backtrace ('Unable to open /dev/urandom'), and at 12 a
    run trained with every checkpoint failing. A hard limit below the floor is refused before the first step,
    naming it; a low soft limit under a higher hard one is raised, and the run trains."""
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    run = ["--device", "cpu", "--seq", "16", "--steps", "1", "--eval-batches", "0", "--nvme", str(tmp_path / "nv"),
           "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "out")]
    (tmp_path / "nv").mkdir()
    for limit in (6, 12, 63):
        r = subprocess.run([str(strider), "finetune", *run], capture_output=True, text=True, timeout=60,
                           cwd=tmp_path, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
        assert r.returncode != 0 and "step    1" not in r.stdout, (limit, r.stderr[-1000:])
        assert f"the open-file limit is {limit} (ulimit -n" in r.stderr and "frame #" not in r.stderr, r.stderr
        assert not (tmp_path / "out").exists() and not any((tmp_path / "nv").iterdir())
    if hard != resource.RLIM_INFINITY and hard < 64:
        pytest.fail(f"this machine's hard open-file limit is {hard}: the raised soft limit cannot be tested")
    r = subprocess.run([str(strider), "finetune", *run], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (6, hard)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "out" / "model.safetensors").exists() and (tmp_path / "ck" / "step-00000001").exists()
