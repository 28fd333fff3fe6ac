"""fp16 with dynamic loss scaling against torch's own: autocast(float16) + GradScaler + AdamW.

The two do not round alike: strider computes every activation in fp16 (its compute copy is the
fp16 rounding of the fp32 master, the way autocast casts a weight for a matmul), while autocast keeps
norms, softmax, the residual stream and the loss in fp32. So the bounds are fp16's, not fp32's: the same
loss scale every step, each step's loss within 1e-3 relative of torch's, the gradient norm within 1e-2,
and every parameter after 5 steps within 2e-2 of torch's (relative to its largest element; the
embedding, whose rows one or two tokens move and AdamW normalizes, comes nearest: 1.5e-2). Measured on
this model: strider's fp16 parameters lie 1-5x further from the fp32 run than autocast's (autocast rounds
fewer tensors to fp16) and 3-20x nearer than strider's bf16 ones; the test holds the last in sum.
ATen's fp16 GEMM on the CPU is slow: the small model of test_engine_vs_torch.
"""
import json

import pytest
import torch

import transformers  # requirements.txt: a missing one fails here, not skips

from strider.torch_reference import adamw_param_groups  # noqa: E402

from conftest import require_op_library, step_report  # noqa: E402

require_op_library()

from test_engine_vs_torch import (ACCUMULATION, BETAS, CLIP, EPS, LR, MICRO_BATCH, STEPS, TOTAL, WARMUP,  # noqa: E402
                                  WEIGHT_DECAY, batches, load_into, make_model, new_engine, rel_err, shifted)


def torch_run(model, data, fp16, init_scale=65536.0):
    """transformers + AdamW, with autocast(float16) and GradScaler when fp16: per step (loss, norm, scale)."""
    opt = torch.optim.AdamW(adamw_param_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY, foreach=False)
    sched = transformers.get_linear_schedule_with_warmup(opt, WARMUP, TOTAL)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=fp16)
    out = []
    for ids, labels in data:
        opt.zero_grad()
        valid = int((shifted(labels) != -100).sum())
        loss = 0.0
        for m in range(ACCUMULATION):
            rows = slice(m * MICRO_BATCH, (m + 1) * MICRO_BATCH)
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                part = model(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=valid).loss
            scaler.scale(part).backward()
            loss += part.item()
        scale = scaler.get_scale() if fp16 else 0.0
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        if not fp16 or scaler.get_scale() >= scale:  # a step GradScaler skipped moves no schedule, as in strider
            sched.step()
        out.append((loss, norm.item(), scale))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3_tied"])
def test_fp16_tracks_autocast_gradscaler_and_adamw(arch):
    model = make_model(arch)
    data = batches(model.config.vocab_size)
    engine = new_engine(model, dtype="fp16", chaos=True)
    load_into(engine, model)
    reports = [step_report(engine.step(ids, shifted(labels))) for ids, labels in data]
    engine.finish()

    fp16_model, fp32_model = make_model(arch), make_model(arch)
    ref16 = torch_run(fp16_model, data, fp16=True)
    torch_run(fp32_model, data, fp16=False)
    for s, (r, (loss, norm, scale)) in enumerate(zip(reports, ref16)):
        assert r["loss_scale"] == scale, f"step {s + 1}: scale {r['loss_scale']} vs GradScaler's {scale}"
        assert not r["skipped"], f"step {s + 1} skipped: {r['skip_reason']}"
        assert abs(r["loss"] - loss) <= 1e-3 * abs(loss), f"step {s + 1} loss {r['loss']} vs {loss}"
        assert abs(r["grad_norm"] - norm) <= 1e-2 * norm, f"step {s + 1} grad norm {r['grad_norm']} vs {norm}"

    bf16 = new_engine(model, dtype="bf16")
    load_into(bf16, model)
    for ids, labels in data:
        bf16.step(ids, shifted(labels))
    bf16.finish()
    fp16_params = dict(fp16_model.named_parameters())
    fp16_from_fp32 = bf16_from_fp32 = 0.0
    for name, p32 in fp32_model.named_parameters():
        ours, theirs, exact = engine.param(name), fp16_params[name].detach(), p32.detach()
        gap = rel_err(ours, theirs)
        assert gap <= 2e-2, f"{name} after {STEPS} steps: {gap:.3g} from torch's fp16 run"
        fp16_from_fp32 += rel_err(ours, exact)
        bf16_from_fp32 += rel_err(bf16.param(name), exact)
    assert fp16_from_fp32 < 0.5 * bf16_from_fp32, \
        f"fp16's parameters {fp16_from_fp32:.3g} from fp32's in sum, bf16's {bf16_from_fp32:.3g}"


def test_fp16_overflow_skips_the_step_and_halves_the_scale_as_gradscaler_does():
    """An initial scale so large that the scaled gradients overflow fp16: both skip the first steps, halving
    the scale each time, until it fits; then they train alike."""
    model = make_model("llama")
    data = batches(model.config.vocab_size)
    huge = 2.0 ** 22  # on this model and data: 3 overflows (2^22, 2^21, 2^20), then 2 steps at 2^19
    engine = new_engine(model, dtype="fp16", loss_scale=huge)
    load_into(engine, model)
    reports = [step_report(engine.step(ids, shifted(labels))) for ids, labels in data]
    engine.finish()
    ref = torch_run(make_model("llama"), data, fp16=True, init_scale=huge)
    skipped = [r["skipped"] for r in reports]
    assert any(skipped), "no step overflowed: the test's scale did not reach fp16's range"
    assert not all(skipped), "every step overflowed: nothing after the skips was compared"
    for s, (r, (loss, _, scale)) in enumerate(zip(reports, ref)):
        assert r["loss_scale"] == scale, f"step {s + 1}: scale {r['loss_scale']} vs GradScaler's {scale}"
        assert abs(r["loss"] - loss) <= 1e-3 * abs(loss), f"step {s + 1} loss {r['loss']} vs {loss}"
        if r["skipped"]:
            assert r["overflow"], f"step {s + 1}: {r['skip_reason']}"


def test_fp16_accumulation_is_refused_where_it_cannot_run(strider_binary, tmp_path):
    """--matmul-accumulate fp16 needs --dtype fp16 (EngineConfig and the command line), and a CUDA device: the
    CPU device's GEMMs accumulate in fp32, so a run there is refused naming the device."""
    import subprocess

    import strider
    with pytest.raises(ValueError, match="matmul_accumulate.*needs dtype fp16"):
        strider.EngineConfig(matmul_accumulate="fp16")
    assert strider.EngineConfig(dtype="fp16", matmul_accumulate="fp16").engine_dict()["matmul_accumulate"] == "fp16"
    exe = str(strider_binary("strider"))
    r = subprocess.run([exe, "plan", "--matmul-accumulate", "fp16"], capture_output=True, text=True, cwd=tmp_path)
    # The refusal names the options as given (engine/cli/config_options.cpp, engine_settings).
    assert r.returncode != 0 and "--matmul-accumulate fp16 with --dtype bf16: " in r.stderr, r.stdout + r.stderr
    assert "needs dtype fp16, not bf16" in r.stderr, r.stderr
    r = subprocess.run([exe, "finetune", "--dtype", "fp16", "--matmul-accumulate", "fp16", "--steps", "1",
                        "--device", "cpu", "--out", str(tmp_path / "out")], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode != 0 and "matmul_accumulate fp16 is CUDA only" in r.stdout + r.stderr, r.stdout + r.stderr


def test_finetune_overflows_back_the_scale_off_without_counting_as_divergence(strider_binary, tmp_path):
    """`strider finetune --dtype fp16` from an initial scale of 2^24: the built-in model's scaled gradients
    overflow for the first steps (7 in a row on this machine, at one sequence of 64 tokens a step: the demo's
    batch took 58 s of fp16 CPU GEMMs for the same test); each skip halves the scale, none counts toward
    --max-skipped-steps 2, and the run trains its 3 steps. The metrics say each overflow and each step's scale."""
    import subprocess

    metrics = tmp_path / "metrics.jsonl"
    r = subprocess.run([str(strider_binary("strider")), "finetune", "--dtype", "fp16", "--loss-scale", str(2.0 ** 24),
                        "--steps", "3", "--max-skipped-steps", "2", "--device", "cpu", "--out", str(tmp_path / "out"),
                        "--micro-batch", "1", "--accumulation", "1", "--seq", "64",
                        "--metrics", str(metrics)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    overflows = [x for x in lines if x.get("overflow")]
    trained = [x for x in lines if "tokens_per_s" in x]
    assert all(x.get("overflow") for x in lines[:3]), "the first steps did not overflow 3 times in a row"
    assert [x["step"] for x in trained] == [1, 2, 3]
    # In order: each line's scale is 2^24 halved once per overflow before it (a later one may come too).
    scale = 2.0 ** 24
    for x in lines:
        if "loss_scale" in x:
            assert x["loss_scale"] == scale, x
        if x.get("overflow"):
            assert x["next_loss_scale"] == scale / 2, x
            scale /= 2
    assert len(overflows) >= 3
    assert "fp16 gradients overflowed at loss scale 1.67772e+07" in r.stdout
