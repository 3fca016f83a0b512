"""`moec pack MODEL CALIB_DIR -o PACKED_DIR`."""

from __future__ import annotations

from pathlib import Path

import typer

from ..calibrate.pack import pack as run_pack
from ..calibrate.sources import resolve_model
from ..errors import UserError
from .common import console, out_console


def pack(
    model: str | None = typer.Argument(None, help="the calibrated model (as given to calibrate)"),
    calib: Path | None = typer.Argument(None, help="CALIB_DIR written by `moec calibrate`"),
    out: Path = typer.Option(..., "-o", "--out", help="packed checkpoint directory"),
    random: str | None = typer.Option(None, "--random", help="random weights at a preset shape (GPU speed runs)"),
    recipe: Path | None = typer.Option(None, "--recipe", help="recipe for --random"),
) -> None:
    """Write the packed checkpoint (manifest + safetensors + tokenizer + config)."""
    if random is not None:
        raise UserError("--random packing is not implemented in this moec version (it arrives with the "
                        "runtime end-to-end work); pack a real model with MODEL CALIB_DIR")
    if model is None or calib is None:
        raise UserError("pack needs MODEL and CALIB_DIR (or --random SHAPE --recipe R.yaml)")
    model_dir = resolve_model(model)
    with console.status("packing"):
        m = run_pack(model_dir, model, calib, out)
    b = m["effective_bits"]
    out_console.print(f"packed {model} → {out}: {len(m['recipe']['weights'])} weight rules, "
                      f"w_bits {b['w_bits']:.3f}, {b['model_bytes'] / 2**20:.1f} MiB")
