"""`moec report RESULTS.json... -o report.html|report.png`: the frontier as plots.

Reads result files (`moec eval --json`, `moec eval --latency --json`, benchmarks/results/*.json, peer
files: a JSON list of records, or {"records": [...]}) and draws, per model / shape:
  - quality: Δppl (%) against effective bits, one point per record with `delta_pct` and `q_bits`
    (bits per quantized weight) or else `kv_bits` (KV bits per element);
  - speed: decode ms per token against the HBM floor (`ms_median` against `floor_ms`), one point per
    `moec-latency` record (`moec eval --latency --json`, bench_latency.py), and the peers it carries
    (`peer.<name>.ms_median` with their `pct_of_floor`).
Peers are diamonds: rows whose `peer` is a description (a peer's own file), rows of a peer
implementation (`peer.impl`), and methods named after a peer method (kivi, hqq, llama.cpp).
HTML is self-contained (inline SVG, moec/cli/svgplot.py); PNG needs matplotlib.
"""

from __future__ import annotations

import json
import logging
import math
from html import escape
from pathlib import Path

import typer

from ..atomic import atomic_file
from ..errors import UserError
from .common import console
from .svgplot import Panel, Point, pick_scale, scatter_svg

log = logging.getLogger(__name__)
PEER_METHODS = ("kivi", "kv-kivi", "hqq", "hf-", "llama.cpp")  # a peer's method, implemented or run by us


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not JSON ({e})") from None
    if isinstance(data, dict):
        data = data.get("records", [data])
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a list of result records, got {type(data).__name__}")
    return [r for r in data if isinstance(r, dict)]


def _name(r: dict) -> str:
    peer = r.get("peer")
    if isinstance(peer, str):
        return peer
    return str(r.get("recipe") if r.get("recipe") not in (None, "grid") else r.get("method") or "?")


def is_peer(r: dict) -> bool:
    peer = r.get("peer")
    names = (str(r.get("method") or ""), str(r.get("recipe") or ""))
    return (isinstance(peer, str) or (isinstance(peer, dict) and "impl" in peer) or "peer" in str(r.get("bench", ""))
            or any(n.startswith(PEER_METHODS) for n in names))


def quality_point(r: dict, source: str) -> tuple[tuple, Point] | None:
    """(panel key, point) of a quality record, None if it has no Δppl or bits."""
    if not _num(r.get("delta_pct")):
        return None
    kind, bits = ("weights", r["q_bits"]) if _num(r.get("q_bits")) else ("kv", r.get("kv_bits"))
    if not _num(bits):
        return None
    model = str(r.get("model") or r.get("shape") or "?")
    if "/" in model:  # a checkpoint evaluated by path (moec eval --json): siblings share a plot
        model = f"{Path(model).parent}/*"
    key = ("quality", kind, str(model), r.get("context"))
    title = (f"{_name(r)} ({r.get('method')}): Δppl {r['delta_pct']:+.2f}% at {bits:.3f} bits; mode {r.get('mode')}, "
             f"{r.get('windows', '')}; {source}")
    return key, Point(bits, r["delta_pct"], _name(r), title, peer=is_peer(r))


def speed_points(r: dict, source: str) -> tuple[tuple, list[Point]] | None:
    """(panel key, [the row's point, its peers' points]) of a whole decode step's record (`moec eval --latency`),
    None for others (kernel benchmarks time one op, not a step, and have floors of their own)."""
    if r.get("bench") != "moec-latency" or not (_num(r.get("ms_median")) and _num(r.get("floor_ms"))):
        return None
    where = f"{r.get('shape') or r.get('model')} b{r.get('batch')} ctx {r.get('context')}"
    ctx = r.get("context")
    short = f"{_name(r)} b{r.get('batch')} {ctx // 1024}k" if isinstance(ctx, int) and ctx >= 1024 else _name(r)
    pts = [Point(r["floor_ms"], r["ms_median"], short,
                 f"{_name(r)}, {where}: {r['ms_median']:.2f} ms/token, floor {r['floor_ms']:.2f} ms "
                 f"({100 * r['floor_ms'] / r['ms_median']:.0f}% of floor); {source}", peer=is_peer(r))]
    for name, p in (r.get("peer") or {}).items() if isinstance(r.get("peer"), dict) else ():
        if isinstance(p, dict) and _num(p.get("ms_median")) and _num(p.get("pct_of_floor")) and p["pct_of_floor"] > 0:
            floor = p["ms_median"] * p["pct_of_floor"] / 100  # the peer's own floor (its bytes, same bandwidth)
            pts.append(Point(floor, p["ms_median"], f"{name} b{r.get('batch')}",
                             f"peer {name}, {where}: {p['ms_median']:.2f} ms/token, floor {floor:.2f} ms; {source}",
                             peer=True, row=False))
    return ("speed", str(r.get("shape") or r.get("model") or "?"), str(r.get("device") or "")), pts


def panels(files: list[Path]) -> list[Panel]:
    groups: dict[tuple, list[Point]] = {}
    skipped = []
    for f in files:
        n = 0
        for r in read_records(f):
            q = quality_point(r, f.name)
            s = speed_points(r, f.name) if q is None else None
            if q is not None:
                groups.setdefault(q[0], []).append(q[1])
            elif s is not None:
                groups.setdefault(s[0], []).extend(s[1])
            n += q is not None or s is not None
        if n == 0:
            skipped.append(f)
    if not groups:
        raise UserError(f"no plottable records in {', '.join(map(str, files))}: expected records with delta_pct "
                        f"and q_bits or kv_bits, or moec-latency records with ms_median and floor_ms")
    for f in skipped:
        log.warning("%s: no plottable records (Δppl with bits, or ms per token with a floor); skipped", f)
    out = []
    for key in sorted(groups, key=str):
        pts = groups[key]
        if key[0] == "quality":
            _, kind, model, ctx = key
            what = "bits per quantized weight" if kind == "weights" else "KV bits per element"
            out.append(Panel(f"{model}: Δppl against {what}" + (f", context {ctx}" if ctx else ""), what,
                             "Δppl (%)", pts, pick_scale([p.x for p in pts], True),
                             pick_scale([p.y for p in pts], False)))
        else:
            _, shape, device = key
            scale = "log" if max(p.y for p in pts) / min(p.y for p in pts) >= 20 else "linear"
            out.append(Panel(f"{shape}: decode ms per token against the floor" + (f" ({device})" if device else ""),
                             "floor (ms): bytes per step / copy bandwidth", "ms per token (median)", pts, scale,
                             scale, guides=[(1.0, "floor"), (2.0, "2× floor"), (4.0, "4× floor")]))
    return out


def write_html(ps: list[Panel], files: list[Path], path: Path) -> None:
    body = []
    for p in ps:
        rows = "".join(f"<tr><td>{escape(q.label)}{' (peer)' * q.peer}</td><td>{q.x:.3f}</td><td>{q.y:.3f}</td>"
                       f"<td>{escape(q.title.rsplit('; ', 1)[-1])}</td></tr>" for q in p.points)
        body.append(f"<h2>{escape(p.title)}</h2>\n{scatter_svg(p)}\n<details><summary>{len(p.points)} points"
                    f"</summary><table><tr><th>recipe</th><th>{escape(p.xlabel)}</th><th>{escape(p.ylabel)}</th>"
                    f"<th>file</th></tr>{rows}</table></details>")
    page = ("<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>moec report</title><style>"
            "body{font-family:sans-serif;margin:2em;max-width:900px}td,th{padding:2px 8px;text-align:left}"
            "table{border-collapse:collapse;font-size:12px}</style></head><body>\n<h1>moec report</h1>\n"
            f"<p>From {', '.join(escape(f.name) for f in files)}. Blue circles: moec recipes; red diamonds: peers. "
            "Hover a point for its record.</p>\n" + "\n".join(body) + "\n</body></html>\n")
    with atomic_file(path) as tmp:
        Path(tmp).write_text(page)


def write_png(ps: list[Panel], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise UserError(f"{path}: writing PNG needs matplotlib, which is not installed; write HTML instead "
                        f"(-o {path.with_suffix('.html')})") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(ps), 1, figsize=(8, 4.5 * len(ps)), squeeze=False)
    for ax, p in zip(axes[:, 0], ps, strict=True):
        for peer, marker, color in ((False, "o", "#1f6fb4"), (True, "D", "#d0452b")):
            pts = [q for q in p.points if q.peer == peer]
            ax.scatter([q.x for q in pts], [q.y for q in pts], marker=marker, color=color, s=18)
            for q in pts:
                ax.annotate(q.label, (q.x, q.y), fontsize=6, color=color, xytext=(3, 2), textcoords="offset points")
        for k, name in p.guides:
            lo, hi = ax.get_xlim()
            ax.plot([lo, hi], [k * lo, k * hi], "--", color="#999", lw=0.8, label=name)
        ax.set_xscale(p.xscale, **({"linthresh": 0.1} if p.xscale == "symlog" else {}))
        ax.set_yscale(p.yscale, **({"linthresh": 0.1} if p.yscale == "symlog" else {}))
        ax.set_title(p.title, fontsize=9)
        ax.set_xlabel(p.xlabel)
        ax.set_ylabel(p.ylabel)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    with atomic_file(path) as tmp:  # the temporary keeps the suffix: savefig takes the format from it
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def report(
    files: list[Path] = typer.Argument(..., metavar="RESULTS.json",
                                       help="result JSON files (moec eval --json, benchmarks/results/*.json)"),
    out: Path = typer.Option(..., "-o", "--out", help="report.html (inline SVG) or report.png (needs matplotlib)"),
) -> None:
    """Plot the frontier: Δppl against effective bits per recipe, and ms per token against the floor, with peers.

    One plot per model (quality) and per shape (speed); peers are red diamonds. HTML is self-contained."""
    if out.suffix.lower() not in (".html", ".htm", ".png"):
        raise UserError(f"-o {out}: expected a .html or .png file")
    ps = panels(files)
    if out.suffix.lower() == ".png":
        write_png(ps, out)
    else:
        write_html(ps, files, out)
    console.log(f"report: {sum(len(p.points) for p in ps)} points in {len(ps)} plots → {out}")
