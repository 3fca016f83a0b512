"""`--data` as one source or a mix (moec/calibrate/dataspec.py): parsing, per-source sample counts, sampling,
and, through `calibrate` in-process on the tiny MoE, that data errors come before any weight is read."""

import json
import logging
import re
import shutil

import pytest
import torch

from moec.calibrate.data import load_text, sample_windows
from moec.calibrate.dataspec import DataSpec, check_data, describe, mix_counts, parse_data, sample_mix
from moec.calibrate.recipe import parse_recipe
from moec.calibrate.run import calibrate
from moec.errors import UserError
from moec.runtime.hf_layout import HFCheckpoint
from tests.cli.run import moec

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"


def test_parse_single_source_config_and_mix():
    assert parse_data("ptb", "train") == [DataSpec("ptb", "train")]
    wiki = DataSpec("wikitext", "train", "wikitext-2-raw-v1")
    assert parse_data("wikitext", "train", "wikitext-2-raw-v1") == [wiki]
    assert parse_data("wikitext@wikitext-2-raw-v1", "train") == [wiki]
    assert parse_data("Salesforce/wikitext@wikitext-2-raw-v1:validation", "train", column="body") == [
        DataSpec("Salesforce/wikitext", "validation", "wikitext-2-raw-v1", "body")]
    mix = parse_data("ptb:train:0.7, wikitext@wikitext-2-raw-v1:train:0.3", "valid")
    assert mix == [DataSpec("ptb", "train", fraction=0.7), DataSpec("wikitext", "train", "wikitext-2-raw-v1",
                                                                    fraction=0.3)]
    assert describe(mix) == ("ptb:train:0.7,wikitext@wikitext-2-raw-v1:train:0.3", "train")
    assert describe([wiki]) == ("wikitext@wikitext-2-raw-v1", "train")


@pytest.mark.parametrize("data,config,needle", [
    ("ptb:train:0.6,kjv:train:0.3", None, "fractions sum to 0.9, not 1"),
    ("ptb:train:0.5,kjv:train:0.5,ptb:valid:0.5", None, "fractions sum to 1.5, not 1"),
    ("ptb:train,kjv:train:1", None, "'ptb:train': expected NAME[@CONFIG]:SPLIT:FRACTION"),
    ("ptb:train:1.5", None, "fraction 1.5 is not in (0, 1]"),
    ("ptb:train:0,kjv:train:1", None, "fraction 0 is not in (0, 1]"),
    ("ptb:train:half", None, "fraction 'half' is not a number"),
    ("ptb:train:0.5,", None, "source '': expected"),
    ("w@:train", None, "expected one configuration after '@'"),
    ("w@a", "b", "--data-config says 'b'"),
    ("a:train:0.5,b:train:0.5", "c", "--data-config names one data set's configuration"),
])
def test_bad_data_syntax(data, config, needle):
    with pytest.raises(UserError, match=re.escape(needle)):
        parse_data(data, "train", config)


def test_mix_counts_sum_to_samples():
    def counts(fractions, samples):
        return mix_counts([DataSpec(f"s{i}", "train", fraction=f) for i, f in enumerate(fractions)], samples)

    assert counts([1.0], 32) == [32]
    assert counts([0.7, 0.3], 10) == [7, 3]
    assert counts([0.29, 0.71], 100) == [29, 71]  # 100 × 0.29 is 28.999999999999996 in floating point
    assert counts([1 / 3] * 3, 32) == [11, 11, 10]  # largest remainder, ties to the earlier source
    assert counts([0.5, 0.5], 5) == [3, 2]
    with pytest.raises(UserError, match=re.escape("--samples 4 leaves no sample for s1 (fraction 0.1)")):
        counts([0.9, 0.1], 4)


def test_sample_mix_in_proportion_and_deterministic():
    a, b = torch.arange(10_000), torch.arange(50_000, 60_000)  # tell the sources apart by value
    specs = parse_data("a.txt:train:0.7,b.txt:train:0.3:text", "train", column="text")
    w, records = sample_mix([a, b], specs, 10, 16, seed=5)
    assert w.shape == (10, 16) and int((w[:, 0] < 10_000).sum()) == 7
    assert not torch.equal(w[:7, 0] < 10_000, torch.ones(7, dtype=torch.bool))  # shuffled, not 7 then 3
    assert torch.equal(w, sample_mix([a, b], specs, 10, 16, seed=5)[0])
    assert [(r["name"], r["split"], r["column"], r["fraction"], r["samples"], r["tokens"], r["text_tokens"])
            for r in records] == [("a.txt", "train", "text", 0.7, 7, 112, 10_000),
                                  ("b.txt", "train", "text", 0.3, 3, 48, 10_000)]
    one, rec = sample_mix([a], [DataSpec("ptb", "train")], 6, 16, seed=5)
    assert torch.equal(one, sample_windows(a, 6, 16, seed=5))  # one source samples as before mixes existed
    assert rec[0]["column"] is None  # built-ins have no columns
    with pytest.raises(UserError, match="b.txt \\(train\\) has 8 tokens, fewer than --seq-len 16"):
        sample_mix([a, torch.arange(8)], specs, 10, 16, seed=5)


@pytest.fixture(scope="module")
def chat_model(tiny_moe_dir, tmp_path_factory):
    """The tiny MoE with a chat template, and a chat data set of 40 conversations in jsonl."""
    import transformers

    d = tmp_path_factory.mktemp("chat")
    shutil.copytree(tiny_moe_dir, d / "model")
    tok = transformers.AutoTokenizer.from_pretrained(str(d / "model"))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(d / "model"))
    rows = [{"messages": [{"role": "user", "content": f"what is {i} plus {i}"},
                          {"role": "assistant", "content": f"it is {2 * i}, as the market closed"}]} for i in range(40)]
    (d / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return d / "model", d / "chat.jsonl"


FP16 = parse_recipe({"name": "fp16"})


def test_mix_with_chat_messages_records_every_source(chat_model, tmp_path):
    """A chat + plain-text mix (issue 34: one --text-column for every source made it impossible): the chat
    source's `messages` column found by itself, the notes' column named in the source (NAME:SPLIT:FRACTION:COLUMN),
    and each recorded."""
    model, chat = chat_model
    notes = tmp_path / "notes.jsonl"
    notes.write_text("\n".join(json.dumps({"body": f"note {i}: the market closed higher on light volume"})
                               for i in range(40)))
    mix = f"ptb:valid:0.5,{chat}:train:0.25,{notes}:train:0.25:body"
    report = calibrate(model, "m", FP16, mix, "train", 4, 32, 0, tmp_path / "calib")
    assert report["split"] == "valid+train"
    assert [(s["name"], s["split"], s["config"], s["column"], s["fraction"], s["samples"], s["tokens"])
            for s in report["sources"]] == [("ptb", "valid", None, None, 0.5, 2, 64),
                                            (str(chat), "train", None, "messages", 0.25, 1, 32),
                                            (str(notes), "train", None, "body", 0.25, 1, 32)]
    assert report["tokens"] == 128 and report["text_tokens"] == sum(s["text_tokens"] for s in report["sources"])
    assert json.loads((tmp_path / "calib" / "report.json").read_text())["sources"] == report["sources"]


def test_data_errors_come_before_any_weight_is_read(chat_model, tiny_moe_dir, tmp_path, monkeypatch):
    def no_weights(self, name):
        raise AssertionError(f"weight {name} read before the data was checked")

    monkeypatch.setattr(HFCheckpoint, "get", no_weights)
    _, chat = chat_model
    with pytest.raises(UserError, match="the model's tokenizer has no chat template"):
        calibrate(tiny_moe_dir, "m", FP16, str(chat), "train", 2, 32, 0, tmp_path / "calib", text_column="messages")
    with pytest.raises(UserError, match=re.escape("has no 'body' column (columns: messages)")):
        calibrate(tiny_moe_dir, "m", FP16, str(chat), "train", 2, 32, 0, tmp_path / "calib", text_column="body")
    with pytest.raises(UserError, match="fractions sum to 0.9"):
        calibrate(tiny_moe_dir, "m", FP16, "ptb:train:0.6,kjv:train:0.3", "train", 2, 32, 0, tmp_path / "calib")
    assert not (tmp_path / "calib").exists()


def test_cli_checks_data_before_resolving_the_model(tmp_path, monkeypatch):
    """`moec calibrate` checks --data before resolve_model, which downloads a hub model or converts a GGUF."""
    from moec.cli import calibrate_cmd

    def no_model(spec):
        raise AssertionError("the model was resolved before the data was checked")

    monkeypatch.setattr(calibrate_cmd, "resolve_model", no_model)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    for data, needle in [("ptb:train:0.6,kjv:train:0.3", "fractions sum to 0.9, not 1"),
                         ("ptb:test:0.5,kjv:train:0.5", "--split test is the evaluation split of 'ptb'"),
                         (str(tmp_path / "chat.jsonl"), "has no 'text' column (columns: messages)"),
                         (str(tmp_path / "none.jsonl"), "none.jsonl does not exist")]:
        with pytest.raises(UserError, match=re.escape(needle)):
            calibrate_cmd.calibrate(model="m", recipe="fp16", scheme=None, data=data, split="train",
                                    data_config=None, text_column="text", samples=4, seq_len=32,
                                    out=tmp_path / "calib", seed=None, device="cpu", resume=False, gpus=None,
                                    offload_activations=False, propagate="fp")


# --- data honesty (issue 34, item 6) ---

def test_oversampled_text_warns_with_the_reuse_factor(caplog):
    """64 × 512 windows from a 1,504-token text: a warning naming the 21.8x reuse (before: report.json only)."""
    caplog.set_level(logging.WARNING, logger="moec.calibrate.dataspec")
    sample_mix([torch.arange(1504)], [DataSpec("small.txt", "train", column="text")], 64, 512, seed=0)
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "small.txt (train) holds 1504 tokens" in msg and "64 × 512 = 32768" in msg and "21.8x reuse" in msg, msg
    caplog.clear()
    specs = parse_data("a.txt:train:0.5,b.txt:train:0.5", "train")
    sample_mix([torch.arange(10_000), torch.arange(100)], specs, 4, 64, seed=0)  # b: 2 × 64 from 100 tokens
    assert [m for r in caplog.records if "1.3x reuse" in (m := r.getMessage())] and len(caplog.records) == 1
    caplog.clear()
    sample_mix([torch.arange(10_000)], [DataSpec("ptb", "train")], 4, 64, seed=0)  # 256 of 10,000: silent
    assert not caplog.records


def test_a_local_file_has_no_splits(tmp_path):
    """--split valid on a file was accepted and recorded; datasets reads a file as its one split, train."""
    txt = tmp_path / "notes.txt"
    txt.write_text("the market closed higher\n" * 20)
    for split in ("valid", "test"):
        with pytest.raises(UserError, match=re.escape(f"--split {split}: {txt} is a single file, which has no "
                                                      "splits")) as e:
            check_data(parse_data(str(txt), split), 2)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="--split valid: .* is a single file"):  # in a mix too
        check_data(parse_data(f"ptb:train:0.5,{txt}:valid:0.5", "train"), 2)
    assert check_data(parse_data(str(txt), "train"), 2)[0].column == "text"


def test_per_source_columns_and_messages_detected(tiny_moe_dir, tmp_path):
    import transformers

    chat, body = tmp_path / "chat.jsonl", tmp_path / "body.jsonl"
    chat.write_text(json.dumps({"id": 1, "messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "hello"}]}))
    body.write_text(json.dumps({"id": 1, "body": "a plain note"}))
    specs = parse_data(f"{chat}:train:0.5,{body}:train:0.5:body", "train")
    assert [s.column for s in specs] == [None, "body"]
    assert [s.column for s in check_data(specs, 2)] == ["messages", "body"]  # messages found, not named
    with pytest.raises(UserError, match=r"has neither a 'text' column nor a 'messages' column .*\(columns: id, "
                                        r"body\)"):
        check_data(parse_data(str(body), "train"), 2)
    with pytest.raises(UserError, match="the column after the fraction is empty"):
        parse_data(f"{chat}:train:0.5:,{body}:train:0.5", "train")
    with pytest.raises(UserError, match=re.escape("expected NAME[@CONFIG]:SPLIT:FRACTION[:COLUMN]")):
        parse_data(f"{chat}:train:0.5:messages:x,{body}:train:0.5", "train")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_moe_dir))
    tok.chat_template = TEMPLATE
    assert load_text(str(chat), "train", column=None, tokenizer=tok) == "<|user|> hi\n<|assistant|> hello\n"


def test_the_header_prints_the_mix_as_written(monkeypatch, tmp_path):
    """`:train:` is rich's emoji code for a train: the header printed 🚋 for ptb:train:0.5 (and would read a
    file name's [brackets] as markup)."""
    from moec.cli import calibrate_cmd

    monkeypatch.setattr(calibrate_cmd, "run_calibrate", lambda *a, **k: None)  # the header only, no run
    mix = "ptb:train:0.5,kjv:train:0.5"
    r = moec("calibrate", "demo-moe", "--recipe", "fp16", "--data", mix, "--samples", "2", "--seq-len", "32",
             "-o", tmp_path / "c")
    assert r.returncode == 0, r.stderr
    assert f"on {mix}: 2 × 32 tokens" in r.stderr and "\N{TRAM CAR}" not in r.stderr, r.stderr
