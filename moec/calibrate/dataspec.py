"""`moec calibrate --data`: one source or a mix, parsed and checked before the model loads.

    --data NAME [--split S] [--data-config C] [--text-column COL]
    --data NAME[@CONFIG]:SPLIT:FRACTION[:COLUMN],NAME[@CONFIG]:SPLIT:FRACTION[:COLUMN],...

NAME is a built-in (`ptb`, `kjv`), a local file or saved data set, or a hub data set (data.py). A
hub configuration rides on `@` (`wikitext@wikitext-2-raw-v1`): hub names already hold `/`, and `:`
and `,` separate fields and sources. A source's COLUMN is read from it (a chat + plain-text mix:
`chat.jsonl:train:0.5:messages,notes.txt:train:0.5`); `--text-column` is the column of every source that
names none; with neither, a source is read from its `text` column, else from a `messages` column of
chat messages (data.py pick_column). A single local file has no splits (datasets reads it as `train`):
any other split named for it is refused. A mix samples each source's windows in proportion to its
fraction (`mix_counts`) and records every source in report.json (`sample_mix`), with a warning when a
source is drawn more tokens than it holds (the reuse factor).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..errors import UserError
from .data import BUILTIN_DATA, check_builtin, is_eval_split, open_data, pick_column, require_package, sample_windows

SYNTAX = "NAME[@CONFIG]:SPLIT:FRACTION[:COLUMN],..."
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataSpec:
    name: str  # built-in name, local path or hub data set
    split: str
    config: str | None = None  # hub configuration (`wikitext-2-raw-v1`)
    column: str | None = None  # ignored by built-ins, which have no columns; None: `text`, else chat `messages`
    fraction: float = 1.0  # share of --samples, in (0, 1]

    @property
    def label(self) -> str:
        return self.name + (f"@{self.config}" if self.config else "")

    def __str__(self) -> str:
        return f"{self.label}:{self.split}:{self.fraction:g}"


def parse_data(data: str, split: str, config: str | None = None, column: str | None = None) -> list[DataSpec]:
    """The sources `--data` names; `split`, `config` and `column` are the defaults of a source that names none."""
    if column == "":
        raise UserError("--text-column is empty")
    items = [data] if Path(data).exists() else data.split(",")  # an existing path is taken whole
    specs = [_parse_item(item.strip(), split, config, column, many=len(items) > 1) for item in items]
    if config is not None and len(specs) > 1:
        raise UserError(f"--data-config names one data set's configuration; in a mix write NAME@CONFIG per "
                        f"source ({SYNTAX})")
    total = sum(s.fraction for s in specs)
    if abs(total - 1.0) > 1e-6:
        raise UserError(f"--data fractions sum to {total:g}, not 1: {data!r}")
    return specs


def _parse_item(item: str, split: str, config: str | None, column: str | None, many: bool) -> DataSpec:
    name, fields = (item, []) if Path(item).exists() else (item.split(":")[0], item.split(":")[1:])
    if not name or len(fields) > 3 or many and len(fields) < 2:
        raise UserError(f"--data source {item!r}: expected "
                        + (SYNTAX if many else "NAME[@CONFIG][:SPLIT[:FRACTION[:COLUMN]]]"))
    if len(fields) == 3:
        if not fields[2]:
            raise UserError(f"--data source {item!r}: the column after the fraction is empty")
        column = fields[2]
    if "@" in name and not Path(name).exists():
        name, own = name.rsplit("@", 1)
        if not name or not own or config is not None and own != config:
            raise UserError(f"--data source {item!r}: expected one configuration after '@'"
                            + (f" (--data-config says {config!r})" if config is not None else ""))
        config = own
    fraction = 1.0
    if len(fields) >= 2:
        try:
            fraction = float(fields[1])
        except ValueError:
            raise UserError(f"--data source {item!r}: fraction {fields[1]!r} is not a number") from None
        if not 0.0 < fraction <= 1.0:
            raise UserError(f"--data source {item!r}: fraction {fraction:g} is not in (0, 1]")
    return DataSpec(name, fields[0] if fields and fields[0] else split, config, column, fraction)


def check_specs(specs: list[DataSpec], samples: int) -> list[int]:
    """The checks that read nothing: splits meant for evaluation, built-ins, per-source sample counts."""
    for s in specs:
        if is_eval_split(s.name, s.split):
            raise UserError(f"--split {s.split} is the evaluation split of {s.name!r}; calibrate on another split")
        if s.name in BUILTIN_DATA:
            check_builtin(s.name, s.split, s.config)
    return mix_counts(specs, samples)


def check_data(specs: list[DataSpec], samples: int) -> list[DataSpec]:
    """Every source exists and has its split and column: run before the model is resolved or loaded
    (a hub model is downloaded there). Whether a chat column has a template to render it is checked
    when the tokenizer loads (run.py), still before any weight is read. The specs, each column resolved."""
    check_specs(specs, samples)
    for s in specs:
        if s.name in BUILTIN_DATA:
            require_package(s.name)
    return resolve_columns(specs)


def resolve_columns(specs: list[DataSpec]) -> list[DataSpec]:
    """The specs with the column each source is read from (data.py pick_column: the one named, else `text`,
    else a chat `messages` column), so that report.json records what was read; built-ins have none."""
    return [s if s.name in BUILTIN_DATA else replace(s, column=pick_column(open_data(s.name, s.split, s.config),
                                                                          s.name, s.column))
            for s in specs]


def mix_counts(specs: list[DataSpec], samples: int) -> list[int]:
    """samples × fraction per source, rounded by largest remainder (ties: earlier source) to sum to samples."""
    if samples < 1:
        raise UserError(f"--samples must be >= 1, got {samples}")
    want = [round(samples * s.fraction, 9) for s in specs]  # round: 100 × 0.29 is 28.999999999999996
    counts = [math.floor(w) for w in want]
    by_remainder = sorted(range(len(specs)), key=lambda i: (counts[i] - want[i], i))
    for i in by_remainder[: max(samples - sum(counts), 0)]:
        counts[i] += 1
    for s, n in zip(specs, counts, strict=True):
        if n == 0:
            raise UserError(f"--samples {samples} leaves no sample for {s.label} (fraction {s.fraction:g}); "
                            f"pass more samples or a larger fraction")
    return counts


def sample_mix(ids: list[torch.Tensor], specs: list[DataSpec], samples: int, seq_len: int,
               seed: int) -> tuple[torch.Tensor, list[dict]]:
    """[samples, seq_len] windows drawn from each source's token ids in proportion, and each source's record.

    One source samples exactly as before mixes existed; source i of a mix draws with seed + i, and the
    windows are shuffled with `seed` so that no batch holds one source only."""
    counts = mix_counts(specs, samples)
    if len(specs) == 1:
        windows = sample_windows(ids[0], samples, seq_len, seed)
    else:
        for s, x in zip(specs, ids, strict=True):
            if x.numel() < seq_len:
                raise UserError(f"{s.label} ({s.split}) has {x.numel()} tokens, fewer than --seq-len {seq_len}")
        parts = [sample_windows(x, n, seq_len, seed + i) for i, (x, n) in enumerate(zip(ids, counts, strict=True))]
        windows = torch.cat(parts)[torch.randperm(samples, generator=torch.Generator().manual_seed(seed))]
    records = [{**asdict(s), "column": None if s.name in BUILTIN_DATA else s.column, "samples": n,
                "tokens": n * seq_len, "text_tokens": int(x.numel())}
               for s, x, n in zip(specs, ids, counts, strict=True)]
    for r in records:
        warn_reuse(r["name"] + (f"@{r['config']}" if r["config"] else ""), r["split"], r["samples"], seq_len,
                   r["text_tokens"])
    return windows, records


def reuse(samples: int, seq_len: int, text_tokens: int) -> float:
    """How many times each token of the text is drawn on average: samples × seq_len / text_tokens."""
    return samples * seq_len / max(text_tokens, 1)


def warn_reuse(label: str, split: str, samples: int, seq_len: int, text_tokens: int) -> float:
    """A warning (logging) when a source is drawn more tokens than it holds: the windows then repeat its text,
    and the statistics weigh those tokens several times over. Returns the reuse factor."""
    r = reuse(samples, seq_len, text_tokens)
    if r > 1.0:
        log.warning("calibration text %s (%s) holds %d tokens and %d × %d = %d are drawn from it: %.1fx reuse "
                    "(each token seen %.1f times on average); pass more text, or fewer --samples / a shorter "
                    "--seq-len", label, split, text_tokens, samples, seq_len, samples * seq_len, r, r)
    return r


def describe(specs: list[DataSpec]) -> tuple[str, str]:
    """report.json's `data` and `split`: the source and its split, or the whole mix."""
    if len(specs) == 1:
        return specs[0].label, specs[0].split
    return ",".join(map(str, specs)), "+".join(dict.fromkeys(s.split for s in specs))
