"""`moec export PACKED_DIR --format gguf|ct -o DIR`: the packed checkpoint in a format other runtimes read,
only where the mapping is exact (moec/export/__init__.py lists the mappings)."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import console, out_console


def export(
    packed: Path = typer.Argument(..., help="packed checkpoint directory"),
    fmt: str = typer.Option(..., "--format", "-f",
                            help="gguf (llama.cpp: rtn 4-bit g32 as Q4_1, intsym 4/8-bit g32 as Q4_0/Q8_0) or ct "
                                 "(compressed-tensors: intsym and integer-zero rtn as pack-quantized, fp8 as "
                                 "float-quantized)"),
    out: Path = typer.Option(..., "-o", "--out", help="output directory"),
) -> None:
    """Export a packed checkpoint to GGUF or compressed-tensors (exact mappings only, else an error naming the
    tensor, its codec and the formats that carry it)."""
    from ..export import export as run_export

    with console.status(f"exporting {packed} as {fmt}"):
        info = run_export(packed, fmt, out)
    what = (", ".join(f"{n} {t} tensors" for t, n in info["quantized_tensors"].items()) or "no quantized tensors") \
        if fmt == "gguf" else f"{info['quantized_modules']} {info['quantization_format'] or 'quantized'} modules"
    out_console.print(f"exported {packed} → {out} ({fmt}): {info['tensors']} tensors, {what}")
