"""``mn-prefect simulate``: the scheduling simulator (docs/simulator.md), its table, JSON, plot and trace generator."""

from __future__ import annotations

import itertools
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, TextIO

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from mn_prefect.cli import render
from mn_prefect.cli.inputs import read_nodes
from mn_prefect.cli.options import EXIT_REFUSED, JsonFlag
from mn_prefect.model.issues import InvalidInput, Issues
from mn_prefect.model.node import NodeRecord

SHOWN_BAD = 5  # bad lines listed when they are skipped (all are counted; --json lists the first 20)


def simulate(
    nodes: Annotated[Path | None, typer.Option(
        "--nodes", help="JSON list of node records (as `plan --nodes` takes), e.g. deployments/mock-nodes.json. "
                        "With --generate: write requests this fleet can run, at a rate sized to it.")] = None,
    trace: Annotated[str | None, typer.Option(
        "--trace", metavar="TRACE.jsonl", help='One job a line: {"t": s, "job": id, "duration": s, "resources": '
                                               '{...}, "job_type": "batch"}; "-" reads standard input.')] = None,
    strategy: Annotated[str, typer.Option(
        "--strategy", help="Strategies to compare, comma-separated: binpack, spread.")] = "binpack,spread",
    as_json: JsonFlag = False,
    plot: Annotated[Path | None, typer.Option(
        "--plot", metavar="FILE.png|FILE.html", help="Draw utilisation and queue length over time: PNG (needs the "
                                                     "extra `plot`: matplotlib) or self-contained HTML.")] = None,
    strict: Annotated[bool, typer.Option(
        "--strict", help="A bad trace line is fatal (exit 1, nothing simulated) instead of skipped.")] = False,
    generate: Annotated[int | None, typer.Option(
        "--generate", metavar="N", min=0, help="Write a synthetic trace of N jobs to standard output instead "
                                               "(Poisson arrivals; CPU, whole-GPU, MIG and fractional requests).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Random seed of --generate (same seed, same trace).")] = 1,
    rate: Annotated[float | None, typer.Option(
        "--rate", help="--generate: mean arrivals a second (default: 80% of the --nodes "
                                               "fleet's bottleneck, else one every 40 s).")] = None,
    mean_duration: Annotated[float | None, typer.Option(
        "--mean-duration", help="--generate: mean job duration in seconds "
                                                        "(default 300).")] = None,
    progress: Annotated[bool | None, typer.Option(
        "--progress/--no-progress", help="A progress bar on standard error (default: when it is a terminal).",
        show_default=False)] = None,
    queues: Annotated[Path | None, typer.Option(
        "--queues", metavar="Q.json", help="Replay with queues (quotas, borrowing, weights, priorities, cohorts, "
                                           "as plan --queues takes) and compare --policies per queue; trace lines "
                                           "name their queue, priority and preemptible.")] = None,
    policies: Annotated[str, typer.Option(
        "--policies", help="With --queues, the policies to compare: fifo, fair, preempt.")] = "fifo,fair,preempt",
    half_life: Annotated[float, typer.Option(
        "--half-life", min=0, help="With --queues: seconds over which a queue's past use halves (fair share; 0 "
                                   "counts only what it holds).")] = 3600.0,
    min_runtime: Annotated[float, typer.Option(
        "--min-runtime", min=0, help="With --queues: seconds a job runs before it may be preempted.")] = 0.0,
    checkpoint_every: Annotated[float | None, typer.Option(
        "--checkpoint-every", metavar="S", help="With --queues: a job checkpoints every S seconds of its run, so "
                                                "an eviction loses only the work since (0, the default: never; a "
                                                "trace line's checkpoint_every_s overrides it).")] = None,
    holds: Annotated[str, typer.Option(
        "--holds", metavar="on|off|both", help="Head-of-line holds with backfill (on), today's greedy order (off), "
                                               "or both side by side.")] = "on",
    jobs_out: Annotated[Path | None, typer.Option(
        "--jobs-out", metavar="FILE.jsonl", help="Write one line per job and replay: job, strategy, policy, holds, "
                                                 "submitted, started, ended, wait_s, nodes.")] = None,
) -> None:
    """Replay a trace of jobs through the real scheduler and the store's admission rule in virtual time, once per
    strategy, and compare: jobs placed and refused, waits, utilisation, GPU fragmentation, makespan. With
    --generate N, write a synthetic trace instead. Exit 0 done, 1 a bad trace line under --strict, 2 bad usage."""
    strategies = _strategies(strategy)  # checked with --generate too: a wrong value is never passed over
    holding = _holds(holds)
    if generate is not None:
        for name, given in (("--trace", trace is not None), ("--plot", plot is not None), ("--json", as_json),
                            ("--strict", strict)):
            if given:
                raise typer.BadParameter(f"{name} is for replaying a trace, not for --generate "
                                         "(generate first, then replay: see --help)", param_hint=name)
        for name, value in (("--rate", rate), ("--mean-duration", mean_duration)):
            if value is not None and not value > 0:
                raise typer.BadParameter(f"must be above 0, got {value:g}", param_hint=name)
        fleet = _read_nodes(nodes) if nodes is not None else None
        raise typer.Exit(_write_trace(generate, seed, fleet, rate, mean_duration))
    if nodes is None or trace is None:
        missing = " and ".join(n for n, v in (("--nodes", nodes), ("--trace", trace)) if v is None)
        raise typer.BadParameter(f"give {missing} (or --generate N to write a trace)", param_hint=missing)
    for name, value in (("--rate", rate), ("--mean-duration", mean_duration)):
        if value is not None:
            raise typer.BadParameter(f"{name} shapes a generated trace: use it with --generate", param_hint=name)
    if plot is not None:
        _check_plot(plot)
    if checkpoint_every is not None and queues is None:
        raise typer.BadParameter("checkpoints matter where runs are preempted: use it with --queues",
                                 param_hint="--checkpoint-every")
    if checkpoint_every is not None and not (math.isfinite(checkpoint_every) and checkpoint_every >= 0):
        raise typer.BadParameter(f"must be a finite number of seconds >= 0, got {checkpoint_every:g}",
                                 param_hint="--checkpoint-every")
    specs = chosen = None
    if queues is not None:
        from mn_prefect.cli import simulate_queues

        chosen = simulate_queues.policies_of(policies)
        specs = simulate_queues.read_queue_specs(queues)
    trace_file = _trace_source(trace)
    fleet = _read_nodes(nodes)
    show = progress if progress is not None else render.errors.is_terminal
    console = render.errors if not show or render.errors.is_terminal else Console(stderr=True, force_terminal=True)
    if specs is not None:
        assert chosen is not None
        raise typer.Exit(_with_queues(fleet, trace_file, specs, chosen, strict=strict, as_json=as_json, plot=plot,
                                      console=console, show=show, half_life=half_life, min_runtime=min_runtime,
                                      checkpoint_every=checkpoint_every or 0.0,
                                      title=f"{trace} on {len(fleet)} nodes ({nodes.name}), queues {queues}",
                                      jobs_out=jobs_out))
    results, jobs = _run(fleet, trace_file, strategies, strict=strict, as_json=as_json, timeline=plot is not None,
                         console=console, show=show, holds=holding)
    if results is None:
        raise typer.Exit(EXIT_REFUSED)
    if jobs_out is not None:
        _write_jobs(jobs_out, jobs, [(r.strategy, "fifo", r.holds, r.log) for r in results])
    title = f"{len(jobs)} jobs from {trace} on {len(fleet)} nodes ({nodes.name})"
    if plot is not None:
        from mn_prefect.simulate.plot import write_plot

        write_plot(plot, results, title)
    if as_json:
        render.print_json(_as_json(fleet, jobs, results, nodes, trace, plot, both=len(holding) > 1))
    else:
        render.console.print(_table(results, title))
        _notes(results, jobs, plot)


# -- inputs -------------------------------------------------------------------------------------------------


def _read_nodes(path: Path) -> list[NodeRecord]:
    issues = Issues()
    records = read_nodes(path, issues)
    if issues:
        raise InvalidInput(issues.items)
    return records


def _strategies(text: str) -> tuple[str, ...]:
    from mn_prefect.simulate.engine import STRATEGIES

    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        raise typer.BadParameter(f"unknown scheduler strategy {', '.join(map(repr, unknown)) or '(none)'} "
                                 f"(allowed: {', '.join(STRATEGIES)}, comma-separated)", param_hint="--strategy")
    if len(set(names)) != len(names):
        raise typer.BadParameter(f"a strategy is named twice in {text!r}", param_hint="--strategy")
    return tuple(names)


HOLDS = {"on": (True,), "off": (False,), "both": (True, False)}


def _holds(text: str) -> tuple[bool, ...]:
    chosen = HOLDS.get(text.strip().lower())
    if chosen is None:
        raise typer.BadParameter(f"must be on, off or both, got {text!r}", param_hint="--holds")
    return chosen


def _check_plot(path: Path) -> None:
    from mn_prefect.simulate.plot import PlotUnavailable, check_format

    try:
        check_format(path)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--plot") from None
    except PlotUnavailable as error:
        render.errors.print(f"[red]error[/]: {escape(str(error))}", soft_wrap=True)
        raise typer.Exit(EXIT_REFUSED) from None
    if not path.parent.exists():
        raise typer.BadParameter(f"no folder {str(path.parent)!r} to write {path.name} in", param_hint="--plot")


def _trace_source(trace: str) -> tuple[TextIO, int | None]:
    """The open trace and its size in bytes (None for standard input)."""
    if trace == "-":
        return sys.stdin, None
    path = Path(trace)
    if not path.is_file():
        raise typer.BadParameter(f"no file {trace!r}" if not path.exists() else f"{trace!r} is not a file",
                                 param_hint="--trace")
    try:
        return path.open(encoding="utf-8", errors="replace"), path.stat().st_size
    except OSError as error:
        raise typer.BadParameter(f"cannot read {trace!r}: {error.strerror}", param_hint="--trace") from None


# -- running ------------------------------------------------------------------------------------------------


def _run(fleet: list[NodeRecord], source: tuple[TextIO, int | None], strategies: tuple[str, ...], *, strict: bool,
         as_json: bool, timeline: bool, console: Console, show: bool, holds: tuple[bool, ...] = (True,)):
    from mn_prefect.simulate.engine import simulate as replay
    from mn_prefect.simulate.trace import read_trace

    stream, size = source
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True, disable=not show) as bar:
        reading = bar.add_task("reading trace (bytes)", total=size)
        try:
            jobs = read_trace(stream, progress=lambda done: bar.update(reading, completed=min(done, size or done)))
        finally:
            if stream is not sys.stdin:
                stream.close()
        bar.update(reading, completed=size or 0, visible=False)
        if jobs.bad_count:
            _report_bad(jobs, strict, as_json)
            if strict:
                return None, jobs
        tasks: dict[str, TaskID] = {s: bar.add_task(f"replaying with {s}", total=len(jobs)) for s in strategies}
        results = replay(fleet, jobs, strategies, timeline=timeline, holds=holds,
                         progress=lambda s, done: bar.update(tasks[s], completed=done))
    return results, jobs


def _with_queues(fleet: list[NodeRecord], source: tuple[TextIO, int | None], specs, policies: tuple[str, ...], *,
                 strict: bool, as_json: bool, plot: Path | None, console: Console, show: bool, half_life: float,
                 min_runtime: float, title: str, jobs_out: Path | None = None, checkpoint_every: float = 0.0) -> int:
    from mn_prefect.cli import simulate_queues
    from mn_prefect.simulate.trace import read_trace

    stream, size = source
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not show) as bar:
        try:
            jobs = read_trace(stream)
        finally:
            if stream is not sys.stdin:
                stream.close()
        if jobs.bad_count:
            _report_bad(jobs, strict, as_json)
            if strict:
                return EXIT_REFUSED
        tasks = {p: bar.add_task(f"replaying with {p}", total=len(jobs)) for p in policies}
        results = simulate_queues.run(fleet, jobs, specs, policies, half_life_s=half_life, min_runtime_s=min_runtime,
                                      checkpoint_every_s=checkpoint_every, bar=bar, tasks=tasks)
    title = f"{len(jobs)} jobs from {title}"
    if jobs_out is not None:
        _write_jobs(jobs_out, jobs, [("binpack", r.policy, False, r.log) for r in results])
    if plot is not None:
        simulate_queues.write_plot(plot, results, title)
    if as_json:
        render.print_json(simulate_queues.as_json(results, {
            "trace": {"jobs": len(jobs), "bad_lines": jobs.bad_count}, "nodes": len(fleet),
            "half_life_s": half_life, "min_runtime_s": min_runtime, "checkpoint_every_s": checkpoint_every,
            "plot": str(plot) if plot else None}))
    else:
        render.console.print(simulate_queues.table(results, title))
        if plot is not None:
            render.console.print(f"plot written to {plot}", highlight=False)
    return 0


def _report_bad(jobs, strict: bool, as_json: bool) -> None:
    shown = jobs.bad if strict else jobs.bad[:SHOWN_BAD]
    head = "[red]error[/]" if strict else "[yellow]warning[/]"
    what = "nothing simulated (--strict)" if strict else "skipped"
    render.errors.print(f"{head}: {jobs.bad_count} bad trace line(s), {what}:", soft_wrap=True, highlight=False)
    for bad in shown:
        render.errors.print(f"  {bad}", soft_wrap=True, highlight=False, markup=False)
    if jobs.bad_count > len(shown):
        render.errors.print(f"  ... and {jobs.bad_count - len(shown)} more", highlight=False)


# -- generating ---------------------------------------------------------------------------------------------


def _write_trace(count: int, seed: int, fleet: list[NodeRecord] | None, rate: float | None,
                 mean_duration: float | None) -> int:
    from mn_prefect.simulate.generate import DEFAULT_DURATION, generate as lines

    mean_duration = mean_duration if mean_duration is not None else DEFAULT_DURATION
    out = sys.stdout
    produced = lines(count, seed, nodes=fleet, rate=rate, mean_duration=mean_duration)
    try:
        first = next(produced, None)  # the mix is checked against the fleet before anything is written
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--nodes") from None
    try:
        for chunk in _chunks(itertools.chain([first] if first is not None else [], produced)):
            out.write(chunk)
        out.flush()
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 0


def _chunks(lines: Iterator[str], size: int = 10_000) -> Iterator[str]:
    batch: list[str] = []
    for line in lines:
        batch.append(line)
        if len(batch) >= size:
            yield "\n".join(batch) + "\n"
            batch = []
    if batch:
        yield "\n".join(batch) + "\n"


# -- output -------------------------------------------------------------------------------------------------


def _write_jobs(path: Path, jobs, replays: list[tuple[str, str, bool, Any]]) -> None:
    """One JSON line per job and replay (``--jobs-out``): times in virtual seconds, null where it never started."""
    import json
    import math

    def number(value: float) -> float | None:
        return None if math.isnan(value) else value

    try:
        with path.open("w", encoding="utf-8") as out:
            for strategy, policy, holding, log in replays:
                for job in range(len(jobs)):
                    started, ended = number(log.started[job]), number(log.ended[job])
                    submitted = jobs.times[job]
                    out.write(json.dumps({
                        "job": jobs.ids[job], "strategy": strategy, "policy": policy, "holds": holding,
                        "submitted": submitted, "started": started, "ended": ended,
                        "wait_s": started - submitted if started is not None else None,
                        "nodes": list(log.nodes.get(job, ()))}) + "\n")
    except OSError as error:
        raise typer.BadParameter(f"cannot write {str(path)!r}: {error.strerror}", param_hint="--jobs-out") from None


def _as_json(fleet: list[NodeRecord], jobs, results, nodes: Path, trace: str, plot: Path | None,
             both: bool = False) -> dict[str, Any]:
    if both:
        strategies: dict[str, Any] = {}
        for r in results:
            strategies.setdefault(r.strategy, {"holds": {}})["holds"]["on" if r.holds else "off"] = r.as_dict()
    else:
        strategies = {r.strategy: r.as_dict() for r in results}
    return {
        "nodes": {"file": str(nodes), "count": len(fleet)},
        "trace": {"file": trace, "jobs": len(jobs), "shapes": len(jobs.shapes), "bad_lines": jobs.bad_count,
                  "skipped": [b.as_dict() for b in jobs.bad]},
        "plot": str(plot) if plot is not None else None,
        "strategies": strategies,
    }


_duration = render.duration


def _table(results, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    both = len({r.holds for r in results}) > 1
    for r in results:
        table.add_column(f"{r.strategy} (holds {'on' if r.holds else 'off'})" if both else r.strategy,
                         justify="right")
    rows: list[tuple[str, Any]] = [
        ("jobs", lambda r: f"{r.jobs:,}"),
        ("placed", lambda r: f"{r.placed:,}"),
        ("refused (never fit any node)", lambda r: f"{r.not_runnable:,}"),
        ("refused by the admission rule", lambda r: f"{r.admission_refused:,}"),
        ("waited before starting", lambda r: f"{r.waited:,}"),
        ("wait mean", lambda r: _duration(r.wait_mean)),
        ("wait p50", lambda r: _duration(r.wait_p50)),
        ("wait p99", lambda r: _duration(r.wait_p99)),
        ("wait max", lambda r: _duration(r.wait_max)),
        ("queue length mean / max", lambda r: f"{r.queue_mean:,.1f} / {r.queue_max:,}"),
        ("CPU utilisation", lambda r: f"{100 * r.util_cpu:.1f}%"),
        ("memory utilisation", lambda r: f"{100 * r.util_memory:.1f}%"),
        ("GPU utilisation", lambda r: f"{100 * r.util_gpu:.1f}%"),
        ("GPUs stranded (mean)", lambda r: f"{r.gpu_stranded:,.2f}"),
        ("GPU fragmentation (stranded / GPUs)", lambda r: f"{100 * r.gpu_fragmentation:.1f}%"),
        ("GPUs stranded while GPU jobs wait", lambda r: f"{r.gpu_stranded_while_waiting:,.2f}"),
        ("time GPU jobs waited", lambda r: _duration(r.gpu_waiting_time)),
        ("makespan", lambda r: _duration(r.makespan)),
        ("widest requests: GPUs, jobs, wait max",
         lambda r: f"{r.widest.get('gpus', 0):g}, {r.widest.get('jobs', 0):g}, {_duration(r.widest.get('wait_max', 0))}"),
        ("holds made / jobs backfilled", lambda r: f"{r.holds_made:,} / {r.backfilled:,}"),
        ("replay (wall)", lambda r: f"{r.wall_s:,.2f} s, {r.events_per_s:,.0f} events/s"),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(r) for r in results))
    return table


def _notes(results, jobs, plot: Path | None) -> None:
    first = results[0] if results else None
    if first is not None and first.refusals:
        render.console.print("refused:", highlight=False)
        for reason, count in list(first.refusals.items())[:5]:
            render.console.print(f"  {count:,} x {reason}", soft_wrap=True, highlight=False, markup=False)
    for r in results[1:]:
        for reason, count in r.refusals.items():
            if reason not in first.refusals:  # type: ignore[union-attr]
                render.console.print(f"  {r.strategy}: {count:,} x {reason}", soft_wrap=True, highlight=False,
                                     markup=False)
    if jobs.bad_count:
        render.console.print(f"{jobs.bad_count:,} bad trace line(s) skipped (listed on standard error)",
                             highlight=False)
    if plot is not None:
        render.console.print(f"plot written to {plot}", highlight=False)
