"""`moec inspect PACKED_DIR [--json OUT]`: what a packed checkpoint holds, per tensor."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import typer
from rich.table import Table

from ..formats.checkpoint import MANIFEST, check_model_fields, verify
from .common import out_console, write_json_atomic


def inspect(
    packed: Path = typer.Argument(..., help="packed checkpoint directory"),
    json_out: Path | None = typer.Option(None, "--json", help="write the summary here"),
    per_tensor: bool = typer.Option(False, "--per-tensor", help="one row per tensor instead of per group"),
) -> None:
    """Verify a packed checkpoint and summarize codecs, bits and bytes."""
    m = verify(packed)
    check_model_fields(m, packed / MANIFEST)
    groups: dict[tuple, dict] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "params": 0})
    for name, e in m["tensors"].items():
        key = (name if per_tensor else _group(name), e["codec"], e["bits"], e["dtype"])
        g = groups[key]
        g["tensors"] += 1
        g["bytes"] += e["bytes"]
        n = 1
        for s in e["shape"]:
            n *= s
        g["params"] += n
    t = Table(title=f"{packed}: {m['format']} v{m['format_version']}, source {m['source']['model']}, "
                    f"recipe {m['recipe']['name']}")
    for c in ("tensor" if per_tensor else "group", "codec", "bits", "dtype", "tensors", "MiB"):
        t.add_column(c)
    for (g, codec, bits, dtype), v in sorted(groups.items()):
        t.add_row(g, codec, f"{bits:g}", dtype, str(v["tensors"]), f"{v['bytes'] / 2**20:.2f}")
    out_console.print(t)
    b = m["effective_bits"]
    cal = m["calibration"]
    kv_nominal = b.get("kv_bits_nominal")
    kv_nominal = f"{kv_nominal:g}" if isinstance(kv_nominal, int | float) else str(kv_nominal)
    out_console.print(f"effective bits: weights {b['w_bits']:.3f} over {b['w_params']:,} params; model "
                      f"{b['model_bits']:.3f} ({b['model_bytes'] / 2**20:.1f} MiB); kv nominal {kv_nominal}")
    if cal.get("random"):  # `moec pack --random`: no calibration data
        out_console.print(f"calibration: none (random weights, seed {cal.get('seed')})")
    else:
        out_console.print(f"calibration: {cal.get('data')}/{cal.get('split')}, {cal.get('samples')} × "
                          f"{cal.get('seq_len')} tokens, seed {cal.get('seed')}, expert policy "
                          f"{cal.get('expert_policy')}")
    if json_out is not None:
        summary = {k: m[k] for k in ("format", "format_version", "moec_version", "created", "source", "recipe",
                                     "calibration", "effective_bits")}
        summary["groups"] = [{"group": g, "codec": c, "bits": b_, "dtype": d, **v}
                             for (g, c, b_, d), v in sorted(groups.items())]
        write_json_atomic(json_out, summary)


def _group(name: str) -> str:
    parts = name.split(".")
    return ".".join(["layers.*", *parts[2:]]) if parts[0] == "layers" else name
