"""Dependency-free SVG charts for the benchmarks: grouped horizontal bars (median) with
min–max whiskers and the value printed beside each bar."""

from __future__ import annotations

import math
from html import escape
from pathlib import Path
from typing import Any, Sequence


IMG = Path(__file__).resolve().parents[2] / "docs" / "img"  # (bench.common imports us)
COLOURS = ["#2b7bba", "#e6842a", "#5aa05a", "#c44e52", "#8172b2", "#937860", "#da8bc3",
           "#8c8c8c"]


def _fmt(v: float) -> str:
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def bars(title: str, groups: Sequence[str], series: Sequence[str],
         values: dict[tuple[str, str], Any], unit: str, log: bool = False,
         note: str = "", width: int = 900) -> str:
    """``values[(group, series)]``: a ``bench.common.summary`` dict (median/min/max) or a
    number or None (no bar). ``log``: logarithmic value axis (for figures spanning decades)."""
    def trip(v: Any) -> tuple[float, float, float] | None:
        if v is None:
            return None
        if isinstance(v, dict):
            if v.get("median") is None:
                return None
            return float(v["median"]), float(v["min"]), float(v["max"])
        return float(v), float(v), float(v)

    rows = [(g, s, trip(values.get((g, s)))) for g in groups for s in series]
    present = [t for _, _, t in rows if t]
    hi = max((t[2] for t in present), default=1.0) or 1.0
    lo_pos = min((t[0] for t in present if t[0] > 0), default=hi / 10)
    left, right, bar_h, gap = 230, 90, 16, 12
    plot_w = width - left - right
    n_bars = len(groups) * len(series)
    legend_h = 22
    top = 48 + legend_h
    height = top + n_bars * (bar_h + 3) + len(groups) * gap + 50 + (16 if note else 0)
    if log:
        vmin = 10 ** math.floor(math.log10(max(lo_pos / 2, 1e-9)))
        vmax = 10 ** math.ceil(math.log10(hi * 1.05))

        def x(v: float) -> float:
            v = max(v, vmin)
            return left + plot_w * (math.log10(v) - math.log10(vmin)) / (
                math.log10(vmax) - math.log10(vmin))
        ticks = [10 ** e for e in range(int(round(math.log10(vmin))),
                                        int(round(math.log10(vmax))) + 1)]
    else:
        step = 10 ** math.floor(math.log10(hi * 1.05)) if hi > 0 else 1
        for m in (1, 2, 5, 10):
            if hi * 1.05 / (step * m) <= 6:
                step *= m
                break
        vmax = step * math.ceil(hi * 1.05 / step)

        def x(v: float) -> float:
            return left + plot_w * max(v, 0) / vmax
        ticks = [step * i for i in range(int(round(vmax / step)) + 1)]
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
         f'<rect width="{width}" height="{height}" fill="white"/>',
         f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15" '
         f'font-weight="bold">{escape(title)}</text>']
    lx = left
    for i, s in enumerate(series):
        o.append(f'<rect x="{lx}" y="36" width="12" height="12" fill="{COLOURS[i % 8]}"/>')
        o.append(f'<text x="{lx + 16}" y="46">{escape(s)}</text>')
        lx += 24 + 7 * len(s)
    bottom = height - 40 - (16 if note else 0)
    for t in ticks:
        tx = x(t)
        o.append(f'<line x1="{tx:.1f}" y1="{top - 4}" x2="{tx:.1f}" y2="{bottom}" '
                 'stroke="#ddd"/>')
        o.append(f'<text x="{tx:.1f}" y="{bottom + 14}" text-anchor="middle" fill="#555">'
                 f'{escape(_fmt(t))}</text>')
    o.append(f'<text x="{left + plot_w / 2}" y="{bottom + 30}" text-anchor="middle">'
             f'{escape(unit)}{" (log scale)" if log else ""}; bar = median, whisker = '
             'min–max</text>')
    y = top
    for g in groups:
        gy = y
        for i, s in enumerate(series):
            t = trip(values.get((g, s)))
            if t:
                med, mn, mx = t
                o.append(f'<rect x="{left}" y="{y}" width="{max(x(med) - left, 1):.1f}" '
                         f'height="{bar_h}" fill="{COLOURS[i % 8]}"/>')
                if mx > mn:
                    cy = y + bar_h / 2
                    o.append(f'<line x1="{x(mn):.1f}" y1="{cy}" x2="{x(mx):.1f}" y2="{cy}" '
                             'stroke="black"/>')
                    for v in (mn, mx):
                        o.append(f'<line x1="{x(v):.1f}" y1="{y + 3}" x2="{x(v):.1f}" '
                                 f'y2="{y + bar_h - 3}" stroke="black"/>')
                o.append(f'<text x="{max(x(mx), x(med)) + 5:.1f}" y="{y + bar_h - 4}">'
                         f'{escape(_fmt(med))}</text>')
            y += bar_h + 3
        o.append(f'<text x="{left - 8}" y="{(gy + y) / 2 + 4:.1f}" text-anchor="end">'
                 f'{escape(g)}</text>')
        y += gap
    o.append(f'<line x1="{left}" y1="{top - 4}" x2="{left}" y2="{bottom}" stroke="black"/>')
    if note:
        o.append(f'<text x="10" y="{height - 8}" fill="#555" font-size="11">'
                 f'{escape(note)}</text>')
    o.append("</svg>")
    return "\n".join(o) + "\n"


def write(name: str, svg: str, out_dir: Path | None = None) -> Path:
    d = out_dir or IMG
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_text(svg)
    return p
