"""A small scatter plot as inline SVG, for `moec report` without matplotlib.

Axes with ticks, linear / log / symlog scales (symlog: sign(y)·log10(1 + |y|/c), so 0 and negative
Δppl stay on a log-like axis), labelled points (a label that would overlap an earlier one is left to the
point's hover title), own rows as circles and peers as diamonds, and dashed guide lines y = k·x.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

SYMLOG_C = 0.1  # symlog is linear below about this value (0.1% Δppl: under eval noise at any bit width)
OWN, PEER = "#1f6fb4", "#d0452b"


@dataclass
class Point:
    x: float
    y: float
    label: str  # drawn beside the point
    title: str  # hover text: the full record
    peer: bool = False
    row: bool = True  # a result row (False: a peer measurement nested inside another row)


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    points: list[Point]
    xscale: str = "linear"  # linear | log | symlog
    yscale: str = "linear"
    guides: list[tuple[float, str]] = field(default_factory=list)  # (k, label): the line y = k·x


def pick_scale(values: list[float], positive_only: bool) -> str:
    """log (or symlog where values reach 0 or below) when the magnitudes span two decades or more."""
    mags = [abs(v) for v in values if v != 0]
    if not mags or max(mags) / max(min(mags), SYMLOG_C) < 100:
        return "linear"
    return "log" if positive_only and all(v > 0 for v in values) else "symlog"


def _fwd(scale: str):
    if scale == "log":
        return math.log10
    if scale == "symlog":
        return lambda v: math.copysign(math.log10(1 + abs(v) / SYMLOG_C), v)
    return lambda v: v


def _nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def _ticks(scale: str, lo: float, hi: float) -> list[float]:
    """Tick values (data units) for data in [lo, hi]."""
    if scale == "linear":
        return _nice_ticks(lo, hi)
    if scale == "log":
        k0, k1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        mult = (1,) if k1 - k0 > 3 else (1, 2, 5)
        return [m * 10.0**k for k in range(k0, k1 + 1) for m in mult if lo <= m * 10.0**k <= hi] or [lo, hi]
    out = [0.0] if lo <= 0 <= hi else []  # symlog: 0 and the powers of ten from SYMLOG_C up, either sign
    k = math.floor(math.log10(SYMLOG_C))
    while 10.0**k <= max(abs(lo), abs(hi)):
        out += [v for v in (10.0**k, -(10.0**k)) if lo <= v <= hi]
        k += 1
    return sorted(out)


def _fmt(v: float) -> str:
    """1000 rather than 1e+03 for whole numbers (Δppl of a broken quantizer reaches thousands of %)."""
    return str(int(v)) if v == int(v) and abs(v) < 1e7 else f"{v:.3g}"


def scatter_svg(p: Panel, width: int = 760, height: int = 420) -> str:
    L, R, T, B = 72, 150, 16, 52  # margins; the right one leaves room for labels of the last points
    xs, ys = [q.x for q in p.points], [q.y for q in p.points]
    fx, fy = _fwd(p.xscale), _fwd(p.yscale)

    def span(vals, scale):
        lo, hi = min(vals), max(vals)
        if scale == "linear":
            pad = (hi - lo) * 0.06 or abs(hi) * 0.1 or 1.0
            lo, hi = lo - pad, hi + pad
            if min(vals) >= 0:
                lo = max(lo, 0.0)
        elif scale == "log":
            lo, hi = lo / 1.25, hi * 1.25
        else:
            lo, hi = (lo * 1.3 if lo < 0 else 0.0), hi * 1.3
        return lo, hi

    xlo, xhi = span(xs, p.xscale)
    ylo, yhi = span(ys, p.yscale)
    X0, X1, Y0, Y1 = fx(xlo), fx(xhi), fy(ylo), fy(yhi)

    def px(v):
        return L + (fx(v) - X0) / ((X1 - X0) or 1) * (width - L - R)

    def py(v):
        return height - B - (fy(v) - Y0) / ((Y1 - Y0) or 1) * (height - T - B)

    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
         f'<rect x="{L}" y="{T}" width="{width - L - R}" height="{height - T - B}" fill="none" stroke="#888"/>']
    for v in _ticks(p.xscale, xlo, xhi):
        x = px(v)
        o.append(f'<line x1="{x:.1f}" y1="{T}" x2="{x:.1f}" y2="{height - B}" stroke="#eee"/>'
                 f'<text x="{x:.1f}" y="{height - B + 14}" text-anchor="middle">{_fmt(v)}</text>')
    for v in _ticks(p.yscale, ylo, yhi):
        y = py(v)
        o.append(f'<line x1="{L}" y1="{y:.1f}" x2="{width - R}" y2="{y:.1f}" stroke="#eee"/>'
                 f'<text x="{L - 5}" y="{y + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')
    o.append(f'<text x="{(L + width - R) / 2}" y="{height - 12}" text-anchor="middle">{escape(p.xlabel)}</text>'
             f'<text transform="translate(16 {(T + height - B) / 2}) rotate(-90)" text-anchor="middle">'
             f'{escape(p.ylabel)}</text>')
    for k, name in p.guides:  # y = k·x over the visible x range, clipped to the plot by sampling
        pts = []
        for i in range(41):
            xv = 10 ** (math.log10(xlo) + i / 40 * (math.log10(xhi) - math.log10(xlo))) if p.xscale == "log" \
                else xlo + i / 40 * (xhi - xlo)
            if ylo <= k * xv <= yhi:
                pts.append(f"{px(xv):.1f},{py(k * xv):.1f}")
        if len(pts) > 1:
            o.append(f'<polyline points="{" ".join(pts)}" fill="none" stroke="#999" stroke-dasharray="4 3"/>'
                     f'<text x="{pts[-1].split(",")[0]}" y="{float(pts[-1].split(",")[1]) - 4:.1f}" fill="#777" '
                     f'text-anchor="end">{escape(name)}</text>')
    placed: list[tuple[float, float, float, float]] = []
    for q in p.points:
        x, y = px(q.x), py(q.y)
        color = PEER if q.peer else OWN
        shape = (f'<polygon points="{x:.1f},{y - 5:.1f} {x + 5:.1f},{y:.1f} {x:.1f},{y + 5:.1f} {x - 5:.1f},{y:.1f}" '
                 f'fill="{color}"/>' if q.peer else f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{color}"/>')
        o.append(f'<g class="point" data-row="{int(q.row)}" data-peer="{int(q.peer)}"><title>{escape(q.title)}'
                 f'</title>{shape}</g>')
        box = (x + 6, y - 10, x + 6 + 6.2 * len(q.label), y + 3)
        if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
            placed.append(box)
            o.append(f'<text x="{box[0]:.1f}" y="{y + 3:.1f}" fill="{color}">{escape(q.label)}</text>')
    o.append("</svg>")
    return "\n".join(o)
