"""strider.StriderDPOTrainer against trl.DPOTrainer itself (TRL 1.16, the pinned reference): the same tiny
Llama, the same preference dataset (prompt/chosen/rejected text, tokenized by TRL's own code), the same
DPOConfig, fp32 on the CPU. TRL's trainer runs the model with torch and a reference copy; strider's runs the
step on strider.Engine with the reference precomputed from the starting weights. Every logged step's loss,
gradient norm and rewards/* figures, and every weight afterwards, agree to 1e-5; a run resumed from its
checkpoint ends where the uninterrupted one does, bit for bit, and a resume without the saved reference is
refused."""
import copy
import os
import shutil

import datasets
import pytest
import torch
import transformers
import trl  # requirements.txt pins it (the reference): a missing one fails here, not skips

import strider
from conftest import require_op_library  # noqa: E402
from test_data_prep import SENTENCES, make_tiny_tokenizer  # noqa: E402
from test_package import rel_err  # noqa: E402

require_op_library()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return transformers.AutoTokenizer.from_pretrained(make_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def preference_data():
    """Pairs of completions of the same prompt: the chosen continues the text, the rejected is other words."""
    words = " ".join(SENTENCES).split()
    rows = []
    for i in range(0, 60, 5):
        rows.append({"prompt": " ".join(words[i:i + 3]), "chosen": " ".join(words[i + 3:i + 7]),
                     "rejected": " ".join(words[-(i % 7) - 4:][:2 + i % 3])})
    return datasets.Dataset.from_list(rows)


def tiny_model(vocab):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64,
                                   pad_token_id=0)
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def dpo_args(out, **over):
    kw = dict(output_dir=str(out), per_device_train_batch_size=2, max_steps=4, learning_rate=1e-3, report_to=[],
              use_cpu=True, logging_steps=1, max_length=16, save_strategy="no", seed=0, bf16=False,
              lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.1, beta=0.5)
    kw.update(over)
    return trl.DPOConfig(**kw)


FIGURES = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


def logged(trainer):
    return [{k: h[k] for k in FIGURES} for h in trainer.state.log_history if "loss" in h and "rewards/chosen" in h]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_strider_dpo_trainer_tracks_trl_dpo_trainer(tmp_path, tokenizer, loss_type):
    model = tiny_model(len(tokenizer))
    reference = copy.deepcopy(model)
    data = preference_data()
    theirs = trl.DPOTrainer(model=reference, ref_model=copy.deepcopy(model),
                            args=dpo_args(tmp_path / "trl", loss_type=[loss_type]),
                            train_dataset=data, processing_class=tokenizer)
    theirs.train()
    ours = strider.StriderDPOTrainer(model=model, args=dpo_args(tmp_path / "strider", loss_type=[loss_type]),
                                     train_dataset=data, processing_class=tokenizer)
    ours.train()
    got, want = logged(ours), logged(theirs)
    assert len(got) == len(want) == 4
    for s, (g, w) in enumerate(zip(got, want)):
        for k in FIGURES:
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-6), (s + 1, k, g[k], w[k])
    ours.engine.finish()
    for name, p in model.named_parameters():
        assert rel_err(p.detach(), dict(reference.named_parameters())[name].detach()) <= 1e-5, name


def test_a_resumed_run_ends_where_the_whole_one_does(tmp_path, tokenizer):
    data = preference_data()
    whole = strider.StriderDPOTrainer(model=tiny_model(len(tokenizer)), args=dpo_args(tmp_path / "whole"),
                                      train_dataset=data, processing_class=tokenizer)
    whole.train()
    first = strider.StriderDPOTrainer(model=tiny_model(len(tokenizer)),
                                      args=dpo_args(tmp_path / "run", max_steps=4, save_strategy="steps",
                                                    save_steps=2),
                                      train_dataset=data, processing_class=tokenizer)
    first.train()
    # The checkpoint after step 2 continued: the reference comes from it, not from the trained weights.
    for later in ("checkpoint-4",):
        shutil.rmtree(tmp_path / "run" / later)
    model = tiny_model(len(tokenizer))
    again = strider.StriderDPOTrainer(model=model, args=dpo_args(tmp_path / "run", max_steps=4),
                                      train_dataset=data, processing_class=tokenizer)
    again.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert logged(again)[-1] == logged(whole)[-1]
    for n in whole.engine.param_names():
        assert torch.equal(again.engine.param(n), whole.engine.param(n)), n
    os.remove(tmp_path / "run" / "checkpoint-2" / "strider" / "reference_logps.pt")
    fresh = strider.StriderDPOTrainer(model=tiny_model(len(tokenizer)), args=dpo_args(tmp_path / "run"),
                                      train_dataset=data, processing_class=tokenizer)
    with pytest.raises(ValueError, match="reference_logps.pt is missing"):
        fresh.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))


def eval_data():
    """Other pairs of the same kind, 6 of them: 3 eval batches of 2 pairs."""
    words = " ".join(SENTENCES).split()
    return datasets.Dataset.from_list([{"prompt": " ".join(words[i + 1:i + 4]), "chosen": " ".join(words[i + 4:i + 7]),
                                        "rejected": " ".join(words[-(i % 5) - 3:][:2])} for i in range(2, 32, 5)])


EVAL_FIGURES = ("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies",
                "eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected")


@pytest.mark.parametrize("eval_batch", [2, 3])
def test_evaluate_tracks_trl_dpo_trainer_before_and_after_training(tmp_path, tokenizer, eval_batch):
    """trl.DPOTrainer.evaluate (its reference model the starting weights) and StriderDPOTrainer.evaluate (the
    eval pairs' reference precomputed under them): before training, and after 4 steps, to 1e-5. An eval batch
    of 3 pairs, more than the engine's 2, runs in two engine batches, its figures the batch's means."""
    model = tiny_model(len(tokenizer))
    reference = copy.deepcopy(model)
    args = dict(per_device_eval_batch_size=eval_batch)
    theirs = trl.DPOTrainer(model=reference, ref_model=copy.deepcopy(model), args=dpo_args(tmp_path / "trl", **args),
                            train_dataset=preference_data(), eval_dataset=eval_data(), processing_class=tokenizer)
    ours = strider.StriderDPOTrainer(model=model, args=dpo_args(tmp_path / "strider", **args),
                                     train_dataset=preference_data(), eval_dataset=eval_data(),
                                     processing_class=tokenizer)
    for when in ("before", "after"):
        if when == "after":
            theirs.train()
            ours.train()
        want, got = theirs.evaluate(), ours.evaluate()
        # Before training every log-ratio is 0 up to rounding: accuracies would compare the rounding.
        for k in EVAL_FIGURES if when == "after" else set(EVAL_FIGURES) - {"eval_rewards/accuracies"}:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (when, k, got[k], want[k])


def test_a_resumed_run_evaluates_with_the_reference_its_checkpoint_keeps(tmp_path, tokenizer):
    def trainer(out, **over):
        return strider.StriderDPOTrainer(model=tiny_model(len(tokenizer)),
                                         args=dpo_args(out, per_device_eval_batch_size=2, **over),
                                         train_dataset=preference_data(), eval_dataset=eval_data(),
                                         processing_class=tokenizer)
    whole = trainer(tmp_path / "whole")
    whole.train()
    first = trainer(tmp_path / "run", max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    again = trainer(tmp_path / "run")
    again.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert again.evaluate() == whole.evaluate()  # the eval pairs' reference came from the checkpoint
    no_eval = strider.StriderDPOTrainer(model=tiny_model(len(tokenizer)),
                                        args=dpo_args(tmp_path / "plain", save_strategy="steps", save_steps=4),
                                        train_dataset=preference_data(), processing_class=tokenizer)
    no_eval.train()
    with pytest.raises(ValueError, match="no eval_dataset was given"):
        no_eval.evaluate()
    later = trainer(tmp_path / "plain")
    with pytest.raises(ValueError, match="holds no reference for this eval_dataset"):
        later.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-4"))


@pytest.mark.parametrize("over, match", [
    ({"loss_type": ["sigmoid", "sft"]}, "loss_type"),
    ({"loss_type": ["exo_pair"]}, "loss_type"),
    ({"f_divergence_type": "js_divergence"}, "f_divergence_type"),
    ({"use_weighting": True}, "use_weighting"),
    ({"ld_alpha": 0.5}, "ld_alpha"),
    ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps = 2 is not taken yet"),
])
def test_what_strider_does_not_do_is_refused_by_name(tmp_path, tokenizer, over, match):
    with pytest.raises(ValueError, match=match):
        strider.StriderDPOTrainer(model=tiny_model(len(tokenizer)), args=dpo_args(tmp_path, **over),
                                  train_dataset=preference_data(), processing_class=tokenizer)
