"""strider.data: text and chat data -> token files the C++ side reads (io/token_data.h).

A tiny word-level tokenizer is trained here on a few sentences (nothing is
downloaded), saved like any Hugging Face tokenizer, and loaded back with
AutoTokenizer. The files `python -m strider.data` writes are read by st_tool
(the C++ TokenFile and TokenLoader) and must give the ids the tokenizer gives,
document starts where documents start, and for chat data a loss mask that
is 1 exactly on the assistant's turns.
"""
import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
from conftest import REPO_ROOT  # noqa: E402
from strider import data as sd  # noqa: E402  (conftest.py puts python_shim/ on sys.path)

SPECIAL = ["<unk>", "<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "hello how are you", "i am fine thank you",
             "what is the answer", "the answer is four", "be brief please", "sure"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def make_tiny_tokenizer(directory):
    """A word-level tokenizer with BOS/EOS and a chat template, saved to `directory`; returns the dir."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=SPECIAL))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def st_json(st_tool, *args):
    out = subprocess.run([str(st_tool), *map(str, args)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_text_lines_through_the_command_line(tmp_path, tokenizer_dir, tokenizer, strider_binary):
    docs = ["the cat sat on the mat", "", "hello how are you", "the answer is four"]
    (tmp_path / "corpus.txt").write_text("\n".join(docs) + "\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-m", "strider.data", "--tokenizer", tokenizer_dir, "--input",
                          tmp_path / "corpus.txt", "--output", tmp_path / "corpus.tokens"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tokenizing corpus.txt" in out.stderr  # the progress bar
    summary = json.loads(out.stdout.splitlines()[-1])

    encoded = [tokenizer(d)["input_ids"] + [tokenizer.eos_token_id] for d in docs if d]
    want = [t for d in encoded for t in d]
    starts = np.cumsum([0] + [len(d) for d in encoded[:-1]])
    assert encoded[0][0] == tokenizer.bos_token_id
    assert summary["tokens"] == len(want) and summary["documents"] == 3

    st_tool = strider_binary("st_tool")
    info = st_json(st_tool, "tok-info", tmp_path / "corpus.tokens")[0]
    assert info == dict(token_bytes=2, num_tokens=len(want), flags=2, num_docs=3, vocab_size=len(tokenizer))
    f = sd.read_token_file(tmp_path / "corpus.tokens")
    assert f["ids"].tolist() == want and f["doc_starts"].tolist() == starts.tolist() and f["mask"] is None

    # The C++ loader: window 0, in file order; no label predicts a document's first token.
    seq = len(want) - 1
    b = st_json(st_tool, "tok-batches", tmp_path / "corpus.tokens", "--batch", 1, "--seq", seq, "--no-shuffle")[0]
    assert b["inputs"] == want[:seq]
    assert b["labels"] == [-100 if t + 1 in set(starts.tolist()) else want[t + 1] for t in range(seq)]


def test_chat_loss_mask_is_the_assistant_turns(tmp_path, tokenizer, strider_binary):
    chats = [
        {"messages": [{"role": "system", "content": "be brief please"},
                      {"role": "user", "content": "what is the answer"},
                      {"role": "assistant", "content": "the answer is four"}]},
        {"messages": [{"role": "user", "content": "hello how are you"},
                      {"role": "assistant", "content": "i am fine thank you"},
                      {"role": "user", "content": "what is the answer"},
                      {"role": "assistant", "content": "sure"}]},
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    summary = sd.prepare(tokenizer, tmp_path / "chat.jsonl", tmp_path / "chat.tokens", progress=False)
    assert summary["format"] == "chat" and summary["documents"] == 2

    f = sd.read_token_file(tmp_path / "chat.tokens")
    words = tokenizer.convert_ids_to_tokens(f["ids"].tolist())
    targets = [w for w, m in zip(words, f["mask"]) if m]
    # Exactly the assistant's words and its end-of-turn tokens; never the "<|assistant|>" prompt.
    assert targets == "the answer is four <|end|> i am fine thank you <|end|> sure <|end|>".split()
    assert f["doc_starts"].tolist() == [0, words.index("<|user|>", 2 + words.index("four"))]

    st_tool = strider_binary("st_tool")
    assert st_json(st_tool, "tok-info", tmp_path / "chat.tokens")[0]["flags"] == 3
    n = len(words)
    b = st_json(st_tool, "tok-batches", tmp_path / "chat.tokens", "--batch", 1, "--seq", n - 1, "--no-shuffle")[0]
    counted = [words[t + 1] for t in range(n - 1) if b["labels"][t] != -100]
    assert counted == targets


def test_example_mode_gives_each_document_a_window_of_its_own(tmp_path, tokenizer, tokenizer_dir, strider_binary):
    docs = ["the cat sat on the mat", "sure", "hello how are you", "be brief please"]
    (tmp_path / "corpus.txt").write_text("\n".join(docs) + "\n")
    encoded = [tokenizer(d)["input_ids"] + [tokenizer.eos_token_id] for d in docs]
    lengths = [len(e) for e in encoded]  # 8, 3, 6, 5 (BOS, the words, EOS)
    seq = 6
    summary = sd.prepare(tokenizer, tmp_path / "corpus.txt", tmp_path / "ex.tokens", mode="example", seq=seq,
                         progress=False)
    # The report: lengths, what was cut, how much is padding, what counts.
    # One padding token past the last window: the C++ loader reads seq + 1 tokens a window.
    assert summary["mode"] == "example" and summary["windows"] == 4 and summary["tokens"] == 4 * seq + 1
    assert (summary["length_min"], summary["length_median"], summary["length_max"]) == (3, 5.5, 8)
    assert summary["cut"] == 1 and summary["tokens_cut"] == 2
    assert summary["padding_fraction"] == pytest.approx((3 + 1) / 24)
    assert summary["target_fraction"] == pytest.approx(sum(min(n, seq) for n in lengths) / 24)
    data = sd.TokenDataset(tmp_path / "ex.tokens", seq)
    pad = tokenizer.pad_token_id
    for k, e in enumerate(encoded):
        row = data[k]
        kept = e[:seq]
        assert row["input_ids"].tolist() == kept + [pad] * (seq - len(kept))
        # Its first token starts a document; its padding is no target, and no input (attention mask 0).
        assert row["labels"].tolist() == [-100] + kept[1:] + [-100] * (seq - len(kept))
        assert row["attention_mask"].tolist() == [1] * len(kept) + [0] * (seq - len(kept))
    # The C++ loader reads the same windows.
    st_tool = strider_binary("st_tool")
    b = st_json(st_tool, "tok-batches", tmp_path / "ex.tokens", "--batch", 4, "--seq", seq, "--no-shuffle")[0]
    assert b["inputs"] == [t for k in range(4) for t in data[k]["input_ids"].tolist()]
    # Its labels are shifted (the next token's), so a window's last one is the next document's start: none.
    assert b["labels"] == [t for k in range(4) for t in data[k]["labels"].tolist()[1:] + [-100]]
    assert b["attention"] == [t for k in range(4) for t in data[k]["attention_mask"].tolist()] and b["padded"]
    # The file records the seq it was cut for: at another, its examples would split or share windows, so
    # every reader refuses it before the first batch, naming the file and both seqs.
    assert sd.read_token_file(tmp_path / "ex.tokens")["example_seq"] == seq
    for other, how in ((5, "split across"), (12, "share")):
        bad = subprocess.run([str(st_tool), "tok-batches", str(tmp_path / "ex.tokens"), "--batch", "1", "--seq",
                              str(other), "--no-shuffle", "--steps", "1"], capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and "ex.tokens" in bad.stderr, bad.stderr
        assert f"--mode example --seq {seq}`" in bad.stderr and f"read at seq {other}" in bad.stderr
        assert how in bad.stderr
        with pytest.raises(ValueError, match=f"--mode example --seq {seq} .* read at seq {other}: its examples "
                                             f"would {how} windows"):
            sd.TokenDataset(tmp_path / "ex.tokens", other)
    # The training command refuses it before any step, and says what to do.
    run = subprocess.run([str(strider_binary("strider")), "finetune", "--data", str(tmp_path / "ex.tokens"), "--seq",
                          "5", "--device", "cpu", "--steps", "1", "--eval-batches", "0", "--work-dir",
                          str(tmp_path / "w"), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0 and "train at --seq 6, or remake the file with --seq 5" in run.stderr, run.stderr
    assert "loaded" not in run.stderr and not any((tmp_path / "out").glob("*"))  # refused as the file opened
    # The command line takes --mode and --seq, and example mode needs --seq.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    base = [sys.executable, "-m", "strider.data", "--tokenizer", tokenizer_dir, "--input", tmp_path / "corpus.txt",
            "--output", tmp_path / "cli.tokens", "--quiet", "--mode", "example"]
    out = subprocess.run(base + ["--seq", "6"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["cut"] == 1
    out = subprocess.run(base, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and "give seq (--seq)" in out.stderr


def test_packed_mode_reports_documents_split_across_windows(tmp_path, tokenizer, strider_binary):
    docs = ["the cat sat on the mat", "sure", "hello how are you", "be brief please"]
    (tmp_path / "corpus.txt").write_text("\n".join(docs) + "\n")
    summary = sd.prepare(tokenizer, tmp_path / "corpus.txt", tmp_path / "p.tokens", seq=6, progress=False)
    # Lengths 8, 3, 6, 5 back to back: tokens 0-7, 8-10, 11-16, 17-21; windows of 6 start at 0, 6, 12, 18.
    # Split: the first (0-7), the third (11-16) and the fourth (17-21); the second (8-10) stays in window 1.
    assert summary["mode"] == "packed" and summary["tokens"] == 22 and summary["windows"] == 3
    assert summary["split"] == 3 and summary["tokens_unused"] == 4
    assert "target_fraction" not in summary  # plain text: every token counts, no mask written
    # Each document's positions count from its start (or from the window's, for one that runs in), in
    # TokenDataset's windows and the C++ loader's alike: what keeps documents apart in attention.
    data = sd.TokenDataset(tmp_path / "p.tokens", 6)
    assert [data[k]["position_ids"].tolist() for k in range(3)] == [[0, 1, 2, 3, 4, 5], [0, 1, 0, 1, 2, 0],
                                                                     [0, 1, 2, 3, 4, 0]]
    assert data.packs_documents
    b = st_json(strider_binary("st_tool"), "tok-batches", tmp_path / "p.tokens", "--batch", 3, "--seq", 6,
                "--no-shuffle")[0]
    assert b["positions"] == [p for k in range(3) for p in data[k]["position_ids"].tolist()]
    with pytest.raises(ValueError, match="mode 'sliced' is not packed or example"):
        sd.prepare(tokenizer, tmp_path / "corpus.txt", tmp_path / "x.tokens", mode="sliced", progress=False)


def test_big_vocabularies_get_uint32_ids(tmp_path, strider_binary):
    ids = np.array([5, 70000, 65535, 1], np.int64)
    sd.write_token_file(tmp_path / "big.tokens", ids, doc_starts=[0, 2], vocab_size=70001)
    sd.write_token_file(tmp_path / "small.tokens", ids % 65536, vocab_size=65536)
    st_tool = strider_binary("st_tool")
    assert st_json(st_tool, "tok-info", tmp_path / "big.tokens")[0]["token_bytes"] == 4
    assert st_json(st_tool, "tok-info", tmp_path / "small.tokens")[0]["token_bytes"] == 2
    assert sd.read_token_file(tmp_path / "big.tokens")["ids"].tolist() == ids.tolist()
    with pytest.raises(ValueError, match="not below vocab_size 70000"):
        sd.write_token_file(tmp_path / "bad.tokens", ids, vocab_size=70000)
    assert not (tmp_path / "bad.tokens").exists()


def test_token_batches_follow_transformers_conventions(tmp_path):
    ids = np.arange(10, 30)
    mask = np.ones(20, np.uint8)
    mask[3:5] = 0
    sd.write_token_file(tmp_path / "t.tokens", ids, mask=mask, doc_starts=[0, 6], vocab_size=64)
    batches = sd.TokenBatches(tmp_path / "t.tokens", batch=2, seq=8, shuffle=False)
    x, y = next(iter(batches))
    assert x.tolist() == [list(range(10, 18)), list(range(18, 26))]
    # Unshifted labels: -100 on masked tokens (3, 4) and on the first token of each document (0, 6).
    assert y[0].tolist() == [-100, 11, 12, -100, -100, 15, -100, 17]
    assert y[1].tolist() == x[1].tolist()
    shuffled = sd.TokenBatches(tmp_path / "t.tokens", batch=1, seq=8, seed=3)
    assert sorted(int(b[0][0, 0]) for b, _ in zip(shuffled, range(2))) == [10, 18]  # each window once an epoch


def test_token_batches_yield_a_padded_files_attention_mask(tmp_path):
    # Two windows of 8 (--mode example): 5 and 3 tokens, then padding (mask byte 2).
    ids = np.arange(10, 26)
    mask = np.ones(16, np.uint8)
    mask[5:8] = sd.PADDING
    mask[11:16] = sd.PADDING
    sd.write_token_file(tmp_path / "p.tokens", ids, mask=mask, doc_starts=[0, 8], vocab_size=64)
    x, y, p, a = next(iter(sd.TokenBatches(tmp_path / "p.tokens", batch=2, seq=8, shuffle=False, positions=True,
                                           attention=True)))
    assert a.dtype == x.dtype and a.tolist() == [[1] * 5 + [0] * 3, [1] * 3 + [0] * 5]
    assert y[0].tolist() == [-100, 11, 12, 13, 14, -100, -100, -100]  # no target on padding
    assert p[1].tolist() == list(range(8))
    data = sd.TokenDataset(tmp_path / "p.tokens", seq=8)
    assert [data[w]["attention_mask"].tolist() for w in range(2)] == a.tolist()
    # Shuffled, the mask follows its window.
    shuffled = sd.TokenBatches(tmp_path / "p.tokens", batch=1, seq=8, seed=5, attention=True)
    for (xs, _, masks), _ in zip(shuffled, range(4)):
        assert masks[0].tolist() == (a[0] if int(xs[0, 0]) == 10 else a[1]).tolist()
    # Left out, it is said: the load-balancing loss would count the padding.
    with pytest.warns(UserWarning, match="p.tokens has padding .* attention=True"):
        assert len(next(iter(sd.TokenBatches(tmp_path / "p.tokens", batch=2, seq=8)))) == 2
    # A file without padding: a mask of ones.
    sd.write_token_file(tmp_path / "t.tokens", ids, vocab_size=64)
    _, _, ones = next(iter(sd.TokenBatches(tmp_path / "t.tokens", batch=2, seq=8, shuffle=False, attention=True)))
    assert ones.tolist() == [[1] * 8] * 2


def test_token_dataset_is_a_map_style_dataset_of_windows(tmp_path):
    ids = np.arange(10, 30)
    mask = np.ones(20, np.uint8)
    mask[3:5] = 0
    sd.write_token_file(tmp_path / "t.tokens", ids, mask=mask, doc_starts=[0, 6], vocab_size=64)
    data = sd.TokenDataset(tmp_path / "t.tokens", seq=8)
    assert len(data) == 2  # 20 tokens: two whole windows of 8, the last 4 unused
    assert data[0]["input_ids"].tolist() == list(range(10, 18))
    assert data[0]["labels"].tolist() == [-100, 11, 12, -100, -100, 15, -100, 17]
    assert data[-1]["input_ids"].tolist() == list(range(18, 26))
    with pytest.raises(IndexError, match="window 2 of 2"):
        data[2]
    # What transformers.Trainer's default collator makes of it: a batch of both windows.
    import torch
    batch = {k: torch.stack([data[i][k] for i in range(len(data))]) for k in ("input_ids", "labels")}
    x, y = next(iter(sd.TokenBatches(tmp_path / "t.tokens", batch=2, seq=8, shuffle=False)))
    assert torch.equal(batch["input_ids"], x) and torch.equal(batch["labels"], y)
    with pytest.raises(ValueError, match="fewer than one sequence of 32"):
        sd.TokenDataset(tmp_path / "t.tokens", seq=32)


def test_bad_input_is_named(tmp_path, tokenizer):
    good = '{"messages": [{"role": "user", "content": "hello"}]}\n'
    for text, match in [(good + '{"messages": [\n', "bad.jsonl:2: not valid JSON"),
                        (good + '{"messages": []}\n', "bad.jsonl:2: expected .* at least one message")]:
        (tmp_path / "bad.jsonl").write_text(text)
        with pytest.raises(ValueError, match=match):
            sd.prepare(tokenizer, tmp_path / "bad.jsonl", tmp_path / "bad.tokens", progress=False)
    assert not (tmp_path / "bad.tokens").exists()
    (tmp_path / "f.tokens").write_bytes(b"x" * 2000)
    with pytest.raises(ValueError, match="not a strider token file"):
        sd.read_token_file(tmp_path / "f.tokens")


def test_invalid_utf8_is_named_by_file_and_line(tmp_path, tokenizer):
    (tmp_path / "bad.txt").write_bytes(b"hello there\nthe answer \xff is four\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: not UTF-8 \(byte 11 of the line is 0xff\)"):
        sd.prepare(tokenizer, tmp_path / "bad.txt", tmp_path / "bad.tokens", progress=False)
    with pytest.raises(ValueError, match=r"bad.txt: not UTF-8 \(byte 23 of the file is 0xff\)"):
        sd.prepare(tokenizer, tmp_path / "bad.txt", tmp_path / "bad.tokens", fmt="text", progress=False)
    assert not (tmp_path / "bad.tokens").exists()


def test_chats_without_an_assistant_turn_warn_that_nothing_trains(tmp_path, tokenizer):
    chats = [{"messages": [{"role": "user", "content": "hello how are you"}]},
             {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the answer"}]}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    with pytest.warns(UserWarning, match="no assistant turn in any conversation"):
        summary = sd.prepare(tokenizer, tmp_path / "chat.jsonl", tmp_path / "chat.tokens", progress=False)
    assert summary["target_fraction"] == 0 and summary["warning"] == "no target tokens"


CHATS = [{"messages": [{"role": "system", "content": "be brief please"},
                       {"role": "user", "content": "what is the answer"},
                       {"role": "assistant", "content": "the answer is four"},
                       {"role": "user", "content": "hello how are you"},
                       {"role": "assistant", "content": "i am fine thank you"}]}]


def test_a_tokenizer_without_a_chat_template_is_named_and_given_one(tmp_path, tokenizer_dir):
    """A base model's tokenizer has no chat template (issue 67: transformers' raw error): the error names
    --chat-template, which gives one, built in or from a file."""
    bare = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    bare.chat_template = None
    bare.save_pretrained(tmp_path / "bare")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    cmd = [sys.executable, "-m", "strider.data", "--tokenizer", str(tmp_path / "bare"), "--input",
           str(tmp_path / "chat.jsonl"), "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "python_shim")}
    r = subprocess.run([*cmd, "--output", str(tmp_path / "no.tokens")], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "has no chat template" in r.stderr and "--chat-template NAME (chatml" in r.stderr
    (tmp_path / "mine.jinja").write_text(CHAT_TEMPLATE)
    for given, name in (("chatml", "chatml"), (str(tmp_path / "mine.jinja"), "file")):
        out = tmp_path / f"{name}.tokens"
        r = subprocess.run([*cmd, "--output", str(out), "--chat-template", given], capture_output=True, text=True,
                           env=env)
        assert r.returncode == 0, r.stderr
        f = sd.read_token_file(out)
        bare.chat_template = sd.chat_template(given)
        want_ids, want_mask = sd.encode_chat(bare, CHATS[0]["messages"])
        assert f["ids"].tolist()[:len(want_ids)] == want_ids and f["mask"].tolist()[:len(want_mask)] == want_mask
        text = bare.decode([i for i, m in zip(want_ids, want_mask) if m])
        assert "four" in text and "thank" in text and "what" not in text and "brief" not in text


@pytest.mark.parametrize("name", ["chatml", "qwen", "llama3", "gemma", "mistral"])
def test_each_built_in_template_masks_the_assistant_turns(tokenizer, name):
    """Each built-in renders a conversation's prefix as a prefix of the whole (encode_chat needs it) and makes
    each assistant turn's words targets, never the user's or the system's."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = sd.chat_template(name)
    ids, mask = sd.encode_chat(tok, CHATS[0]["messages"])
    targets = tok.convert_ids_to_tokens([i for i, m in zip(ids, mask) if m])
    words = [t for t in targets if t in "the answer is four i am fine thank you".split()]
    assert words == "the answer is four i am fine thank you".split(), (name, targets)
    assert not {"what", "hello", "brief"} & set(targets)
