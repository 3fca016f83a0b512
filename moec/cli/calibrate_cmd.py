"""`moec calibrate MODEL --recipe NAME|R.yaml (or --scheme W4A16 ...) --data ptb --split train -o CALIB_DIR [--gpus N]`.

`--data` is one source or a mix (moec/calibrate/dataspec.py), checked before the model is resolved.
Expert parallel over N processes (moec/calibrate/distributed.py): `--gpus N` starts one process per
GPU (NCCL); `torchrun --nproc-per-node N -m moec.cli.app calibrate ...` does the same under torchrun,
and is the way on the CPU (gloo): --gpus is refused with --device cpu, as a CPU run gains nothing from
processes that would share the same cores.
"""

from __future__ import annotations

import os
import sys
from contextlib import ExitStack
from pathlib import Path

import torch
import typer
from rich.table import Table
from rich.text import Text

from ..calibrate import distributed
from ..calibrate.catalog import recipe_arg
from ..calibrate.dataspec import check_data, parse_data
from ..calibrate.recipe import load_recipe
from ..calibrate.run import calibrate as run_calibrate
from ..calibrate.sources import resolve_model
from ..errors import UserError
from ..formats.checkpoint import is_packed
from ..hf.runner import on_transformers_path
from ..runtime.hf_layout import HFCheckpoint
from .common import console, progress_bar, show_table

DEFAULT_SAMPLES, DEFAULT_SEQ_LEN = 32, 512  # when neither the flags nor the recipe's calibration section say


def calibrate(
    model: str = typer.Argument(..., help="HF directory, GGUF file, hub id or built-in name"),
    recipe: str | None = typer.Option(None, "--recipe", "-r", help="a shipped recipe's name (`moec recipes`) or a "
                                      "recipe YAML"),
    scheme: str | None = typer.Option(None, "--scheme", help="instead of --recipe: W4A16, W8A16, FP8, NVFP4, MXFP4, "
                                      "moec-e2, moec-e3 (`moec recipes`)"),
    data: str = typer.Option("ptb", help="built-in data set (ptb, kjv), local .txt/.json/.jsonl/.parquet file or "
                             "saved data set, hub data set (NAME@CONFIG picks a config), or a mix "
                             "NAME:SPLIT:FRACTION[:COLUMN],... (NAME@CONFIG in a mix too) with fractions summing to 1"),
    split: str = typer.Option("train", help="split to calibrate on (never the evaluation split; a local file has "
                              "none: datasets reads it as its one split, train)"),
    data_config: str | None = typer.Option(None, "--data-config", help="hub data set configuration "
                                           "(e.g. wikitext-2-raw-v1 for wikitext)"),
    text_column: str | None = typer.Option(None, "--text-column", help="column to read from files and data sets "
                                           "(default: text, else a messages column); a column of chat messages is "
                                           "rendered with the model's chat template"),
    samples: int | None = typer.Option(None, help="number of calibration sequences (default: the recipe's "
                                       "calibration.samples, else 32)"),
    seq_len: int | None = typer.Option(None, "--seq-len", help="tokens per calibration sequence (default: the "
                                       "recipe's calibration.seq_len, else 512)"),
    out: Path = typer.Option(..., "-o", "--out", help="calibration output directory"),
    seed: int | None = typer.Option(None, help="sampling seed (default: the recipe's calibration.seed)"),
    device: str = typer.Option("cpu", help="cpu or cuda"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted run from OUT.partial/ (the same "
                                "model, recipe, data and settings); without one, start from the first layer"),
    gpus: int | None = typer.Option(None, "--gpus", help="expert parallel over N GPUs, one process each (NCCL); "
                                    "the output is the same as one process's"),
    offload_activations: bool = typer.Option(False, "--offload-activations", help="keep the calibration set's "
                                             "hidden states in host memory, one batch on the device at a time"),
    propagate: str = typer.Option("fp", "--propagate", help="what feeds layer i + 1: fp (layer i's original "
                                  "outputs) or quantized (its outputs with the weights just fitted; one process)"),
    path: str = typer.Option("auto", "--path", help="engine (moec's own model code), transformers (transformers' "
                             "modeling code: any MoE type it runs), or auto: the engine for the types it implements"),
) -> None:
    """Capture statistics layer by layer and fit what the recipe needs."""
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device must be cpu or cuda, got {device!r}")
    if gpus is not None:
        if device != "cuda":
            raise UserError(f"--gpus {gpus} needs --device cuda; on the CPU start gloo processes with torchrun "
                            f"--nproc-per-node {gpus} -m moec.cli.app calibrate ...")
        have = torch.cuda.device_count()
        if not 1 <= gpus <= have:
            raise UserError(f"--gpus {gpus}: this machine has {have} GPU{'s' * (have != 1)}")
        if "WORLD_SIZE" not in os.environ:  # the launcher: the same command as `gpus` ranks, then their status
            raise typer.Exit(distributed.launch(gpus, sys.argv[1:]))
        if int(os.environ["WORLD_SIZE"]) != gpus:
            raise UserError(f"--gpus {gpus} under a launcher of {os.environ['WORLD_SIZE']} processes")
    r = load_recipe(recipe_arg(recipe, scheme))
    if seed is not None:
        r.calibration.seed = seed
    if samples is None:
        samples = r.calibration.samples or DEFAULT_SAMPLES
    from_recipe = seq_len is None and r.calibration.seq_len > 0
    if seq_len is None:
        seq_len = r.calibration.seq_len or DEFAULT_SEQ_LEN
    sources = check_data(parse_data(data, split, data_config, text_column), samples)  # before a model is read
    model_dir = resolve_model(model)
    if not is_packed(model_dir) and on_transformers_path(model_dir, path):
        _calibrate_transformers(model, model_dir, r, data, split, samples, seq_len, out, device, gpus, resume,
                                offload_activations, propagate, data_config, text_column)
        return
    src_args = HFCheckpoint(model_dir).args if not is_packed(model_dir) else None  # validates the config
    n_layers = src_args.n_layers if src_args is not None else 1
    if from_recipe and src_args is not None and seq_len > src_args.max_seq_len:  # the recipe's "as long as served"
        console.log(f"calibration.seq_len {seq_len} is longer than {model} supports: {src_args.max_seq_len} tokens",
                    markup=False, emoji=False, highlight=False)
        seq_len = src_args.max_seq_len
    dist = distributed.from_env(device)
    if dist.main:
        procs = f" on {dist.world} processes" if dist.grouped else ""
        on = data if len(sources) > 1 else f"{data}/{split}"  # a mix names each source's split
        # as written: a mix's `:train:` is no emoji, a file name's [brackets] no markup
        console.log(f"calibrating {model} with recipe {r.name} on {on}: {samples} × {seq_len} tokens{procs}",
                    markup=False, emoji=False, highlight=False)
    layers = ExitStack()
    advance = layers.enter_context(progress_bar("calibrate layers" if dist.main else "", n_layers if dist.main else 0))

    def layer_done(i: int, n: int) -> None:
        advance()
        if i == n:  # the loop's final line now: the steps after it (tuning, the KV fit) show their own progress
            layers.close()

    with layers:
        report = run_calibrate(model_dir, model, r, data, split, samples, seq_len, r.calibration.seed, out,
                               device=device, progress=layer_done,
                               resume=resume, data_config=data_config, text_column=text_column, dist=dist,
                               offload=offload_activations, propagate=propagate,
                               notify=_line if dist.main else None)
    dist.close()  # on success only: after a lost rank, leaving it to the process's exit cannot hang
    if report is None:  # not rank 0: rank 0 wrote the output
        return
    t = Table(title=Text(f"calibration → {out}"))  # a path as written
    for c in ("layer", "ffn", "expert tokens (min / max)", "min/max", "|k| max", "|v| max"):
        t.add_column(c)
    for e in report["layers"]:
        ex = e.get("experts")
        t.add_row(str(e["layer"]), e["ffn"], f"{min(ex['tokens'])} / {max(ex['tokens'])}" if ex else "-",
                  f"{ex['min_over_max']:.2f}" if ex else "-", f"{e['k_absmax']:.2f}", f"{e['v_absmax']:.2f}")
    show_table(t)


def _calibrate_transformers(model, model_dir, r, data, split, samples, seq_len, out, device, gpus, resume, offload,
                            propagate, data_config, text_column) -> None:
    """The transformers path (calibrate/generic_capture.py): a model type moec's engine does not implement, or
    --path transformers."""
    from ..calibrate.generic_capture import calibrate_generic
    from ..hf.runner import model_type

    if gpus is not None or resume or offload or propagate != "fp":
        raise UserError("the transformers path calibrates in one process, from the start, with --propagate fp "
                        "(drop --gpus, --resume, --offload-activations, --propagate quantized)")
    mt = model_type(model_dir)
    console.log(f"calibrating {model} ({mt}) through transformers' modeling code with recipe {r.name} on "
                f"{data}/{split}: {samples} × {seq_len} tokens")
    import json

    n_layers = json.loads((model_dir / "config.json").read_text()).get("num_hidden_layers", 0)
    with progress_bar("calibrate layers", n_layers) as advance:
        report = calibrate_generic(model_dir, model, r, data, split, samples, seq_len, r.calibration.seed, out,
                                   device=device, data_config=data_config, text_column=text_column,
                                   progress=lambda i, n: advance())
    t = Table(title=f"calibration → {out} (transformers path)")
    for c in ("layer", "expert tokens (min / max)", "min/max", "fitted"):
        t.add_column(c)
    for e in report["layers"]:
        ex = e.get("experts")
        t.add_row(str(e["layer"]), f"{min(ex['tokens'])} / {max(ex['tokens'])}" if ex else "-",
                  f"{ex['min_over_max']:.2f}" if ex else "-", str(len(e.get("weights", {}))))
    show_table(t)


def _line(text: str) -> None:
    """One line on stderr, never wrapped (the memory estimate)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)
