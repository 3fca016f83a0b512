"""Data sources: built-ins, local files and saved data sets through `datasets`, hub data sets (patched or
offline: never the network), chat messages through a chat template, deterministic sampling."""

import json
import re
import time

import pytest
import torch

from moec.calibrate import data
from moec.calibrate.data import is_eval_split, load_text, sample_windows
from moec.errors import UserError


def test_ptb_splits_are_the_mikolov_files():
    test = load_text("ptb", "test")
    assert test.startswith(" no it was n't black monday") and len(test) == 449945
    assert is_eval_split("ptb", "test") and not is_eval_split("ptb", "train")


def test_kjv_testaments():
    old, new = load_text("kjv", "train"), load_text("kjv", "test")
    assert old.startswith("In the beginning God created") and new.startswith("The book of the generation")


def test_unknown_split():
    with pytest.raises(UserError, match="has no split 'dev'"):
        load_text("ptb", "dev")


def test_local_text_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("first line\nsecond line\n")
    assert load_text(str(tmp_path / "a.txt"), "train") == "first line\nsecond line"
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ("x y", "z")))
    assert load_text(str(tmp_path / "b.jsonl"), "train") == "x y\nz"
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "no text column"}))
    with pytest.raises(UserError, match="no 'text' column"):
        load_text(str(tmp_path / "c.jsonl"), "train")


RAW_TEXTS = ["first line\r\nsecond\n\n  third  \n\nno newline\u2028x\rold mac\n", "a\n", "x\x0cy\n\n\nz"]


@pytest.mark.parametrize("raw", RAW_TEXTS)
def test_text_file_read_without_datasets_as_datasets_reads_it(tmp_path, raw):
    """A plain text file is read directly (the GPU image has no datasets), with datasets' own line splitting:
    the same text, so calibrations and perplexities do not move."""
    f = tmp_path / "t.txt"
    f.write_bytes(raw.encode())
    via_datasets = "\n".join(r for r in data.open_data(str(f), None)["text"] if r)
    assert load_text(str(f), None) == via_datasets


def test_text_file_not_utf8_is_a_user_error(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8 text"):
        load_text(str(f), None)


def test_sampling_is_deterministic_and_in_range():
    ids = torch.arange(10_000)
    a, b = sample_windows(ids, 5, 100, seed=3), sample_windows(ids, 5, 100, seed=3)
    assert torch.equal(a, b) and a.shape == (5, 100)
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(5, 99, dtype=torch.long))  # contiguous slices
    assert not torch.equal(a, sample_windows(ids, 5, 100, seed=4))
    with pytest.raises(UserError, match="fewer than --seq-len"):
        sample_windows(torch.arange(50), 1, 100, seed=0)


def test_saved_dataset_split_and_column(tmp_path):
    import datasets

    rows = {"body": ["alpha beta", None, "gamma"], "n": [1, 2, 3]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "validation": datasets.Dataset.from_dict({"body": ["delta"], "n": [4]})}
                         ).save_to_disk(str(tmp_path / "ds"))
    d = str(tmp_path / "ds")
    assert load_text(d, "train", column="body") == "alpha beta\ngamma"  # empty rows dropped
    assert load_text(d, "validation", column="body") == "delta"
    for kwargs, needle in [({}, "has no 'text' column (columns: body, n)"),
                           ({"column": "n"}, "neither text nor chat messages"),
                           ({"split": "test", "column": "body"}, "has no split 'test' (splits: train, validation)"),
                           ({"config": "x", "column": "body"}, "--data-config is for hub data sets")]:
        with pytest.raises(UserError, match=re.escape(needle)):
            load_text(d, **{"split": "train", **kwargs})


def test_hub_config_reaches_datasets(monkeypatch):
    """wikitext needs its config name; a patched loader stands in for the hub (tests never use the network)."""
    import datasets

    calls = []

    def fake(name, config=None, split=None):
        calls.append((name, config, split, datasets.config.HF_HUB_OFFLINE))
        return datasets.Dataset.from_dict({"text": [" = Valkyria = ", "", " the game "]})

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets, "load_dataset", fake)
    before = datasets.config.HF_HUB_OFFLINE
    assert load_text("wikitext", "train", "wikitext-2-raw-v1") == " = Valkyria = \n the game "
    assert calls == [("wikitext", "wikitext-2-raw-v1", "train", True)]  # offline while it ran
    assert datasets.config.HF_HUB_OFFLINE == before  # and restored after


def test_uncached_hub_data_fails_fast_offline(monkeypatch):
    """Offline (asked for, or the hub not answering), an uncached hub data set is one line, not ~30 s of retries."""
    import socket

    for var in data.OFFLINE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    with pytest.raises(UserError, match=r"hub data set 'moec-tests/uncached' \(config 'c1'\) is not in the local "
                                        r"cache and HF_HUB_OFFLINE is set"):
        load_text("moec-tests/uncached", "train", "c1")
    assert time.time() - t0 < 15, "offline mode must not retry the hub"
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def unreachable(*a, **k):
        raise OSError("no route")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    assert data.hub_offline_reason().startswith("the hub (") and "does not answer" in data.hub_offline_reason()


def test_messages_rendered_with_the_chat_template(tiny_moe_dir, tmp_path):
    import datasets
    import transformers

    conversations = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                     [{"role": "user", "content": "bye"}]]
    datasets.Dataset.from_dict({"messages": conversations}).to_parquet(str(tmp_path / "chat.parquet"))
    chat = str(tmp_path / "chat.parquet")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_moe_dir))
    with pytest.raises(UserError, match="the model's tokenizer has no chat template"):
        load_text(chat, "train", column="messages", tokenizer=tok)
    with pytest.raises(UserError, match="only moec calibrate renders them"):  # moec eval passes no tokenizer
        load_text(chat, "train", column="messages")
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    assert load_text(chat, "train", column="messages", tokenizer=tok) == \
        "<|user|> hi\n<|assistant|> hello\n\n<|user|> bye\n"
