"""The `strider` Python package: a transformers model trained through strider.Engine.

What a user relies on: three fp32 steps on HF-convention batches (unshifted
labels, -100, a right-padding attention mask) track transformers +
torch.optim.AdamW to 1e-5; the model's own parameters, which the engine trains
in place, hold the trained weights once the updates finished, so that
save_pretrained / from_pretrained round-trips them; and every
refusal (an unsupported architecture, a parameter not on the CPU, a budget too
small, a bad config, left padding) is a clear ValueError that leaves the
model's weights exactly as they were.
"""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import transformers  # requirements.txt: a missing one fails here, not skips
import strider  # noqa: E402  (tests/python/conftest.py puts python_shim/ on sys.path)
from conftest import require_op_library  # noqa: E402
from strider.torch_reference import adamw_steps  # noqa: E402

require_op_library()

SEQ, MICRO_BATCH, ACCUMULATION = 17, 2, 2
BATCH = MICRO_BATCH * ACCUMULATION
LR, BETAS, EPS, WEIGHT_DECAY, CLIP, WARMUP, TOTAL = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0, 1, 4
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=500, max_position_embeddings=64, rms_norm_eps=1e-5)


def make_model(kind="llama", seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**SMALL)
    elif kind == "qwen3_tied":
        cfg = transformers.Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=True)
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100, n_positions=32)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():  # norms start at ones: perturb them so that their updates show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def config(**over):
    base = dict(seq=SEQ, micro_batch=MICRO_BATCH, accumulation=ACCUMULATION, dtype="fp32", vocab_chunk=200,
                window=2, token_tile=0, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, schedule="linear",
                warmup_steps=WARMUP, total_steps=TOTAL, clip_norm=CLIP, device="cpu")
    base.update(over)
    return strider.EngineConfig(**base)


def hf_batches(vocab, steps, seed=1):
    """(input_ids, labels, attention_mask) as a transformers data collator gives them: labels unshifted,
    a prompt that does not count, and right padding in a different row each step."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100
        mask = torch.ones_like(ids)
        mask[s % BATCH, 10 + s:] = 0
        out.append((ids, labels, mask))
    return out


def reference_steps(model, data):
    """transformers + torch.optim.AdamW on the same batches: per-step (loss, grad norm)."""
    def micro_loss(model, batch, rows):
        ids, labels, mask = batch
        labels = labels.masked_fill(mask == 0, -100)
        valid = int((labels[:, 1:] != -100).sum())
        return model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows],
                     num_items_in_batch=valid).loss

    return adamw_steps(model, data, micro_loss, micro_batch=MICRO_BATCH, accumulation=ACCUMULATION, lr=LR,
                       betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, clip=CLIP, warmup=WARMUP, total=TOTAL)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(model, before):
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} changed"


def test_three_fp32_steps_match_adamw_and_save_pretrained_round_trips(tmp_path):
    model = make_model()
    reference = copy.deepcopy(model)
    initial = snapshot(model)
    data = hf_batches(model.config.vocab_size, 3)

    engine = strider.Engine(model, config())
    results = [engine.step(*batch) for batch in data]
    ref = reference_steps(reference, data)

    for s, (r, (ref_loss, ref_norm)) in enumerate(zip(results, ref)):
        assert isinstance(r, strider.StepResult) and r.step == s + 1
        assert abs(r.loss - ref_loss) <= 1e-5 * abs(ref_loss), f"step {s + 1}: loss {r.loss} vs {ref_loss}"
        assert abs(r.grad_norm - ref_norm) <= 1e-5 * ref_norm, f"step {s + 1}: grad norm {r.grad_norm} vs {ref_norm}"
        ids, labels, mask = data[s]
        assert r.valid_tokens == int((labels.masked_fill(mask == 0, -100)[:, 1:] != -100).sum())
        assert r.tokens == BATCH * SEQ and r.tokens_per_s > 0 and {"compute", "h2d"} <= set(r.lanes)
        # Every parameter's fp32 gradient comes out once, every parameter goes in at least once (its forward
        # or the head's one visit), and ATen needed working memory inside the block visits.
        params = sum(p.numel() for p in model.parameters())
        assert r.d2h_bytes >= 4 * params and r.h2d_bytes >= params and r.work_peak_bytes > 0
    assert len({(r.h2d_bytes, r.d2h_bytes) for r in results}) == 1  # per step, not accumulated

    engine.finish()  # the model's parameters are the engine's: no copy back
    for name, p in model.named_parameters():
        want = dict(reference.named_parameters())[name].detach()
        assert not torch.equal(p, initial[name]), f"{name} did not move"
        assert rel_err(p.detach(), want) <= 1e-5, f"{name} after 3 steps"

    model.save_pretrained(tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, engine.param(name)), f"{name} as saved"

    trace = engine.trace(tmp_path / "trace.json")
    assert any(e["name"].startswith("adamw") for e in json.loads(open(trace).read())["traceEvents"])


def test_sync_keeps_dtype_and_ties():
    """A bf16 model with tied embeddings trained in bf16: the parameters are the masters cast to bf16,
    the tie holds (sync_to_model, from before aliasing, still works: it waits for the updates)."""
    model = make_model("qwen3_tied", dtype=torch.bfloat16)
    before = snapshot(model)
    engine = strider.Engine(model, config(dtype="bf16", lr=1e-2, schedule="constant", warmup_steps=0, total_steps=0))
    assert "lm_head.weight" not in engine.param_names()
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    assert engine.step(ids).valid_tokens == BATCH * (SEQ - 1)  # labels default to input_ids
    engine.sync_to_model()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), engine.param(name).to(torch.bfloat16)), name
        assert not torch.equal(p.detach(), before[name]), f"{name} did not move"


def test_evaluate_pads_short_batches_and_masks_right_padding():
    model = make_model()
    engine = strider.Engine(model, config())
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (3, 11), generator=g)  # fewer rows, shorter than seq
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids.masked_fill(mask == 0, -100)).loss.item()
    assert engine.evaluate(ids, attention_mask=mask) == pytest.approx(want, rel=1e-5)
    assert engine.evaluate(ids[0]) == pytest.approx(model(input_ids=ids[:1], labels=ids[:1]).loss.item(), rel=1e-5)

    left = torch.ones_like(ids)
    left[2, :3] = 0
    with pytest.raises(ValueError, match="padding_side = 'right'"):
        engine.step(ids, attention_mask=left)
    with pytest.raises(ValueError, match=r"up to \[batch, seq\] = \[4, 17\]"):
        engine.step(torch.zeros(5, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"up to \[batch, seq\] = \[4, 17\]"):
        engine.step(torch.zeros(4, 18, dtype=torch.long))
    with pytest.raises(ValueError, match="labels has shape"):
        engine.step(ids, ids[:, :5])
    # Refused calls started nothing: the next step is the first.
    assert engine.step(ids).step == 1


def refused(model, cfg, match):
    before = snapshot(model)
    with pytest.raises(ValueError, match=match):
        strider.Engine(model, cfg)
    assert_same_weights(model, before)


def test_refusals_leave_the_model_untouched():
    refused(make_model("gpt2"), config(), r"GPT2LMHeadModel .*not supported.*LlamaForCausalLM")
    model = make_model()
    refused(model, config(device_budget="64KiB"), "exceed the device budget of 65536 bytes")
    refused(model, config(seq=65), "max_position_embeddings")
    refused(model, config(window=2, device="cuda:0" if not torch.cuda.is_available() else "cuda:99"), "cuda")
    model.config.architectures = ["GPT2LMHeadModel"]
    refused(model, config(), r"architectures lists \['GPT2LMHeadModel'\]")


def test_parameters_off_the_cpu_are_refused():
    # No GPU here: a parameter on the meta device stands in for one on a GPU (the check is the same:
    # every parameter's device must be the CPU). On a machine with CUDA the real case runs too.
    model = make_model()
    before = snapshot(model)
    model.model.norm.weight = torch.nn.Parameter(torch.empty(64, device="meta"))
    with pytest.raises(ValueError, match="model.norm.weight is on the meta device"):
        strider.Engine(model, config())
    if torch.cuda.is_available():
        model = make_model()
        model.lm_head.cuda()
        with pytest.raises(ValueError, match=r"lm_head.weight is on cuda:0; keep the model on the CPU"):
            strider.Engine(model, config())
        assert torch.equal(model.lm_head.weight.cpu(), before["lm_head.weight"])


def test_a_batch_without_targets_changes_nothing():
    # Sparse chat data: a batch whose labels are all -100 is skipped, not an error; no weight, moment or
    # step count changes, and the run goes on.
    model = make_model()
    engine = strider.Engine(model, config())
    ids, labels, mask = hf_batches(SMALL["vocab_size"], 1)[0]
    before = snapshot(model)
    r = engine.step(ids, torch.full_like(labels, -100), mask)
    assert r.skipped and r.no_targets and "no target token" in r.skip_reason
    assert r.step == 1 and engine.steps_done == 0
    assert_same_weights(model, before)
    r = engine.step(ids, labels, mask)
    assert not r.skipped and r.step == 1 and engine.steps_done == 1
    engine.finish()


def test_frozen_parameters_are_refused_naming_them():
    # strider trains every parameter: a frozen one would be updated without a word.
    model = make_model()
    model.model.embed_tokens.weight.requires_grad_(False)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    refused(model, config(), r"2 parameters have requires_grad=False \(model.embed_tokens.weight, "
                             r"model.layers.0.self_attn.q_proj.weight\)")


def test_engine_config_names_fields_and_maps_to_the_engine():
    for bad, field in [(dict(window=1), "window"), (dict(dtype="fp8"), "dtype"), (dict(seq=0), "seq"),
                       (dict(betas=(0.9, 1.0)), "betas"), (dict(schedule="step"), "schedule"),
                       (dict(schedule="cosine", warmup_steps=5, total_steps=5), "total_steps"),
                       (dict(device="gpu"), "device"), (dict(device_budget="12 parsecs"), "device_budget"),
                       (dict(lr=float("nan")), "lr"), (dict(micro_batch=2.0), "micro_batch"),
                       (dict(nvme_blocks=[1]), "nvme_blocks")]:
        with pytest.raises(ValueError, match=rf"EngineConfig\.{field}"):
            config(**bad)
    c = config()
    c.accumulation = 0  # edited after construction: validate() catches it, so does Engine()
    with pytest.raises(ValueError, match=r"EngineConfig\.accumulation = 0"):
        c.validate()
    assert strider.parse_bytes("20GiB") == 20 << 30 and strider.parse_bytes("2e9") == 2_000_000_000
    with pytest.raises(ValueError, match="past the largest strider accepts"):
        strider.parse_bytes("1e30GiB")
    d = config(betas=[0.8, 0.9]).engine_dict()
    assert (d["beta1"], d["beta2"], d["clip_norm"], d["warmup_steps"]) == (0.8, 0.9, CLIP, WARMUP)
    assert config().batch == BATCH


def test_missing_library_is_an_import_error_naming_the_paths(tmp_path):
    """A copy of the package with no library next to it and no build directory."""
    import shutil
    shutil.copytree(os.path.dirname(strider.__file__), tmp_path / "pkg" / "strider",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # What the wheel installs next to the package besides the library.
    from strider.config import declaration_path
    shutil.copy(declaration_path(), tmp_path / "pkg" / "strider")
    env = dict(os.environ, STRIDER_BUILD_DIR=str(tmp_path / "nobuild"), PYTHONPATH=str(tmp_path / "pkg"))
    code = "import strider\ntry:\n    strider.load_library()\nexcept ImportError as e:\n    print(e)\n"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "libstrider_ops.so not found" in out.stdout
    assert str(tmp_path / "pkg" / "strider" / "libstrider_ops.so") in out.stdout
    assert str(tmp_path / "nobuild" / "python_shim" / "libstrider_ops.so") in out.stdout


@pytest.mark.parametrize("package,deb", [("fmt", "libfmt-dev"), ("TBB", "libtbb-dev"), ("CLI11", "libcli11-dev"),
                                         ("tomlplusplus", "libtomlplusplus-dev")])
def test_a_missing_library_stops_the_configure_naming_its_debian_package(tmp_path, package, deb):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(["cmake", "-S", repo, "-B", str(tmp_path / "build"), "-DSTRIDER_WITH_CUDA=OFF",
                        "-DSTRIDER_WITH_TORCH=OFF", f"-DCMAKE_DISABLE_FIND_PACKAGE_{package}=ON"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    message = " ".join(r.stderr.split())  # CMake wraps its messages
    assert f"{package} not found" in message and f"'apt install {deb}'" in message, r.stderr
