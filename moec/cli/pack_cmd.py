"""`moec pack MODEL CALIB_DIR -o PACKED_DIR`."""

from __future__ import annotations

from pathlib import Path

import typer

from ..calibrate.catalog import recipe_arg
from ..calibrate.pack import pack as run_pack
from ..calibrate.sources import resolve_model
from ..errors import UserError
from .common import console, out_console


def pack(
    model: str | None = typer.Argument(None, help="the calibrated model (as given to calibrate)"),
    calib: Path | None = typer.Argument(None, help="CALIB_DIR written by `moec calibrate`"),
    out: Path = typer.Option(..., "-o", "--out", help="packed checkpoint directory"),
    random: str | None = typer.Option(None, "--random", help="random weights at a preset shape (GPU speed runs)"),
    recipe: str | None = typer.Option(None, "--recipe", help="recipe for --random: a shipped recipe's name "
                                      "(`moec recipes`) or a recipe YAML"),
    scheme: str | None = typer.Option(None, "--scheme", help="instead of --recipe: W4A16, FP8, moec-e2, ... "
                                      "(`moec recipes`)"),
) -> None:
    """Write the packed checkpoint (manifest + safetensors + tokenizer + config)."""
    if random is not None:
        _pack_random(random, recipe_arg(recipe, scheme, required=False), out, model, calib)
        return
    if model is None or calib is None:
        raise UserError("pack needs MODEL and CALIB_DIR (or --random SHAPE --recipe R.yaml)")
    if recipe is not None or scheme is not None:
        raise UserError("pack MODEL CALIB_DIR packs with the calibration's recipe: --recipe / --scheme are for "
                        "--random")
    model_dir = resolve_model(model)
    from ..calibrate.generic_capture import is_generic_calibration

    if is_generic_calibration(calib):  # calibrated on the transformers path: a layout-"hf" pack
        from ..calibrate.generic_pack import pack_any

        m = pack_any(model_dir, model, calib, out)
    else:
        m = run_pack(model_dir, model, calib, out)  # its long steps show their progress (moec/progress.py)
    b = m["effective_bits"]
    out_console.print(f"packed {model} → {out}: {len(m['recipe']['weights'])} weight rules, "
                      f"w_bits {b['w_bits']:.3f}, {b['model_bytes'] / 2**20:.1f} MiB")


def _pack_random(shape: str, recipe: str | None, out: Path, model, calib) -> None:
    import torch

    from ..calibrate.pack import pack_random
    from ..calibrate.recipe import load_recipe
    from ..runtime.config import PRESETS

    if model is not None or calib is not None:
        raise UserError("--random takes no MODEL or CALIB_DIR (random weights at a preset shape)")
    if shape not in PRESETS:
        raise UserError(f"--random: unknown shape {shape!r}; presets: {', '.join(PRESETS)}")
    if recipe is None:
        raise UserError("--random needs --recipe NAME|R.yaml or --scheme NAME (the codecs to pack with)")
    r = load_recipe(recipe)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    console.log(f"packing random {shape} on {device}")
    m = pack_random(PRESETS[shape], shape, r, out, device=device)
    b = m["effective_bits"]
    out_console.print(f"packed random {shape} ({r.name}) → {out}: w_bits {b['w_bits']:.3f}, "
                      f"{b['model_bytes'] / 2**30:.2f} GiB")
