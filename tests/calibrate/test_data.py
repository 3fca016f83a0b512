"""Data sources: built-ins, local files through `datasets`, deterministic sampling."""

import json

import pytest
import torch

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


def test_sampling_is_deterministic_and_in_range():
    ids = torch.arange(10_000)
    a, b = sample_windows(ids, 5, 100, seed=3), sample_windows(ids, 5, 100, seed=3)
    assert torch.equal(a, b) and a.shape == (5, 100)
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(5, 99, dtype=torch.long))  # contiguous slices
    assert not torch.equal(a, sample_windows(ids, 5, 100, seed=4))
    with pytest.raises(UserError, match="fewer than --seq-len"):
        sample_windows(torch.arange(50), 1, 100, seed=0)
