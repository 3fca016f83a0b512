"""`moec inspect PACKED_DIR [--json OUT] [--per-tensor] [--recipe]`: what a packed checkpoint holds.

`--recipe` prints the resolved recipe the checkpoint was packed with, as YAML that `--recipe` of
calibrate and pack takes back (the manifest's `recipe`, the one place a packed checkpoint stores it).

By default one row per tensor kind: `layers.3.attn.wq.weight` and its siblings in the other layers make
one row `layers.*.attn.wq.weight` with the layers it covers, so a 30-layer model prints a screenful,
not hundreds of rows. A dense MLP is stored like a one-expert MoE (`layers.i.moe.w1`, [1, I, D]); its
rows are labelled `mlp.*` by the model's ffn_kinds. `--per-tensor` lists every stored tensor under its
stored name. Rows sort naturally (layers.2 before layers.10).
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

import typer
import yaml
from rich.table import Table

from ..formats.checkpoint import MANIFEST, check_model_fields, verify
from .common import out_console, show_table, write_json_atomic

# canonical and KV-calibration per-layer names, and transformers' (`model.layers.3.`: layout "hf" packs)
_LAYER = re.compile(r"^((?:kv\.)?(?:model\.)?layers)\.(\d+)\.(.+)$")


def inspect(
    packed: Path = typer.Argument(..., help="packed checkpoint directory"),
    json_out: Path | None = typer.Option(None, "--json", help="write the summary here"),
    per_tensor: bool = typer.Option(False, "--per-tensor", help="one row per stored tensor instead of per kind"),
    recipe: bool = typer.Option(False, "--recipe", help="print the resolved recipe (YAML) instead of the summary"),
) -> None:
    """Verify a packed checkpoint and summarize codecs, bits and bytes (grouped over layers)."""
    m = verify(packed)
    check_model_fields(m, packed / MANIFEST)
    if recipe is True:  # (a direct call passes the typer.Option default, not a bool)
        sys.stdout.write(yaml.safe_dump(m["recipe"], sort_keys=False))
        return
    ffn_kinds = (m.get("model_args") or {}).get("ffn_kinds") or []
    groups: dict[tuple, dict] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "params": 0, "layers": []})
    for name, e in m["tensors"].items():
        label, layer = (name, _layer_of(name)) if per_tensor else _group(name, ffn_kinds)
        g = groups[(label, e["codec"], e["bits"], e["dtype"])]
        g["tensors"] += 1
        g["bytes"] += e["bytes"]
        n = 1
        for s in e["shape"]:
            n *= s
        g["params"] += n
        if layer is not None:
            g["layers"].append(layer)
        if per_tensor:
            g["shape"] = e["shape"]
    rows = sorted(groups.items(), key=lambda kv: (natural_key(kv[0][0]), kv[0][1:]))
    t = Table(title=f"{packed}: {m['format']} v{m['format_version']}, source {m['source']['model']}, "
                    f"recipe {m['recipe']['name']}")
    cols = ("tensor", "codec", "bits", "dtype", "shape", "size") if per_tensor else \
        ("group", "layers", "codec", "bits", "dtype", "tensors", "size")
    for c in cols:
        t.add_column(c, justify="right" if c in ("tensors", "size") else "left")
    for (g, codec, bits, dtype), v in rows:
        middle = [str(tuple(v["shape"]))] if per_tensor else []
        first = [g] if per_tensor else [g, layer_ranges(v["layers"])]
        last = [] if per_tensor else [str(v["tensors"])]
        t.add_row(*first, codec, f"{bits:g}", dtype, *middle, *last, human_bytes(v["bytes"]))
    show_table(t)
    b = m["effective_bits"]
    cal = m["calibration"]
    kv_nominal = (m["recipe"].get("kv") or {}).get("bits", 16) if m.get("kv") else 16  # the fp16 cache: 16
    kv_nominal = f"{kv_nominal:g}" if isinstance(kv_nominal, int | float) else str(kv_nominal)
    q = f"; quantized matrices {b['q_bits']:.3f} over {b['q_params']:,} params" if b.get("q_bits") else ""
    out_console.print(f"effective bits: weights {b['w_bits']:.3f} over {b['w_params']:,} params{q}; model "
                      f"{b['model_bits']:.3f} ({b['model_bytes'] / 2**20:.1f} MiB); "
                      f"kv nominal {kv_nominal} (docs/metrics.md)")
    if cal.get("random"):  # `moec pack --random`: no calibration data
        out_console.print(f"calibration: none (random weights, seed {cal.get('seed')})")
    else:
        out_console.print(f"calibration: {cal.get('data')}/{cal.get('split')}, {cal.get('samples')} × "
                          f"{cal.get('seq_len')} tokens, seed {cal.get('seed')}, expert policy "
                          f"{cal.get('expert_policy')}")
    if json_out is not None:
        summary = {k: m[k] for k in ("format", "format_version", "moec_version", "created", "source", "recipe",
                                     "calibration", "effective_bits") if k in m}
        summary["groups"] = [{"group": g, "codec": c, "bits": b_, "dtype": d,
                              **v, "layers": sorted(set(v["layers"]))} for (g, c, b_, d), v in rows]
        write_json_atomic(json_out, summary)


def _layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(2)) if m else None


def _group(name: str, ffn_kinds: list[str]) -> tuple[str, int | None]:
    """(group label, layer index or None): the layer index becomes `*`, a dense layer's `moe.` becomes `mlp.`."""
    m = _LAYER.match(name)
    if m is None:
        return name, None
    prefix, layer, rest = m.group(1), int(m.group(2)), m.group(3)
    if prefix == "layers" and layer < len(ffn_kinds) and ffn_kinds[layer] == "dense" and rest.startswith("moe."):
        rest = "mlp." + rest.removeprefix("moe.")
    return f"{prefix}.*.{rest}", layer


def natural_key(text: str) -> list:
    """Sort key that compares digit runs as numbers: layers.2 < layers.10."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", text) if p]


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'; '-' for tensors outside the layers."""
    if not layers:
        return "-"
    xs, out = sorted(set(layers)), []
    start = prev = xs[0]
    for x in [*xs[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


def human_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps a leading digit (KV statistics are KiB, experts GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
