"""Small dependency-free SVG charts for the self-contained HTML report (no script, no network)."""

from __future__ import annotations

import math
from html import escape

W, H = 560, 300
L, R, T, B = 150, 20, 30, 40  # margins: labels on the left, title on top, axis at the bottom
COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"]


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step) + 1)]


def _frame(
    title: str,
    body: str,
    x_label: str = "",
    y_label: str = "",
    legend: list[tuple[str, str]] | None = None,
    shift: float = 0.0,
) -> str:
    """The chart's box, title and axis labels; a legend (name, colour) goes in rows below the x axis label, never
    over the plotted area. `shift` widens the box on the left (for long row labels): the body moves right by it."""
    keys, extra = _legend(legend or [])
    height, width = H + extra, W + shift
    if shift:
        body = f'<g transform="translate({shift:.0f},0)">{body}</g>'
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width:.0f} {height}" width="{width:.0f}" '
        f'height="{height}" role="img" aria-label="{escape(title)}"><title>{escape(title)}</title>'
        f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="14" font-weight="bold">{escape(title)}</text>'
        f'{body}<text x="{shift + (L + W - R) / 2}" y="{H - 6}" text-anchor="middle" font-size="11">'
        f"{escape(x_label)}</text>"
        f'<text x="12" y="{(T + H - B) / 2}" font-size="11" transform="rotate(-90 12 {(T + H - B) / 2})" '
        f'text-anchor="middle">{escape(y_label)}</text>{keys}</svg>'
    )


LEGEND_ROW, CHAR_W = 16, 6.5  # a legend row's height; a rough width of one 11px character
LABEL_W = 5.6  # a rough width of one 10px character (a row label)


def _legend(items: list[tuple[str, str]]) -> tuple[str, int]:
    """Swatches and names laid out left to right in rows under the chart: (SVG, the height it adds)."""
    if not items:
        return "", 0
    out, x, row = [], 12.0, 0
    for name, color in items:
        width = 18 + CHAR_W * len(name) + 14
        if x + width > W - 8 and x > 12:
            x, row = 12.0, row + 1
        y = H + 4 + row * LEGEND_ROW
        out.append(
            f'<g data-legend="{escape(name)}"><rect x="{x:.1f}" y="{y:.1f}" width="12" height="8" fill="{color}"/>'
            f'<text x="{x + 16:.1f}" y="{y + 8:.1f}" font-size="11">{escape(name)}</text></g>'
        )
        x += width
    return "".join(out), (row + 1) * LEGEND_ROW + 6


def _xaxis(lo: float, hi: float, sx) -> str:
    out = [f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="#333"/>']
    for t in _ticks(lo, hi):
        out.append(
            f'<line x1="{sx(t):.1f}" y1="{H - B}" x2="{sx(t):.1f}" y2="{H - B + 4}" stroke="#333"/>'
            f'<text x="{sx(t):.1f}" y="{H - B + 16}" text-anchor="middle" font-size="10">{t:g}</text>'
        )
    return "".join(out)


def _yaxis(lo: float, hi: float, sy) -> str:
    out = [f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="#333"/>']
    for t in _ticks(lo, hi):
        out.append(
            f'<line x1="{L - 4}" y1="{sy(t):.1f}" x2="{L}" y2="{sy(t):.1f}" stroke="#333"/>'
            f'<text x="{L - 6}" y="{sy(t) + 3:.1f}" text-anchor="end" font-size="10">{t:g}</text>'
        )
    return "".join(out)


def interval_chart(
    title: str, rows: list[tuple[str, float, float, float]], reference: float = 1.0, x_label: str = ""
) -> str:
    """One row per label: a dot at the value and a whisker from lo to hi; a dashed line at `reference`. The box
    widens on the left where a label would not fit the usual margin."""
    if not rows:
        return _frame(title, '<text x="50%" y="50%" text-anchor="middle">no data</text>')
    lo = min(min(r[2] for r in rows), reference) * 0.95
    hi = max(max(r[3] for r in rows), reference) * 1.05
    sx = lambda v: L + (v - lo) / (hi - lo) * (W - L - R)  # noqa: E731
    band = (H - T - B) / len(rows)
    out = [
        _xaxis(lo, hi, sx),
        f'<line x1="{sx(reference):.1f}" y1="{T}" x2="{sx(reference):.1f}" y2="{H - B}" '
        'stroke="#999" stroke-dasharray="4 3"/>',
    ]
    for i, (label, v, a, b) in enumerate(rows):
        y = T + band * (i + 0.5)
        color = COLORS[0] if a > reference else (COLORS[3] if b < reference else "#888")
        out.append(
            f'<text x="{L - 6}" y="{y + 3:.1f}" text-anchor="end" font-size="10">{escape(label)}</text>'
            f'<line x1="{sx(a):.1f}" y1="{y:.1f}" x2="{sx(b):.1f}" y2="{y:.1f}" stroke="{color}" '
            f'stroke-width="2"/><circle cx="{sx(v):.1f}" cy="{y:.1f}" r="4" fill="{color}"/>'
        )
    shift = max(0.0, 12 + LABEL_W * max(len(r[0]) for r in rows) - L)
    return _frame(title, "".join(out), x_label, shift=shift)


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], x_label: str = "", y_label: str = "") -> str:
    pts = [p for s in series.values() for p in s]
    if not pts:
        return _frame(title, '<text x="50%" y="50%" text-anchor="middle">no data</text>')
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y1 = max(p[1] for p in pts) * 1.1 or 1.0
    x1 = x1 if x1 > x0 else x0 + 1
    sx = lambda v: L + (v - x0) / (x1 - x0) * (W - L - R)  # noqa: E731
    sy = lambda v: H - B - v / y1 * (H - T - B)  # noqa: E731
    out = [_xaxis(x0, x1, sx), _yaxis(0, y1, sy)]
    for i, s in enumerate(series.values()):
        c = COLORS[i % len(COLORS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(s))
        out.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2"/>')
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{c}"/>' for x, y in s]
    return _frame(title, "".join(out), x_label, y_label, _keys(series))


def _keys(series: dict) -> list[tuple[str, str]]:
    return [(name, COLORS[i % len(COLORS)]) for i, name in enumerate(series)]


def scatter(title: str, series: dict[str, list[tuple[float, float]]], x_label: str = "", y_label: str = "") -> str:
    pts = [p for s in series.values() for p in s]
    if not pts:
        return _frame(title, '<text x="50%" y="50%" text-anchor="middle">no data</text>')
    x1 = max(p[0] for p in pts) * 1.1 or 1.0
    y1 = max(p[1] for p in pts) * 1.1 or 1.0
    sx = lambda v: L + v / x1 * (W - L - R)  # noqa: E731
    sy = lambda v: H - B - v / y1 * (H - T - B)  # noqa: E731
    out = [_xaxis(0, x1, sx), _yaxis(0, y1, sy)]
    for i, s in enumerate(series.values()):
        c = COLORS[i % len(COLORS)]
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{c}" fill-opacity="0.7"/>' for x, y in s]
    return _frame(title, "".join(out), x_label, y_label, _keys(series))


def bar_chart(
    title: str, bars: list[tuple[str, float]], x_label: str = "", y_label: str = "", y_max: float | None = None
) -> str:
    if not bars:
        return _frame(title, '<text x="50%" y="50%" text-anchor="middle">no data</text>')
    top = y_max or (max(v for _, v in bars) * 1.1 or 1.0)
    sy = lambda v: H - B - v / top * (H - T - B)  # noqa: E731
    width = (W - L - R) / len(bars)
    out = [_yaxis(0, top, sy), f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="#333"/>']
    for i, (label, v) in enumerate(bars):
        x = L + i * width
        out.append(
            f'<rect x="{x + 2:.1f}" y="{sy(v):.1f}" width="{width - 4:.1f}" height="{H - B - sy(v):.1f}" '
            f'fill="{COLORS[0]}"/><text x="{x + width / 2:.1f}" y="{H - B + 14}" text-anchor="middle" '
            f'font-size="10">{escape(label)}</text>'
        )
    return _frame(title, "".join(out), x_label, y_label)


def histogram(
    title: str, values: list[float], bins: int = 10, lo: float = 0.0, hi: float = 1.0, x_label: str = ""
) -> str:
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, max(0, int((v - lo) / (hi - lo) * bins)))] += 1
    labels = [f"{lo + (hi - lo) * i / bins:.1f}" for i in range(bins)]
    return bar_chart(title, list(zip(labels, counts, strict=False)), x_label, "requests")


def band_chart(
    title: str,
    series: dict[str, list[tuple[float, float, float, float]]],
    x_label: str = "",
    y_label: str = "",
    reference: float | None = None,
) -> str:
    """Lines of (x, value, lo, hi) with their interval as a shaded band, and a dashed horizontal reference line (the
    break-even speedup of 1, say)."""
    pts = [p for s in series.values() for p in s]
    if not pts:
        return _frame(title, '<text x="50%" y="50%" text-anchor="middle">no data</text>')
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    x1 = x1 if x1 > x0 else x0 + 1
    values = [v for p in pts for v in p[1:]] + ([reference] if reference is not None else [])
    y0, y1 = min(0.0, min(values)), max(values) * 1.1 or 1.0
    sx = lambda v: L + (v - x0) / (x1 - x0) * (W - L - R)  # noqa: E731
    sy = lambda v: H - B - (v - y0) / (y1 - y0) * (H - T - B)  # noqa: E731
    out = [_xaxis(x0, x1, sx), _yaxis(y0, y1, sy)]
    if reference is not None:
        out.append(
            f'<line x1="{L}" y1="{sy(reference):.1f}" x2="{W - R}" y2="{sy(reference):.1f}" stroke="#333" '
            f'stroke-dasharray="5,4" data-reference="{reference:g}"/>'
        )
    for i, s in enumerate(series.values()):
        c = COLORS[i % len(COLORS)]
        s = sorted(s)
        band = [f"{sx(x):.1f},{sy(hi):.1f}" for x, _, _, hi in s] + [
            f"{sx(x):.1f},{sy(lo):.1f}" for x, _, lo, _ in s[::-1]
        ]
        out.append(f'<polygon points="{" ".join(band)}" fill="{c}" fill-opacity="0.15" stroke="none"/>')
        path = " ".join(f"{sx(x):.1f},{sy(v):.1f}" for x, v, _, _ in s)
        out.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2"/>')
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(v):.1f}" r="3" fill="{c}"/>' for x, v, _, _ in s]
    return _frame(title, "".join(out), x_label, y_label, _keys(series))
