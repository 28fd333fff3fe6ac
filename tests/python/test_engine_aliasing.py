"""strider.Engine trains the model's own parameters in place, and saves / resumes its full state.

What a user relies on: after Engine(model) every parameter IS the engine's compute copy (a write through
the engine's view shows in the model; no second copy of the weights), in the compute dtype, ties kept;
after training (and finish()) the model's parameters are the fp32 masters rounded to the compute dtype,
so save_pretrained writes the trained weights without sync_to_model; a model that outlives its Engine
still reads valid weights; engine.save -> Engine.resume -> more steps is bit-identical to the steps
without the round trip; and every refusal (of the engine or of a resume) leaves the model's parameters
where and what they were.
"""
import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import transformers  # requirements.txt: a missing one fails here, not skips
import strider  # noqa: E402  (tests/python/conftest.py puts python_shim/ on sys.path)

from conftest import launch_python_ranks, require_op_library  # noqa: E402

require_op_library()

from test_package import BATCH, SEQ, config, hf_batches, make_model  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pointers(model):
    return {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()}


def values(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_untouched(model, ptrs, vals):
    assert pointers(model) == ptrs, "a parameter was rebound"
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), vals[n]), f"{n} changed"


@pytest.mark.parametrize("kind,dtype", [("llama", "fp32"), ("qwen3_tied", "bf16"), ("llama", "fp16")])
def test_parameters_are_the_engines_compute_copy(kind, dtype):
    model = make_model(kind)
    initial = values(model)
    engine = strider.Engine(model, config(dtype=dtype))
    params = dict(model.named_parameters())
    assert set(params) == set(engine.param_names())
    for name, p in params.items():
        view = engine._engine.compute_view(name)
        assert p.data_ptr() == view.data_ptr() and p.shape == view.shape, f"{name} is not the engine's copy"
        assert p.dtype == DTYPES[dtype] and engine.is_aliased(name)
        assert torch.equal(p.detach(), initial[name].to(DTYPES[dtype])), f"{name} was not loaded"
        # Not a copy: a write through the engine's view is what the model reads.
        view.fill_(0.5)
        assert bool((p.detach() == 0.5).all()), name
    # Every parameter's bytes are distinct slots (no two share memory, so no hidden sharing either).
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in params.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    if kind == "qwen3_tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_model_holds_the_trained_weights_and_saves_them(tmp_path, dtype):
    model = make_model()
    initial = values(model)
    engine = strider.Engine(model, config(dtype=dtype, total_steps=6))
    for batch in hf_batches(model.config.vocab_size, 5):
        engine.step(*batch)
    engine.finish()
    for name, p in model.named_parameters():
        master = engine.param(name)
        assert torch.equal(p.detach(), master.to(DTYPES[dtype])), f"{name} is not its master in {dtype}"
        assert not torch.equal(master, initial[name]), f"{name} did not move"
    # No sync_to_model: the model's parameters are the trained weights already.
    model.save_pretrained(tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, p in loaded.named_parameters():
        assert p.dtype == DTYPES[dtype]
        assert torch.equal(p, engine.param(name).to(DTYPES[dtype])), f"{name} as saved"
    assert engine.sync_to_model() is model  # old code still works: it waits, and changes nothing
    assert all(engine.is_aliased(n) for n in engine.param_names())


def test_a_pool_of_devices_trains_the_model_in_place_to_one_devices_bits():
    """EngineConfig(devices=...): one process drives a pool (here 2 and 3 CPU devices, chaos on each); the
    model's parameters are still the engine's one compute copy, and they end on one device's bits."""
    finals = {}
    for devices in ("1", "2", "3"):
        model = make_model("qwen3_tied")
        engine = strider.Engine(model, config(dtype="fp32", devices=devices, chaos=True, total_steps=6))
        assert all(engine.is_aliased(n) for n in engine.param_names())
        for batch in hf_batches(model.config.vocab_size, 3):
            engine.step(*batch)
        engine.finish()
        finals[devices] = values(model)
    for devices in ("2", "3"):
        for n, p in finals["1"].items():
            assert torch.equal(finals[devices][n], p), (devices, n)
    with pytest.raises(ValueError, match="devices"):
        config(devices="two")


def test_a_parameter_rebound_away_still_gets_synced():
    model = make_model()
    engine = strider.Engine(model, config())
    engine.step(*hf_batches(model.config.vocab_size, 1)[0])
    model.model.norm.weight.data = model.model.norm.weight.data.clone()  # e.g. what model.to(...) does
    assert not engine.is_aliased("model.norm.weight")
    engine.sync_to_model()
    assert torch.equal(model.model.norm.weight.detach(), engine.param("model.norm.weight"))


def test_finish_after_model_to_leaves_no_stale_weight():
    """model.to(torch.float32) during bf16 training rebinds every parameter to an fp32 copy of the compute
    copy; the engine trains on, and finish() gives each the trained fp32 master."""
    model = make_model()
    engine = strider.Engine(model, config(dtype="bf16"))
    batches = hf_batches(model.config.vocab_size, 3)
    engine.step(*batches[0])
    model.to(torch.float32)
    assert not any(engine.is_aliased(n) for n in engine.param_names())
    for batch in batches[1:]:
        engine.step(*batch)
    engine.finish()
    params = dict(model.named_parameters())
    for name in engine.param_names():
        assert params[name].dtype == torch.float32 and torch.equal(params[name].detach(), engine.param(name)), name


def test_a_model_outliving_its_engine_reads_valid_weights():
    """In a child process, so that a dangling pointer is a failed test rather than a crashed suite."""
    code = textwrap.dedent("""
        import gc, sys, torch
        sys.path[:0] = [sys.argv[1], sys.argv[2]]
        import strider
        from test_package import config, hf_batches, make_model
        model = make_model()
        engine = strider.Engine(model, config())
        for batch in hf_batches(model.config.vocab_size, 2):
            engine.step(*batch)
        want = {n: engine.param(n) for n in engine.param_names()}
        ids = hf_batches(model.config.vocab_size, 1)[0][0]
        del engine, batch
        gc.collect()
        junk = [torch.full((1 << 20,), 7.0) for _ in range(64)]  # reuse freed memory, if any was freed
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), want[n]), n
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids).loss.item()
        assert loss == loss and loss < 20, loss
        del model
        gc.collect()
        print("ok")
    """)
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(strider.__path__[0]), here],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_refused_engines_leave_the_parameters_where_they_were():
    cases = [(make_model("gpt2"), config(), "not supported"),
             (make_model(), config(device_budget="64KiB"), "device budget"),
             (make_model(), config(seq=65), "max_position_embeddings"),
             (make_model(), config(device="cuda:0" if not torch.cuda.is_available() else "cuda:99"), "cuda"),
             (make_model("qwen3_tied"), config(nvme_dir="/tmp", nvme_blocks=[99]), "nvme block 99")]
    for model, cfg, match in cases:
        ptrs, vals = pointers(model), values(model)
        with pytest.raises(ValueError, match=match):
            strider.Engine(model, cfg)
        assert_untouched(model, ptrs, vals)
    if torch.cuda.is_available():  # the real "already on a GPU"; test_package covers it with meta here
        model = make_model()
        model.lm_head.cuda()
        ptrs, vals = pointers(model), values(model)
        with pytest.raises(ValueError, match="keep the model on the CPU"):
            strider.Engine(model, config())
        assert pointers(model) == ptrs


@pytest.mark.parametrize("dtype,state", [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "q8")])
def test_save_resume_continues_bit_identically(tmp_path, dtype, state):
    cfg = config(dtype=dtype, total_steps=6, optimizer_state=state)
    data = hf_batches(500, 5, seed=4)
    model = make_model()
    engine = strider.Engine(model, cfg)
    for batch in data[:2]:
        engine.step(*batch)
    engine.save(tmp_path / "ckpt", extra={"position": 2})
    at_save = values(model)  # save waited for the updates
    straight = [engine.step(*batch) for batch in data[2:]]
    engine.finish()

    info = strider.inspect_checkpoint(tmp_path / "ckpt")
    assert (info["step"], info["extra"], info["engine_config"]["dtype"]) == (2, {"position": 2}, dtype)
    assert info["engine_config"]["optimizer_state"] == state
    assert info["model_problems"] == []  # the exportable copy matches what its save wrote
    # The checkpoint's model files load with transformers.
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    for name, p in saved.named_parameters():
        assert torch.equal(p, at_save[name]), f"{name} in the checkpoint's model.safetensors"

    other = make_model(seed=9)  # different weights: the checkpoint's must win
    resumed = strider.Engine.resume(tmp_path / "ckpt", other)  # config from the checkpoint
    assert resumed.steps_done == 2 and resumed.resumed_extra == {"position": 2}
    assert resumed.config.engine_dict() == cfg.replace(device="auto").engine_dict()
    for name, p in other.named_parameters():
        assert resumed.is_aliased(name) and torch.equal(p.detach(), at_save[name]), name
    again = [resumed.step(*batch) for batch in data[2:]]
    resumed.finish()
    assert [(r.step, r.loss, r.grad_norm, r.lr) for r in again] == \
        [(r.step, r.loss, r.grad_norm, r.lr) for r in straight]
    for name in engine.param_names():
        assert torch.equal(resumed.param(name), engine.param(name)), f"{name} master"
        assert torch.equal(dict(other.named_parameters())[name].detach(),
                           dict(model.named_parameters())[name].detach()), f"{name} in the model"

    # load() into a running engine: back to step 2, and the model follows.
    engine.load(tmp_path / "ckpt")
    assert engine.steps_done == 2
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), at_save[name]), name
    assert engine.step(*data[2]).loss == straight[0].loss


def test_refused_resumes_leave_the_model_untouched(tmp_path):
    model = make_model()
    engine = strider.Engine(model, config())
    engine.step(*hf_batches(model.config.vocab_size, 1)[0])
    engine.save(tmp_path / "ckpt", write_model=False)
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()

    def refused(target, match, **kw):
        ptrs, vals = pointers(target), values(target)
        with pytest.raises(ValueError, match=match):
            strider.Engine.resume(kw.pop("path", tmp_path / "ckpt"), target, **kw)
        assert_untouched(target, ptrs, vals)

    refused(make_model(), "no training checkpoint at .*nowhere", path=tmp_path / "nowhere")
    refused(make_model("qwen3_tied"), r"trainer_state.json: the checkpoint is of another model")
    refused(make_model(), r"trainer_state.json: the engine config changes the maths of the saved run: lr",
            config=config(lr=5e-4))
    refused(make_model(), "total_steps", config=config(total_steps=8))
    refused(make_model("gpt2"), "not supported")
    longer = strider.Engine.resume(tmp_path / "ckpt", make_model(), config=config(total_steps=8),
                                   allow_changed=["total_steps"])  # extending a run is allowed when asked
    assert longer.steps_done == 1 and longer.config.total_steps == 8
    # A damaged state file: named, and the running engine (and its model) untouched by a refused load.
    state = tmp_path / "ckpt" / "state.safetensors"
    raw = bytearray(state.read_bytes())
    raw[-5] ^= 0xFF
    state.write_bytes(bytes(raw))
    refused(make_model(), "state.safetensors.*checksum")
    ptrs, vals = pointers(model), values(model)
    with pytest.raises(ValueError, match="checksum"):
        engine.load(tmp_path / "ckpt")
    assert_untouched(model, ptrs, vals)
    assert engine.steps_done == 1


def test_engines_in_a_distributed_group_train_as_one_process_with_their_accumulation(tmp_path):
    """Data parallel from Python: 2 processes of a torch.distributed group (Gloo, file:// rendezvous) each wrap
    the same tiny transformers model with strider.Engine and step on their own micro-batch of each batch; one
    process steps on both micro-batches (accumulation 2). The gradients are summed over the ranks in rank
    order, the state sharded between them: both ranks' models end with the one process's weights, bit for bit
    (every process computes with one ATen thread: a GEMM split over more rounds differently), and a checkpoint
    saved by the ranks holds them too."""
    code = """
        import strider
        from test_package import config, make_model, hf_batches
        model = make_model()
        engine = strider.Engine(model, config(micro_batch=2, accumulation=2 // world))
        rows = slice(2 * rank, 2 * rank + 4 // world)
        for ids, labels, mask in hf_batches(model.config.vocab_size, 3):
            loss = engine.step(ids[rows], labels[rows], mask[rows]).loss
        engine.finish()
        engine.save(out + "-ckpt", extra={"rank": rank})
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out + "-%d.pt" % rank)
        print("loss", loss)
    """

    def launch(world, name):
        return [out.split()[-1] for out in launch_python_ranks(code, world, tmp_path / name)]

    ranks_loss, (one_loss,) = launch(2, "ranks"), launch(1, "one")
    assert ranks_loss == [one_loss, one_loss]  # the global batch's loss, the same bits
    one = torch.load(tmp_path / "one-0.pt")
    for rank in range(2):
        got = torch.load(tmp_path / f"ranks-{rank}.pt")
        for name, w in one.items():
            assert torch.equal(got[name].view(torch.int32), w.view(torch.int32)), (rank, name)
    # Rank 0 wrote the checkpoint, gathering rank 1's slices: masters and moments as the one process's.
    from safetensors.torch import load_file
    a, b = load_file(str(tmp_path / "ranks-ckpt" / "state.safetensors")), load_file(str(tmp_path / "one-ckpt" / "state.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k


def test_a_second_engine_on_a_model_is_refused_while_the_first_lives():
    """Two engines on one model would write their trained weights into each other's compute copy (the
    first's finish() syncs into parameters the second has rebound). Refused, the model untouched; once the
    first is dropped, a new one may take the model."""
    model = make_model()
    first = strider.Engine(model, config())
    first.step(*hf_batches(model.config.vocab_size, 1)[0])
    ptrs, vals = pointers(model), values(model)
    with pytest.raises(ValueError, match="trained by another strider.Engine that is still alive"):
        strider.Engine(model, config())
    assert_untouched(model, ptrs, vals)
    first.finish()
    del first
    second = strider.Engine(model, config())
    assert all(second.is_aliased(n) for n in second.param_names())


def test_a_model_with_a_non_finite_weight_is_refused_by_name():
    model = make_model()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[1, 2] = float("nan")
    ptrs, vals = pointers(model), values(model)
    with pytest.raises(ValueError, match=r"parameter model.layers.0.mlp.up_proj.weight holds nan at element \d+: "
                                         "a model with a non-finite weight cannot train"):
        strider.Engine(model, config())
    assert pointers(model) == ptrs  # untouched (NaN equals nothing, so the values by allclose's equal_nan)
    assert all(torch.allclose(p.detach(), vals[n], rtol=0, atol=0, equal_nan=True)
               for n, p in model.named_parameters())
