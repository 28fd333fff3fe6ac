"""The sliding-window Engine, driven from Python, against transformers + torch.optim.AdamW.

docs/design.md's "same maths as the reference": in fp32 mode, several optimizer
steps of the engine (window 2, micro-batches, accumulation, global-norm
clipping, a warm-up + linear learning-rate schedule, AdamW with weight decay)
track a plain Hugging Face model trained by torch to 1e-5 relative in every
step's loss, and every parameter afterwards is as near an fp64 run as torch
fp32's own (check_params: within 1e-5, or torch fp32's own distance where an
update AdamW's eps makes sensitive puts that farther); with chaos delays too.

The loss both sides compute: the mean over ALL valid tokens of the whole batch.
The reference gets there the way a careful HF training loop does: per
micro-batch, the sum of token losses divided by the batch's valid-token count
(HF's num_items_in_batch), gradients accumulated, then clip, AdamW, scheduler.
"""
import copy
import json

import pytest
import torch

import transformers  # requirements.txt: a missing one fails here, not skips

import strider.config  # noqa: E402

from strider.torch_reference import adamw_steps

from conftest import require_op_library, step_report  # noqa: E402

require_op_library()

SEQ, MICRO_BATCH, ACCUMULATION, STEPS = 17, 2, 2, 5
BATCH = MICRO_BATCH * ACCUMULATION
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0
WARMUP, TOTAL = 2, 6  # factors 0, .5, 1, .75, .5: the first update moves only m and v

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=64, rms_norm_eps=1e-5)


def hf_config(arch):
    from transformers import (Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig, Olmo2Config, Phi3Config, Qwen2Config,
                              Qwen3Config)
    if arch == "llama":
        return LlamaConfig(**SMALL)
    if arch == "qwen2":  # q, k and v biases
        return Qwen2Config(**SMALL)
    if arch == "qwen3_tied":
        return Qwen3Config(**{**SMALL, "num_hidden_layers": 3, "head_dim": 24}, tie_word_embeddings=True)
    if arch == "granite_tied":  # its four multipliers, none of them 1 (Granite 3 ties its embeddings)
        return GraniteConfig(**SMALL, tie_word_embeddings=True, embedding_multiplier=3.0, attention_multiplier=0.09,
                             residual_multiplier=0.7, logits_scaling=0.8)
    if arch == "phi3":  # fused qkv_proj and gate_up_proj
        return Phi3Config(**SMALL, pad_token_id=0)
    if arch == "phi4_mini":  # Phi-3's layer with partial rotary 0.75 and longrope past 8 positions (< SEQ)
        return Phi3Config(**SMALL, pad_token_id=0, original_max_position_embeddings=8, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8,
            "partial_rotary_factor": 0.75, "short_factor": [1.0] * 6, "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0]})
    if arch == "olmo2":  # post-norms, q/k norms over the whole projections
        return Olmo2Config(**SMALL, pad_token_id=0)
    if arch == "gemma3_tied":  # sandwich norms, GELU-tanh, sliding (window 8 < SEQ) and global layers
        return Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 3, "head_dim": 24}, pad_token_id=0, sliding_window=8,
                                query_pre_attn_scalar=20,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 50000.0}})
    if arch == "gemma2_tied":  # soft-capped attention scores and logits, sliding (window 8 < SEQ) and global layers
        return Gemma2Config(**{**SMALL, "num_hidden_layers": 3, "head_dim": 24}, pad_token_id=0, sliding_window=8,
                            query_pre_attn_scalar=20, attn_logit_softcapping=3.0, final_logit_softcapping=4.0)
    raise KeyError(arch)


def make_model(arch, seed=0):
    torch.manual_seed(seed)
    cfg = hf_config(arch)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms start at ones: perturb them so their updates mean something
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def model_json(model):
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    return json.dumps(cfg, default=str)


def engine_settings(**over):
    cfg = dict(seq=SEQ, micro_batch=MICRO_BATCH, accumulation=ACCUMULATION, dtype="fp32", vocab_chunk=300,
               window=2, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY,
               optimizer="adamw", schedule="linear", warmup_steps=WARMUP, total_steps=TOTAL, clip_norm=CLIP)
    cfg.update(over)
    return strider.config.engine_settings(cfg)  # typed: torch.classes.strider.EngineSettings


def batches(vocab, seed=1, batch=BATCH, steps=STEPS):
    """`steps` batches of [batch, SEQ]: HF-style labels (equal to ids, -100 where
    no loss counts), a different number of valid tokens per micro-batch."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        ids = torch.randint(0, vocab, (batch, SEQ), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100              # a prompt that does not count
        labels[s % batch, 9 + s:] = -100  # and padding, in a different sample each step
        out.append((ids, labels))
    return out


def shifted(labels):
    """Our labels are aligned with inputs (the token reader shifts); HF shifts inside the loss."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def new_engine(model, chaos=False, **over):
    return torch.classes.strider.Engine(model_json(model), engine_settings(**over), "cpu", 0, chaos, 7)


def load_into(engine, model):
    params = dict(model.named_parameters())  # a tied weight appears once
    assert set(engine.param_names()) == set(params)
    for name, p in params.items():
        engine.set_param(name, p.detach())


def reference_run(model, data, decay_all=False, **over):
    """transformers + torch.optim.AdamW: per-step (loss, grad norm before clipping). Weight decay of the
    parameters transformers' Trainer decays (not norms and biases), or of all of them. A batch (ids, labels,
    position_ids) packs documents: each micro-batch gets its position_ids, without a cache (with one,
    transformers does not look for packed sequences)."""
    def micro_loss(model, batch, rows):
        ids, labels, *pos = batch
        packed = dict(position_ids=pos[0][rows], use_cache=False) if pos else {}
        # HF's loss with num_items_in_batch: sum of token losses / the batch's valid tokens.
        valid = int((shifted(labels) != -100).sum())
        return model(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=valid, **packed).loss

    hyper = dict(micro_batch=MICRO_BATCH, accumulation=ACCUMULATION, lr=LR, betas=BETAS, eps=EPS,
                 weight_decay=WEIGHT_DECAY, clip=CLIP, warmup=WARMUP, total=TOTAL)
    return adamw_steps(model, data, micro_loss, **{**hyper, **over},
                       param_groups=list(model.parameters()) if decay_all else None)


def engine_run(engine, data):
    return [step_report(engine.step(ids, shifted(labels))) for ids, labels in data]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def references(model, data, decay_all=False, **over):
    """The runs strider's parameters are measured against, each from `model`'s start: fp64 (the truth), and
    torch fp32 on each step's whole batch at once, which rounds otherwise than `model`'s own run (trained
    by the caller, micro-batch by micro-batch, after this). Returns (fp64 model, whole-batch model)."""
    model64, whole = copy.deepcopy(model).double(), copy.deepcopy(model)
    reference_run(model64, data, decay_all, **over)
    accumulation = over.pop("accumulation", ACCUMULATION)
    reference_run(whole, data, decay_all, **over, micro_batch=MICRO_BATCH * accumulation, accumulation=1)
    return model64, whole


def check_params(engine, model, refs, steps):
    """Every parameter of the engine no farther from the fp64 run than max(1e-5, torch fp32's own distance
    from it, the farther of its two runs).

    One bound for every tensor, embeddings included. AdamW divides a gradient by its own root mean square
    plus eps, so where a gradient is near eps (1e-8: an embedding row whose token a step barely moves,
    shrunk further by clipping), fp32's rounding in it becomes a visible difference in the update. On
    test_fp32_steps' OLMo 2 such rows land 4e-6 or 7e-5 from fp64 in torch fp32, by the order of its sums
    alone (micro-batch by micro-batch, or the whole batch), and 2.6e-5 in strider, while every other tensor
    of each stays within 3e-6; on test_embedding_rows' run (seeds 1-5) up to 3.3e-4 in torch and 2.6e-4 in
    strider, and with eps 1e-12, out of eps's reach, within 4e-6."""
    model64, whole = refs
    truths, others = dict(model64.named_parameters()), dict(whole.named_parameters())
    for name, p in model.named_parameters():
        ours, truth = engine.param(name), truths[name].detach()
        assert ours.shape == p.shape, name
        bound = max(1e-5, rel_err(p.detach(), truth), rel_err(others[name].detach(), truth))
        assert rel_err(ours, truth) <= bound, f"{name} after {steps} steps: {rel_err(ours, truth):.3g} > {bound:.3g}"


@pytest.mark.parametrize("arch,chaos,decay_all,devices", [
    ("llama", False, False, "1"), ("qwen3_tied", False, False, "1"), ("qwen2", False, False, "1"),
    ("llama", True, False, "1"), ("qwen3_tied", False, True, "1"),
    # A pool of CPU devices in one process (docs/pool.md, "How the pool runs"), chaos on each.
    ("llama", True, False, "2"), ("qwen3_tied", True, False, "3"), ("granite_tied", True, False, "2"),
    ("phi3", True, False, "2"), ("phi4_mini", False, False, "1"), ("olmo2", True, False, "2"), ("gemma3_tied", False, False, "1"),
    ("gemma3_tied", True, False, "2"), ("gemma2_tied", True, False, "2")])
def test_fp32_steps_track_transformers_and_adamw(arch, chaos, decay_all, devices):
    model = make_model(arch)
    data = batches(model.config.vocab_size)
    refs = references(model, data, decay_all)
    engine = new_engine(model, chaos=chaos, decay_norms_and_biases=decay_all, devices=devices)
    load_into(engine, model)
    reports = engine_run(engine, data)
    engine.finish()
    ref = reference_run(model, data, decay_all)

    clipped = 0
    for s, (r, (ref_loss, ref_norm)) in enumerate(zip(reports, ref)):
        assert r["step"] == s + 1
        assert r["lr"] == pytest.approx(LR * transformers.optimization._get_linear_schedule_with_warmup_lr_lambda(
            s, num_warmup_steps=WARMUP, num_training_steps=TOTAL), rel=1e-12, abs=0)
        assert abs(r["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), f"step {s + 1} loss {r['loss']} vs {ref_loss}"
        assert abs(r["grad_norm"] - ref_norm) <= 1e-5 * ref_norm, f"step {s + 1} grad norm"
        assert r["valid_tokens"] == int((shifted(data[s][1]) != -100).sum())
        clipped += ref_norm > CLIP
    assert clipped > 0, "no step was clipped: the clipping path went untested"

    check_params(engine, model, refs, STEPS)


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_embedding_rows_adam_barely_moves_are_held_to_fp64(seed):
    """OLMo 2 of odd widths, 3 layers, accumulation 3, decay 0.1, clipping at 1.0, beta2 0.999, 4 steps: the
    run where embedding rows of tokens first seen in a later step sat up to 1e-3 from torch fp32 while every
    other tensor agreed to 7e-6. Neither fp32 run is nearer the fp64 one there (check_params says why), and
    with eps 1e-12, which takes those rows out of eps's reach, strider and torch fp32 agree on every tensor,
    embeddings included, to 1e-5."""
    from transformers import Olmo2Config
    cfg = Olmo2Config(hidden_size=72, intermediate_size=94, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=64, rms_norm_eps=1e-5,
                      pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for p in base.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    steps, accumulation, betas = 4, 3, (0.9, 0.999)
    data = batches(cfg.vocab_size, seed=seed, batch=MICRO_BATCH * accumulation, steps=steps)
    for eps in (1e-8, 1e-12):
        model = copy.deepcopy(base)
        hyper = dict(accumulation=accumulation, betas=betas, eps=eps)
        refs = references(model, data, **hyper)
        engine = new_engine(model, accumulation=accumulation, beta2=betas[1], eps=eps)
        load_into(engine, model)
        engine_run(engine, data)
        engine.finish()
        reference_run(model, data, **hyper)
        check_params(engine, model, refs, steps)
        if eps == 1e-12:
            for name, p in model.named_parameters():
                assert rel_err(engine.param(name), p.detach()) <= 1e-5, name


def test_chaos_changes_nothing():
    """Offload changes nothing: chaos delays and a wider window give bit-identical parameters."""
    model = make_model("llama")
    data = batches(model.config.vocab_size)[:2]
    finals = []
    for chaos, window in [(False, 2), (True, 2), (True, 3)]:
        engine = new_engine(model, chaos=chaos, window=window)
        load_into(engine, model)
        losses = [r["loss"] for r in engine_run(engine, data)]
        finals.append((losses, {n: engine.param(n) for n in engine.param_names()}))
    for losses, params in finals[1:]:
        assert losses == finals[0][0]
        for n, p in params.items():
            assert torch.equal(p, finals[0][1][n]), n


def test_report_and_evaluate(tmp_path):
    model = make_model("llama")
    ids, labels = batches(model.config.vocab_size)[0]
    engine = new_engine(model)
    load_into(engine, model)
    before = engine.evaluate(ids, shifted(labels))
    with torch.no_grad():
        valid = int((shifted(labels) != -100).sum())
        ref = sum(model(input_ids=ids[m * MICRO_BATCH:(m + 1) * MICRO_BATCH],
                        labels=labels[m * MICRO_BATCH:(m + 1) * MICRO_BATCH], num_items_in_batch=valid).loss.item()
                  for m in range(ACCUMULATION))
    assert before == pytest.approx(ref, rel=1e-5)
    r = step_report(engine.step(ids, shifted(labels)))
    assert r["loss"] == pytest.approx(before, rel=1e-6)  # the same forward, before any update
    assert r["tokens"] == BATCH * SEQ and 0 < r["valid_tokens"] < r["tokens"]
    assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and 0 < r["overlap_efficiency"] <= 1.0 + 1e-9
    assert set(r["busy_fraction"]) >= {"compute", "h2d", "d2h", "optimizer"}
    assert 0 < r["peak_device_bytes"] <= 1 << 30
    trace = tmp_path / "trace.json"
    engine.write_trace(str(trace))
    names = {e["name"].split(" b")[0] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    assert {"forward", "recompute+backward", "h2d params", "d2h grads", "adamw"} <= names


def test_init_params_and_param_names():
    model = make_model("qwen3_tied")
    engine = new_engine(model)
    names = engine.param_names()
    assert names[0] == "model.embed_tokens.weight" and "lm_head.weight" not in names  # tied: stored once
    assert names[-1] == "model.norm.weight"
    engine.init_params(3)
    assert torch.equal(engine.param("model.norm.weight"), torch.ones(64))
    w = engine.param("model.layers.0.mlp.up_proj.weight")
    assert w.shape == (96, 64) and 0.015 < w.std().item() < 0.025
    # Any float dtype and any strides go in; fp32 in the layout's shape comes out.
    v = torch.randn(64, 96).t()
    assert not v.is_contiguous()
    engine.set_param("model.layers.0.mlp.up_proj.weight", v.to(torch.bfloat16))
    assert torch.equal(engine.param("model.layers.0.mlp.up_proj.weight"), v.to(torch.bfloat16).float())


def bad_config_message(model, **over):
    with pytest.raises((ValueError, RuntimeError)) as e:
        new_engine(model, **over)
    return str(e.value)


def test_bad_configs_are_named():
    model = make_model("llama")
    assert "window" in bad_config_message(model, window=1)
    assert "'windw'" in bad_config_message(model, windw=2)
    assert "seq" in bad_config_message(model, seq=65)  # past max_position_embeddings
    assert "dtype" in bad_config_message(model, dtype="fp8")
    with pytest.raises(ValueError, match="model_config_json.*num_attention_heads|num_attention_heads"):
        cfg = json.loads(model_json(model))
        cfg["num_attention_heads"] = 0
        torch.classes.strider.Engine(json.dumps(cfg), engine_settings(), "cpu", 0, False, 1)
    with pytest.raises(ValueError, match="not valid JSON"):
        torch.classes.strider.Engine("{", engine_settings(), "cpu", 0, False, 1)


def test_refused_calls_leave_the_model_untouched():
    model = make_model("llama")
    ids, labels = batches(model.config.vocab_size)[0]
    labels = shifted(labels)
    engine = new_engine(model)
    load_into(engine, model)
    before = {n: engine.param(n) for n in engine.param_names()}

    with pytest.raises(ValueError, match=r"ids must have shape \[batch, seq\] = \[4, 17\]"):
        engine.step(ids[:, :-1], labels)
    with pytest.raises(ValueError, match=r"labels must have shape \[batch, seq\] = \[4, 17\]"):
        engine.step(ids, labels[:2])
    with pytest.raises(ValueError, match="int64"):
        engine.step(ids.int(), labels)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 1000\)"):
        engine.step(torch.full_like(ids, 1000), labels)
    with pytest.raises(ValueError, match="-100"):
        engine.step(ids, torch.full_like(labels, 1000))
    with pytest.raises(ValueError, match="every label is -100"):
        engine.evaluate(ids, torch.full_like(labels, -100))
    # A training batch without a target is no error (sparse chat data has them): skipped, nothing changes.
    empty = step_report(engine.step(ids, torch.full_like(labels, -100)))
    assert empty["skipped"] and empty["no_targets"] and engine.steps_done() == 0
    with pytest.raises(ValueError, match=r"expected shape \[64\]"):
        engine.set_param("model.norm.weight", torch.ones(63))
    with pytest.raises(ValueError, match="no parameter 'lm_head.bias'"):
        engine.param("lm_head.bias")

    for n, p in before.items():
        assert torch.equal(engine.param(n), p), n
    # Still usable: the refused calls started nothing, and the next step is step 1.
    r = step_report(engine.step(ids, labels))
    assert r["step"] == 1
