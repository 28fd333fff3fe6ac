"""strider.StriderTrainer: transformers.Trainer whose optimizer steps run on strider.

What a user relies on: trainer.train() steps the engine once per batch (and
nothing else touches the weights), so 3 steps through the Trainer equal 3
steps of strider.Engine on the same batches bit for bit; the loss the Trainer
logs is the engine's; save_model() writes the trained weights; a run resumed
from a checkpoint-N folder continues bit-identically; evaluate() is
the token-mean loss of the eval set; and TrainingArguments that strider cannot
honour, or that contradict the strider config, are refused with a ValueError.
"""
import dataclasses
import pytest
import torch

import accelerate  # noqa: F401  requirements.txt: transformers.Trainer needs it; a missing one fails here
import transformers  # requirements.txt: a missing one fails here, not skips
import strider  # noqa: E402  (tests/python/conftest.py puts python_shim/ on sys.path)
from conftest import require_op_library  # noqa: E402

require_op_library()

SEQ, MICRO_BATCH, ACCUMULATION, STEPS = 17, 2, 2, 3
BATCH = MICRO_BATCH * ACCUMULATION
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=500, max_position_embeddings=64, rms_norm_eps=1e-5)


def make_model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**SMALL)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms start at ones: perturb them so that their updates show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def config(**over):
    base = dict(seq=SEQ, micro_batch=MICRO_BATCH, accumulation=ACCUMULATION, dtype="fp32", vocab_chunk=200,
                window=2, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, schedule="linear", warmup_steps=1,
                total_steps=4, clip_norm=1.0, device="cpu")
    base.update(over)
    return strider.EngineConfig(**base)


def rows(n, seed):
    """Dataset rows as a tokenizing map gives them: unshifted labels, a prompt that does not count, right
    padding of different lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, SMALL["vocab_size"], (SEQ,), generator=g)
        labels = ids.clone()
        labels[:2] = -100
        mask = torch.ones(SEQ, dtype=torch.int64)
        mask[SEQ - (i % 5):] = 0
        out.append(dict(input_ids=ids, labels=labels, attention_mask=mask))
    return out


def training_args(tmp_path, **over):
    base = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
                max_steps=STEPS, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                train_sampling_strategy="sequential", disable_tqdm=True)
    base.update(over)
    return transformers.TrainingArguments(**base)


def test_train_steps_the_engine_like_the_engine_itself(tmp_path):
    model = make_model()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = rows(BATCH * STEPS, seed=1)
    args = training_args(tmp_path, save_strategy="steps", save_steps=STEPS)
    trainer = strider.StriderTrainer(model=model, args=args, train_dataset=data, strider_config=config())
    out = trainer.train()
    assert trainer.engine.last_result.step == STEPS and out.global_step == STEPS

    # The same batches straight through strider.Engine, from the same initial weights.
    direct = strider.Engine(make_model(), config())
    results = []
    for s in range(STEPS):
        batch = transformers.default_data_collator(data[s * BATCH:(s + 1) * BATCH])
        results.append(direct.step(batch["input_ids"], batch["labels"], batch["attention_mask"]))
    for name in direct.param_names():
        assert torch.equal(trainer.engine.param(name), direct.param(name)), f"{name} after {STEPS} steps"
        assert not torch.equal(direct.param(name), initial[name]), f"{name} did not move"

    logged = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    assert [e["step"] for e in logged] == [1, 2, 3]
    for e, r in zip(logged, results):
        assert e["loss"] == pytest.approx(r.loss, rel=1e-7, abs=0)  # the engine's loss, through a float32 sum
        assert e["grad_norm"] == r.grad_norm and e["learning_rate"] == r.lr
    # warm-up 1, decay to 0 at step 4: the schedule of get_linear_schedule_with_warmup
    assert [e["learning_rate"] for e in logged] == pytest.approx([0.0, 1e-3, 1e-3 * 2 / 3])

    # The checkpoint the Trainer wrote at step 3, and save_model, hold the engine's weights.
    checkpoint = tmp_path / "run" / f"checkpoint-{STEPS}"
    assert not (checkpoint / "optimizer.pt").exists()  # the placeholder optimizer is not a resumable state
    trainer.save_model(str(tmp_path / "saved"))
    for where in (checkpoint, tmp_path / "saved"):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32)
        for name, p in loaded.named_parameters():
            assert torch.equal(p, trainer.engine.param(name)), f"{name} as saved in {where.name}"

    # evaluate(): the mean over every valid token of the set, across batches of different sizes.
    held_out = rows(BATCH + 2, seed=2)
    metrics = trainer.evaluate(held_out)
    batch = transformers.default_data_collator(held_out)
    with torch.no_grad():
        want = loaded(input_ids=batch["input_ids"],
                      labels=batch["labels"].masked_fill(batch["attention_mask"] == 0, -100)).loss.item()
    assert metrics["eval_loss"] == pytest.approx(want, rel=1e-5)
    assert trainer.engine.last_result.step == STEPS  # evaluation did not step


def test_a_token_file_is_a_dataset(tmp_path):
    """A token file from `python -m strider.data`, by its path: the Trainer trains on its windows (in order,
    with sequential sampling) as the engine does on the same windows, and evaluates on one. Its documents
    start inside windows: each attends only to itself (packed_documents, position_ids)."""
    from strider.data import TokenDataset, write_token_file
    g = torch.Generator().manual_seed(5)
    n = SEQ * BATCH * STEPS + 7  # the last 7 tokens make no whole window
    ids = torch.randint(0, SMALL["vocab_size"], (n,), generator=g).numpy()
    mask = (torch.rand(n, generator=g) > 0.2).numpy().astype("uint8")
    path = tmp_path / "train.tokens"
    write_token_file(path, ids, mask=mask, doc_starts=[0, 40, 41], vocab_size=SMALL["vocab_size"])
    args = training_args(tmp_path)
    with pytest.raises(ValueError, match="set it to True so that each document attends only to itself"):
        strider.StriderTrainer(model=make_model(), args=args, train_dataset=str(path), strider_config=config())
    built = strider.StriderTrainer(model=make_model(), args=args, train_dataset=str(path), seq=SEQ)
    assert built.engine.config.packed_documents
    trainer = strider.StriderTrainer(model=make_model(), args=args, train_dataset=str(path),
                                     strider_config=config(packed_documents=True))
    assert isinstance(trainer.train_dataset, TokenDataset) and len(trainer.train_dataset) == BATCH * STEPS
    # Window 2 holds tokens 34..50: documents start at 40 (one token) and 41.
    assert trainer.train_dataset[2]["position_ids"].tolist() == list(range(6)) + [0] + list(range(10))
    trainer.train()
    direct = strider.Engine(make_model(), config(packed_documents=True))
    windows = TokenDataset(path, SEQ)
    for s in range(STEPS):
        batch = transformers.default_data_collator([windows[i] for i in range(s * BATCH, (s + 1) * BATCH)])
        direct.step(batch["input_ids"], batch["labels"], position_ids=batch["position_ids"])
    for name in direct.param_names():
        assert torch.equal(trainer.engine.param(name), direct.param(name)), name
    # evaluate(path): the token-mean loss over its windows, batch by batch (the engines' weights are equal).
    total = valid = 0
    for k in range(0, len(windows), BATCH):
        b = transformers.default_data_collator([windows[i] for i in range(k, min(k + BATCH, len(windows)))])
        n = int((b["labels"][:, 1:] != -100).sum())
        total, valid = total + direct.evaluate(b["input_ids"], b["labels"], position_ids=b["position_ids"]) * n, \
            valid + n
    assert trainer.evaluate(path)["eval_loss"] == pytest.approx(total / valid, rel=1e-9)
    with pytest.raises(ValueError, match="is a token file; pass seq="):
        strider.StriderTrainer(model=make_model(), args=args, train_dataset=str(path))


def test_config_from_training_arguments(tmp_path):
    args = training_args(tmp_path, per_device_train_batch_size=3, learning_rate=2e-4, lr_scheduler_type="cosine",
                         warmup_steps=0.25, max_steps=8, weight_decay=0.05, max_grad_norm=0.5, adam_beta2=0.98,
                         per_device_eval_batch_size=2)
    trainer = strider.StriderTrainer(model=make_model(), args=args, train_dataset=rows(6, seed=3), seq=SEQ)
    c = trainer.engine.config
    assert (c.seq, c.micro_batch, c.accumulation, c.dtype, c.device) == (SEQ, 3, 1, "fp32", "cpu")
    assert (c.lr, c.schedule, c.warmup_steps, c.total_steps) == (2e-4, "cosine", 2, 8)
    assert (c.weight_decay, c.clip_norm, c.betas) == (0.05, 0.5, (0.9, 0.98))
    # Without max_steps the schedule ends with the epochs: 2 epochs of ceil(7 / 3) batches.
    args = training_args(tmp_path, per_device_train_batch_size=3, per_device_eval_batch_size=3, max_steps=-1,
                         num_train_epochs=2)
    trainer = strider.StriderTrainer(model=make_model(), args=args, train_dataset=rows(7, seed=3), seq=SEQ)
    assert (trainer.engine.config.schedule, trainer.engine.config.total_steps) == ("linear", 6)


def test_an_eval_batch_larger_than_the_engines_runs_in_several(tmp_path):
    """TrainingArguments' default per_device_eval_batch_size (8) over an engine batch of 4 (issue 67: it was
    refused, even with no eval set): the eval set's loss is the mean over every valid token, as at 4 or 3."""
    model = make_model()
    data = rows(11, seed=5)  # not a multiple of either batch
    got = {}
    for eval_batch in (8, BATCH, 3):
        trainer = strider.StriderTrainer(model=make_model(), args=training_args(
            tmp_path, per_device_eval_batch_size=eval_batch), train_dataset=data, strider_config=config())
        got[eval_batch] = trainer.evaluate(data)["eval_loss"]
        trainer.engine.finish()
    assert got[8] == pytest.approx(got[BATCH], rel=1e-12) and got[3] == pytest.approx(got[BATCH], rel=1e-12)
    batch = transformers.default_data_collator(data)
    with torch.no_grad():
        want = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=batch["labels"].masked_fill(batch["attention_mask"] == 0, -100)).loss
    assert got[8] == pytest.approx(float(want), rel=1e-5)


@pytest.mark.parametrize("steps", [{"max_steps": 3}, {"max_steps": -1, "num_train_epochs": 1}])
def test_gradient_accumulation_steps_are_the_engines_accumulation(tmp_path, steps):
    """per_device_train_batch_size 2 and gradient_accumulation_steps 2, as a transformers user sets them (issue
    67: refused): the engine's micro-batch and accumulation; each optimizer step's two micro-batches are one
    engine step. 10 rows in epochs: 5 micro-batches, the last step of one (the Trainer's count, 3 steps)."""
    data = rows(12 if "max_steps" in steps and steps["max_steps"] > 0 else 10, seed=2)
    args = training_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, **steps)
    trainer = strider.StriderTrainer(model=make_model(), args=args, train_dataset=data, seq=SEQ)
    c = trainer.engine.config
    assert (c.micro_batch, c.accumulation, c.total_steps) == (2, 2, 3)
    trainer.train()
    assert trainer.engine.steps_done == trainer.state.global_step == 3
    direct = strider.Engine(make_model(), c)
    losses = []
    for s in range(3):
        batch = transformers.default_data_collator(data[4 * s:4 * s + 4])
        losses.append(direct.step(batch["input_ids"], batch["labels"], batch["attention_mask"]).loss)
    for name in direct.param_names():
        assert torch.equal(trainer.engine.param(name), direct.param(name)), name
    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    assert logged == pytest.approx(losses, rel=1e-6)


def test_fp16_steps_the_engine_with_its_own_loss_scaling(tmp_path):
    """fp16=True builds an fp16 engine (ATen's CPU fp16 GEMMs are slow: the model is tiny): its steps are
    strider.Engine's with EngineConfig(dtype="fp16") bit for bit, the Trainer's GradScaler never runs (the
    engine scales the loss), and the logs carry the engine's loss scale. An fp32 strider_config with
    fp16=True is refused."""
    data = rows(BATCH * STEPS, seed=1)
    args = training_args(tmp_path, fp16=True, learning_rate=1e-3, warmup_steps=1, max_grad_norm=1.0,
                         weight_decay=0.1, adam_beta2=0.95)
    trainer = strider.StriderTrainer(model=make_model(), args=args, train_dataset=data, seq=SEQ)
    assert trainer.engine.config.dtype == "fp16"
    # On a GPU accelerate makes a GradScaler for fp16 (on the CPU it makes none): one here, as there, must not
    # step the Trainer's placeholder optimizer.
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    trainer.train()
    direct = strider.Engine(make_model(), trainer.engine.config)
    results = []
    for s in range(STEPS):
        batch = transformers.default_data_collator(data[s * BATCH:(s + 1) * BATCH])
        results.append(direct.step(batch["input_ids"], batch["labels"], batch["attention_mask"]))
    assert all(r.loss_scale > 0 and not r.skipped for r in results)
    for name in direct.param_names():
        assert torch.equal(trainer.engine.param(name), direct.param(name)), f"{name} after {STEPS} steps"
    logged = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    assert [e["loss_scale"] for e in logged] == [r.loss_scale for r in results]
    with pytest.raises(ValueError, match="fp16 = True but strider_config.dtype = 'fp32'"):
        strider.StriderTrainer(model=make_model(), args=training_args(tmp_path, fp16=True), train_dataset=data,
                               strider_config=config())


@pytest.mark.parametrize("over, kw, match", [
    (dict(gradient_accumulation_steps=2), {}, r"4 x 2 \(8 sequences a step\), but one strider step takes micro_batch "
                                              r"x accumulation = 2 x 2 = 4"),
    (dict(per_device_train_batch_size=2), {}, r"micro_batch x accumulation = 2 x 2 = 4"),
    (dict(max_grad_norm=0.5), {}, r"max_grad_norm = 0.5 but the strider config's clip_norm is 1.0"),
    (dict(learning_rate=3e-4), {}, r"learning_rate = 0.0003 but the strider config's lr is 0.001"),
    (dict(lr_scheduler_type="cosine"), {}, "lr_scheduler_type = 'cosine' but strider_config.schedule = 'linear'"),
    (dict(optim="sgd"), {}, "strider's optimizer is AdamW"),
    (dict(lr_scheduler_type="polynomial"), dict(strider_config=None, seq=SEQ), "strider schedules are"),
    (dict(max_steps=-1, num_train_epochs=0), dict(strider_config=None, seq=SEQ),
     r"num_train_epochs = 0(\.0)? and max_steps = -1: the run has no step to train"),
    ({}, dict(strider_config=None), "pass seq="),
])
def test_refusals(tmp_path, over, kw, match):
    model = make_model()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    kwargs = {"strider_config": config(), **kw}
    with pytest.raises(ValueError, match=match):
        strider.StriderTrainer(model=model, args=training_args(tmp_path, **over), train_dataset=rows(4, 1), **kwargs)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# Each field strider's step does not implement, set away from its default: refused by name, before the
# engine exists (trains silently wrong 8, issue 63).
REFUSED_SETTINGS = {
    "label_smoothing_factor": 0.1,
    "neftune_noise_alpha": 5.0,
    "lr_scheduler_kwargs": {"num_cycles": 2},
    "optim_args": "foo=1",
    "optim_target_modules": ["q_proj"],
    "bf16_full_eval": True,
    "fp16_full_eval": True,
    "auto_find_batch_size": True,
}


def test_every_field_that_changes_the_maths_is_honoured_or_refused(tmp_path):
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    listed = strider.trainer.MATHS_FIELDS
    for name in listed["honoured"] + listed["refused"]:
        assert name in fields, f"TrainingArguments has no field {name}: update strider.trainer.MATHS_FIELDS"
    assert set(REFUSED_SETTINGS) == set(listed["refused"])
    for name, value in REFUSED_SETTINGS.items():
        with pytest.raises(ValueError, match=f"StriderTrainer: {name} = "):
            strider.StriderTrainer(model=make_model(), args=training_args(tmp_path, **{name: value}),
                                   train_dataset=rows(4, 1), strider_config=config())


def test_resume_from_checkpoint_continues_bit_identically(tmp_path):
    """4 steps with checkpoints at 2 and 4; a new trainer (other initial weights) resumed from checkpoint-2
    ends where the first one did, step by step, and its checkpoint-4 holds the same state."""
    steps = 4
    data = rows(BATCH * steps, seed=1)
    first = strider.StriderTrainer(model=make_model(), args=training_args(tmp_path / "a", max_steps=steps,
                                   save_strategy="steps", save_steps=2), train_dataset=data,
                                   strider_config=config())
    first.train()
    checkpoint = tmp_path / "a" / "run" / "checkpoint-2"
    assert (checkpoint / "strider" / "trainer_state.json").exists()  # strider's state, in HF's folder
    assert not (checkpoint / "optimizer.pt").exists()
    assert strider.inspect_checkpoint(checkpoint / "strider")["step"] == 2

    second = strider.StriderTrainer(model=make_model(seed=5), args=training_args(tmp_path / "b", max_steps=steps,
                                    save_strategy="steps", save_steps=2), train_dataset=data,
                                    strider_config=config())
    second.train(resume_from_checkpoint=str(checkpoint))
    assert second.engine.steps_done == steps and second.state.global_step == steps
    for name in first.engine.param_names():
        assert torch.equal(second.engine.param(name), first.engine.param(name)), f"{name} after resuming"

    def losses(trainer):
        return [(e["step"], e["loss"], e["grad_norm"]) for e in trainer.state.log_history
                if "loss" in e and "train_loss" not in e and e["step"] > 2]
    assert losses(second) == losses(first) and len(losses(first)) == 2

    # The resumed run's own checkpoint resumes too (resume_from_checkpoint=True: the last one).
    third = strider.StriderTrainer(model=make_model(seed=6), args=training_args(tmp_path / "b", max_steps=steps),
                                   train_dataset=data, strider_config=config())
    third.train(resume_from_checkpoint=True)
    assert third.engine.steps_done == steps and third.engine.last_result is None  # nothing left to do
    for name, p in third.model.named_parameters():
        assert torch.equal(p.detach(), first.engine.param(name)), name


def test_resume_from_a_folder_without_strider_state_is_refused(tmp_path):
    trainer = strider.StriderTrainer(model=make_model(), args=training_args(tmp_path), train_dataset=rows(4, 1),
                                     strider_config=config())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="holds no strider training state"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "plain"))
    assert trainer.engine.last_result is None and trainer.engine.steps_done == 0
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_skipped_steps_agree_with_the_command_line(tmp_path):
    """A batch without targets is skipped without counting and its checkpoint still resumes (the Trainer's
    global_step counts it, strider's step does not); max_skipped_steps non-finite steps in a row stop the
    run with the reason, as `strider finetune --max-skipped-steps` does."""
    data = rows(BATCH * 4, seed=1)
    for r in data[BATCH:2 * BATCH]:  # the second batch: every label ignored
        r["labels"][:] = -100
    first = strider.StriderTrainer(model=make_model(), args=training_args(tmp_path / "a", max_steps=4,
                                   save_strategy="steps", save_steps=2), train_dataset=data,
                                   strider_config=config())
    first.train()
    assert first.state.global_step == 4 and first.engine.steps_done == 3
    second = strider.StriderTrainer(model=make_model(seed=5), args=training_args(tmp_path / "b", max_steps=4),
                                    train_dataset=data, strider_config=config())
    second.train(resume_from_checkpoint=str(tmp_path / "a" / "run" / "checkpoint-2"))
    for name in first.engine.param_names():
        assert torch.equal(second.engine.param(name), first.engine.param(name)), name

    # A learning rate of 1e30 makes every weight huge after the first update: the next losses are not finite.
    diverging = strider.StriderTrainer(model=make_model(), args=training_args(tmp_path / "c", max_steps=3),
                                       train_dataset=rows(BATCH * 3, seed=2), max_skipped_steps=2,
                                       strider_config=config(lr=1e30, schedule="constant", warmup_steps=0))
    with pytest.raises(RuntimeError, match=r"2 steps in a row were skipped \(max_skipped_steps 2\)"):
        diverging.train()
    assert diverging.engine.steps_done == 1
    with pytest.raises(ValueError, match="max_skipped_steps"):
        strider.StriderTrainer(model=make_model(), args=training_args(tmp_path / "d"), train_dataset=data,
                               strider_config=config(), max_skipped_steps=0)


def test_a_peft_model_trains_saves_its_adapter_and_resumes_bit_identically(tmp_path):
    """StriderTrainer over a PEFT LoRA model: checkpoint-N holds the adapter (PEFT's save) and strider's state
    of the adapters only; a new trainer (the same base, new adapters) resumed from checkpoint-2 ends where the
    first one did; save_model() writes the adapter PeftModel.from_pretrained loads."""
    import peft  # requirements.txt: a missing one fails here, not skips

    def lora(seed):
        model = peft.get_peft_model(make_model(), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                   lora_dropout=0.0, task_type="CAUSAL_LM"))
        with torch.no_grad():  # adapters that differ between the trainers until the resume
            torch.manual_seed(seed)
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.add_(torch.randn_like(p) * 0.05)
        return model

    steps = 4
    data = rows(BATCH * steps, seed=1)
    first = strider.StriderTrainer(model=lora(1), args=training_args(tmp_path / "a", max_steps=steps,
                                   save_strategy="steps", save_steps=2), train_dataset=data,
                                   strider_config=config())
    first.train()
    checkpoint = tmp_path / "a" / "run" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").exists() and (checkpoint / "strider" / "trainer_state.json").exists()
    assert strider.inspect_checkpoint(checkpoint / "strider")["engine_config"]["lora"].startswith("r=4,alpha=8,")

    second = strider.StriderTrainer(model=lora(2), args=training_args(tmp_path / "b", max_steps=steps),
                                    train_dataset=data, strider_config=config())
    second.train(resume_from_checkpoint=str(checkpoint))
    assert second.engine.steps_done == steps
    first.engine.finish()  # the last step's updates may still be running: the parameters are the engine's copy
    second.engine.finish()
    want = dict(first.model.named_parameters())
    for name, p in second.model.named_parameters():
        assert torch.equal(p.detach(), want[name].detach()), f"{name} after resuming"

    second.save_model(str(tmp_path / "adapter"))
    loaded = peft.PeftModel.from_pretrained(make_model(), tmp_path / "adapter")
    ids = data[0]["input_ids"][None]
    with torch.no_grad():
        a, b = second.model(input_ids=ids).logits, loaded(input_ids=ids).logits
    assert (a - b).abs().max().item() <= 1e-6 * max(1.0, a.abs().max().item())
