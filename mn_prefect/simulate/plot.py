"""Drawing a simulation: CPU, memory and GPU utilisation and queue length over virtual time, one line per strategy.

``.png`` is drawn with matplotlib (the optional extra ``plot``: ``pip install 'mn-prefect[plot]'``); ``.html`` is
one self-contained file with inline SVG, no script and nothing fetched, so it needs no extra.
"""

from __future__ import annotations

import html
from pathlib import Path

from mn_prefect.simulate.engine import Result, Timeline

PANELS = (("cpu", "CPU utilisation", True), ("memory", "memory utilisation", True),
          ("gpu", "GPU utilisation", True), ("queue", "jobs waiting", False))
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
MAX_POINTS = 2000


class PlotUnavailable(RuntimeError):
    """matplotlib is missing: the message names the extra that installs it."""


PLOT_FORMATS = (".png", ".html", ".htm")


def check_format(path: Path) -> None:
    """Raise ValueError for a suffix we cannot draw, PlotUnavailable when PNG is asked without matplotlib."""
    suffix = path.suffix.lower()
    if suffix not in PLOT_FORMATS:
        raise ValueError(f"{path.name}: the plot is written as .png (matplotlib) or .html, not {suffix or 'no suffix'!r}")
    if suffix == ".png":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise PlotUnavailable("a PNG plot needs matplotlib, which is not installed: pip install 'mn-prefect[plot]' "
                                  "(or write --plot FILE.html, which needs nothing)") from None


def _series(timeline: Timeline, name: str) -> tuple[list[float], list[float]]:
    """Hours since the first arrival, and the values (averaged down to at most MAX_POINTS)."""
    values: list[float] = timeline.as_dict()[name]
    times = [(t - timeline.start) / 3600.0 for t in timeline.times]
    step = max(1, -(-len(values) // MAX_POINTS))
    if step > 1:
        values = [sum(values[k:k + step]) / len(values[k:k + step]) for k in range(0, len(values), step)]
        times = times[::step]
    if name != "queue":
        values = [100.0 * v for v in values]
    return times, values


def write_plot(path: Path, results: list[Result], title: str) -> None:
    if path.suffix.lower() == ".png":
        _png(path, results, title)
    else:
        path.write_text(_html(results, title), encoding="utf-8")


def _png(path: Path, results: list[Result], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), 1, figsize=(10, 10), sharex=True)
    for ax, (name, label, percent) in zip(axes, PANELS, strict=True):
        for result, colour in zip(results, COLOURS, strict=False):
            if result.timeline is None:
                continue
            times, values = _series(result.timeline, name)
            ax.step(times, values, where="post", label=result.strategy, color=colour, linewidth=1)
        ax.set_ylabel(f"{label} (%)" if percent else label)
        if percent:
            ax.set_ylim(0, 105)
        ax.grid(True, alpha=0.3)
    axes[0].legend(loc="upper right")
    axes[-1].set_xlabel("hours since the first arrival (virtual time)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def _html(results: list[Result], title: str) -> str:
    panels = "\n".join(_svg_panel(results, name, label, percent) for name, label, percent in PANELS)
    legend = " ".join(f'<span style="color:{c}">&#9632; {html.escape(r.strategy)}</span>'
                      for r, c in zip(results, COLOURS, strict=False))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}} svg{{display:block;margin-bottom:1em}}
text{{font-size:12px;fill:#333}} .axis{{stroke:#999;stroke-width:1}} .grid{{stroke:#eee}}</style></head>
<body><h2>{html.escape(title)}</h2><p>{legend}</p>
{panels}
<p>x: hours since the first arrival (virtual time). Written by <code>mn-prefect simulate --plot</code>.</p>
</body></html>
"""


def _svg_panel(results: list[Result], name: str, label: str, percent: bool) -> str:
    width, height, left, right, top, bottom = 900, 180, 60, 10, 20, 30
    data = [(r, *_series(r.timeline, name)) for r in results if r.timeline is not None]
    x_max = max((t[-1] for _, t, _ in data if t), default=1.0) or 1.0
    y_max = 100.0 if percent else max((max(v) for _, _, v in data if v), default=1.0) or 1.0
    inner_w, inner_h = width - left - right, height - top - bottom

    def x(v: float) -> float:
        return left + inner_w * v / x_max

    def y(v: float) -> float:
        return top + inner_h * (1 - v / y_max)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{html.escape(label)}">',
             f'<text x="{left}" y="14">{html.escape(label)}{" (%)" if percent else ""}</text>']
    for k in range(5):
        v = y_max * k / 4
        parts.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}"/>')
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
    for k in range(6):
        v = x_max * k / 5
        parts.append(f'<text x="{x(v):.1f}" y="{height - 10}" text-anchor="middle">{v:.2f}h</text>')
    parts.append(f'<line class="axis" x1="{left}" x2="{left}" y1="{top}" y2="{top + inner_h}"/>')
    parts.append(f'<line class="axis" x1="{left}" x2="{width - right}" y1="{top + inner_h}" y2="{top + inner_h}"/>')
    for (result, times, values), colour in zip(data, COLOURS, strict=False):
        points = []
        for k, (t, v) in enumerate(zip(times, values, strict=True)):
            if k:
                points.append(f"{x(t):.1f},{y(values[k - 1]):.1f}")  # a step: the value holds until the next
            points.append(f"{x(t):.1f},{y(v):.1f}")
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.2" points="{" ".join(points)}">'
                     f'<title>{html.escape(result.strategy)}</title></polyline>')
    parts.append("</svg>")
    return "\n".join(parts)
