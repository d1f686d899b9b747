"""``mn-prefect simulate --queues Q.json``: a trace replayed with queues under FIFO, fair share and preemption
(simulate/fair.py): a table per policy and queue, ``--json``, and ``--plot FILE.html|FILE.png``."""

from __future__ import annotations

import functools
import html
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from mn_prefect.cli.render import duration as _duration
from mn_prefect.model.issues import InvalidInput
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.queues import QueueSpec, parse_queues
from mn_prefect.simulate.fair import POLICIES, PolicyResult, replay_queues

COLOURS = ("#1f77b4", "#d62728", "#2ca02c")


def policies_of(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise typer.BadParameter(f"{', '.join(bad) or 'none given'}: choose from {', '.join(POLICIES)}",
                                 param_hint="--policies")
    return names


def read_queue_specs(path: Path) -> list[QueueSpec]:
    from mn_prefect.model.blueprint import load_json_file

    raw, problems = load_json_file(path)
    if problems:
        raise InvalidInput(problems)
    return list(parse_queues(raw, path.name).values())


def run(fleet: list[NodeRecord], jobs, specs: list[QueueSpec], policies: tuple[str, ...], *, half_life_s: float,
        min_runtime_s: float, bar, tasks, checkpoint_every_s: float = 0.0) -> list[PolicyResult]:
    out = []
    for policy in policies:
        out.append(replay_queues(fleet, jobs, specs, policy, half_life_s=half_life_s, min_runtime_s=min_runtime_s,
                                 checkpoint_every_s=checkpoint_every_s,
                                 progress=functools.partial(_advance, bar, tasks[policy])))
    return out


def _advance(bar, task, done: int) -> None:
    bar.update(task, completed=done)


def as_json(results: list[PolicyResult], header: dict[str, Any]) -> dict[str, Any]:
    return {**header, "policies": {r.policy: r.as_dict() for r in results}}


def table(results: list[PolicyResult], title: str) -> Table:
    out = Table(title=title, title_justify="left")
    for column in ("policy", "GPU util", "makespan", "Jain", "preemptions", "lost GPU-h", "queue", "jobs",
                   "refused", "wait p50", "wait p95", "slowdown"):
        out.add_column(column, justify="left" if column in ("policy", "queue") else "right")
    for r in results:
        for k, (name, q) in enumerate(sorted(r.queues.items())):
            head = [r.policy, f"{100 * r.util_gpu:.1f}%", _duration(r.makespan), f"{r.jain:.3f}",
                    f"{r.preemptions:,}", f"{r.lost_gpu_s / 3600:,.1f}"] if k == 0 else ["", "", "", "", "", ""]
            out.add_row(*head, name, f"{q.jobs:,}", f"{q.refused:,}", _duration(q.wait_p50), _duration(q.wait_p95),
                        f"{q.slowdown_mean:.2f}")
    return out


def write_plot(path: Path, results: list[PolicyResult], title: str) -> None:
    """Each queue's p95 wait under each policy, as bars: PNG (matplotlib) or self-contained HTML (inline SVG)."""
    queues = sorted({q for r in results for q in r.queues})
    if path.suffix.lower() == ".png":
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        width = 0.8 / max(len(results), 1)
        for n, (r, colour) in enumerate(zip(results, COLOURS, strict=False)):
            ax.bar([i + n * width for i in range(len(queues))],
                   [r.queues[q].wait_p95 / 60 if q in r.queues else 0 for q in queues], width, label=r.policy,
                   color=colour)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(queues))], queues)
        ax.set_ylabel("wait p95 (minutes)")
        ax.legend()
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
        plt.close(fig)
        return
    path.write_text(_html(results, queues, title), encoding="utf-8")


def _html(results: list[PolicyResult], queues: list[str], title: str) -> str:
    width, height, left, top, bottom = 900, 260, 70, 20, 40
    inner_w, inner_h = width - left - 10, height - top - bottom
    top_value = max((r.queues[q].wait_p95 / 60 for r in results for q in queues if q in r.queues), default=1) or 1
    group = inner_w / max(len(queues), 1)
    bar = group * 0.8 / max(len(results), 1)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="wait p95 per queue">',
             f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + inner_h}" stroke="#999"/>']
    for k in range(5):
        v = top_value * k / 4
        y = top + inner_h * (1 - v / top_value)
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="12">{v:.0f}</text>')
    for i, queue in enumerate(queues):
        for n, (r, colour) in enumerate(zip(results, COLOURS, strict=False)):
            value = r.queues[queue].wait_p95 / 60 if queue in r.queues else 0.0
            h = inner_h * value / top_value
            x = left + i * group + n * bar + group * 0.1
            parts.append(f'<rect x="{x:.1f}" y="{top + inner_h - h:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                         f'fill="{colour}"><title>{html.escape(r.policy)} {html.escape(queue)}: {value:.1f} min'
                         '</title></rect>')
        parts.append(f'<text x="{left + i * group + group / 2:.1f}" y="{height - 15}" text-anchor="middle" '
                     f'font-size="12">{html.escape(queue)}</text>')
    parts.append("</svg>")
    legend = " ".join(f'<span style="color:{c}">&#9632; {html.escape(r.policy)} (GPU utilisation '
                      f'{100 * r.util_gpu:.1f}%, Jain {r.jain:.3f}, {r.preemptions} preempted, '
                      f'{r.lost_gpu_s / 3600:.1f} GPU-hours lost)</span>'
                      for r, c in zip(results, COLOURS, strict=False))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'</head><body style="font-family:sans-serif;margin:2em"><h2>{html.escape(title)}</h2><p>{legend}</p>'
            f'<p>wait p95 per queue, minutes</p>{"".join(parts)}<p>Written by <code>mn-prefect simulate --queues '
            f'--plot</code>.</p></body></html>\n')
