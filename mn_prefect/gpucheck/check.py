"""``scripts/gpu-check``: mn-prefect on this machine's real NVIDIA GPUs, end to end.

It reads the GPUs through NVML as the worker does, starts a one-node lab here (a Prefect server, a SQLite store, an
``mn`` pool and one worker on this machine's own inventory), places flow runs that ask for one GPU, two GPUs, a
fraction, (where MIG is on) a slice, and none at all, and has each run report from inside what it was booked and what CUDA and
NVML show it. Any difference is a mismatch: the report says which, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import redirect_stdout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from mn_prefect.gpucheck import probe
from mn_prefect.local_lab import BIN, PrefectServer, start_worker, stop_processes
from mn_prefect.model.node import Device

OK, MISMATCH, SKIPPED, REFUSED = "ok", "MISMATCH", "skipped", "refused, as it should be"
RUN_TIMEOUT_S = 180.0
WAIT_REASON_S = 60.0  # how long a run beyond the GPUs may go without the worker's reason for its wait
PROBE_FLOW = "probe.py:gpu_probe"


@dataclass
class Row:
    check: str
    result: str
    detail: str
    seconds: float = 0.0


@dataclass
class Report:
    machine: dict[str, Any] = field(default_factory=dict)
    gpus: list[dict[str, Any]] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(r.result == MISMATCH for r in self.rows)

    def as_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "gpus": self.gpus, "checks": [asdict(r) for r in self.rows],
                "passed": not self.failed}


# ------------------------------------------------------------------------------------------------- the machine


def compute_capability(device: Device) -> str | None:
    for cap in device.capabilities:
        if cap.startswith("sm_") and cap[3:].isdigit():
            return f"{cap[3:-1]}.{cap[-1]}"
    return None


def mps_state() -> str:
    """Whether CUDA MPS can be used here: its control program on PATH, and its daemon's pipe."""
    control = shutil.which("nvidia-cuda-mps-control")
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")) / "control"
    if control is None:
        return "unavailable (no nvidia-cuda-mps-control on PATH)"
    return f"available ({control}); daemon {'running' if pipe.exists() else 'not running'} ({pipe.parent})"


def driver_version() -> str | None:
    import pynvml

    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


def describe_gpus(devices: list[Device]) -> list[dict[str, Any]]:
    slices: dict[str, list[Device]] = {}
    for d in devices:
        if d.parent:
            slices.setdefault(d.parent, []).append(d)
    return [{"index": d.index, "uuid": d.id, "model": d.model, "memory_mb": d.memory_total_mb,
             "compute_capability": compute_capability(d), "mig": "on" if d.mig_mode else "off",
             "slices": [f"{s.mig_profile} {s.id}" for s in slices.get(d.id, [])]}
            for d in devices if not d.parent]


# ------------------------------------------------------------------------------------------------------ the lab


class OneNodeLab:
    """A Prefect server (or the one at ``api_url``), a SQLite store, an ``mn`` pool and one worker on this
    machine's own inventory; the probe deployed once per resource request."""

    def __init__(self, home: Path, api_url: str | None = None):
        # The runs' records and barriers in a folder of this check's own: a --home used before holds old ones.
        self.home, self.out = home, home / f"runs-{uuid.uuid4().hex[:8]}"
        self.out.mkdir(parents=True)
        self.server = None if api_url else PrefectServer(home / "prefect")
        self.api_url = api_url or self.server.api_url  # type: ignore[union-attr]
        self.env = {**os.environ, "PREFECT_API_URL": self.api_url} if api_url else self.server.env  # type: ignore[union-attr]
        self.store_url = f"sqlite:///{home / 'state.db'}"
        self.pool = f"mn-gpu-check-{uuid.uuid4().hex[:6]}"
        self.worker = None
        subprocess.run([str(BIN / "prefect"), "work-pool", "create", self.pool, "--type", "mn"], env=self.env,
                       check=True, capture_output=True)
        self.worker = start_worker(self.env, self.pool, None, self.store_url, home / "worker", name="gpu-check")
        from mn_prefect.store import open_store

        self.store = open_store(self.store_url)
        self.node = wait_for(lambda: next(iter(self.store.list_nodes()), None), 120, "the worker to register")
        self.deployments: dict[str, str] = {}

    def deployment(self, request: dict[str, Any]) -> str:
        key = json.dumps(request, sort_keys=True)
        if key not in self.deployments:
            from prefect.flows import Flow
            from prefect.settings import PREFECT_API_URL, temporary_settings

            with temporary_settings({PREFECT_API_URL: self.api_url}), redirect_stdout(io.StringIO()):  # its table
                flow = cast(Flow, Flow.from_source(source=str(Path(probe.__file__).parent), entrypoint=PROBE_FLOW))
                self.deployments[key] = str(flow.deploy(
                    name=f"gpu-check-{len(self.deployments)}", work_pool_name=self.pool,
                    job_variables={"resources": request}, print_next_steps=False))
        return self.deployments[key]

    def _client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.api_url)

    def run(self, request: dict[str, Any], label: str, hold_until: Path | None = None) -> str:
        deployment = self.deployment(request)
        with self._client() as client:
            run = client.create_flow_run_from_deployment(
                deployment, parameters={"out_dir": str(self.out), "label": label,
                                        "hold_until": str(hold_until) if hold_until else ""})
        return str(run.id)

    def state(self, run_id: str) -> tuple[str, str]:
        with self._client() as client:
            state = client.read_flow_run(run_id).state
        return (state.type.value, state.message or "") if state else ("NONE", "")

    def started(self, label: str) -> bool:
        return (self.out / f"{label}.started").exists()

    def record(self, label: str) -> dict[str, Any]:
        return json.loads((self.out / f"{label}.json").read_text())

    def finish(self, run_id: str) -> tuple[str, str]:
        """Wait for the run to end; its final (state type, message)."""
        return wait_for(lambda: (s := self.state(run_id))[0] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") and s,
                        RUN_TIMEOUT_S, f"flow run {run_id} to end")

    def plan(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """``mn-prefect plan`` of one run's request against what the store holds (exit code, answer)."""
        proc = subprocess.run([str(BIN / "mn-prefect"), "plan", "--request", json.dumps(request),
                               "--store-url", self.store_url], env=self.env, capture_output=True, text=True,
                              timeout=120)
        try:
            return proc.returncode, json.loads(proc.stdout)
        except ValueError:
            return proc.returncode, {"reason": (proc.stderr or proc.stdout).strip()[-300:]}

    def stop(self) -> None:
        if self.worker is not None:
            stop_processes([self.worker], timeout=15)
        if self.server is not None:
            self.server.stop()
        else:  # a server someone else runs: leave it as it was
            with self._client() as client:
                for deployment in self.deployments.values():
                    client.delete_deployment(deployment)
                client.delete_work_pool(self.pool)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


# --------------------------------------------------------------------------------------------------- the checks


def problems(record: dict[str, Any], count: int, node: str) -> list[str]:
    """What is wrong with what one run saw: it must have booked ``count`` GPUs on ``node``, CUDA must show it
    exactly those, and NVML must know each of them."""
    found = []
    booked = record["booked"]
    if record.get("node") != node:
        found.append(f"ran on {record.get('node')!r}, not on {node!r}")
    if len(booked) != count:
        found.append(f"booked {len(booked)} GPU(s), asked for {count}")
    cuda = record["cuda"]
    if "error" in cuda:
        found.append(f"CUDA could not be read: {cuda['error']}")
    elif sorted(cuda["uuids"]) != sorted(booked):
        found.append(f"CUDA shows {cuda['uuids']} (CUDA_VISIBLE_DEVICES={record['env']['CUDA_VISIBLE_DEVICES']!r}), "
                     f"booked {booked}")
    nvml = record["nvml"]
    if "error" in nvml:
        found.append(f"NVML could not be read: {nvml['error']}")
    else:
        unknown = set(booked) - {d["uuid"] for d in nvml["devices"]}
        if unknown:
            found.append(f"NVML does not know {sorted(unknown)}")
    return found


def seen(record: dict[str, Any]) -> str:
    cuda = record["cuda"].get("uuids", [])
    nvml = len(record["nvml"].get("devices", []))
    return (f"booked {', '.join(record['booked']) or 'none'}; CUDA sees {len(cuda)} "
            f"(CUDA_VISIBLE_DEVICES={record['env']['CUDA_VISIBLE_DEVICES']}), NVML {nvml}")


class Checks:
    def __init__(self, lab: OneNodeLab, devices: list[Device], report: Report, progress: Callable[[str], None]):
        self.lab, self.report, self.say = lab, report, progress
        self.node = lab.node.record.name
        self.whole = [d for d in devices if not d.parent and not d.mig_mode]
        self.slices = [d for d in devices if d.parent]
        self.devices = devices

    def add(self, check: str, result: str, detail: str, began: float) -> None:
        row = Row(check, result, detail, round(time.monotonic() - began, 1))
        self.report.rows.append(row)
        self.say(f"{check}: {result}  {detail}")

    def registered(self) -> None:
        began = time.monotonic()
        stored = sorted(d.id for d in self.lab.node.record.devices if d.vendor == "nvidia")
        detected = sorted(d.id for d in self.devices)
        result = OK if stored == detected else MISMATCH
        self.add("worker registered the GPUs NVML reports", result,
                 f"node {self.node}: {len(stored)} device(s)" + ("" if result == OK else f"; detected {detected}, "
                                                                                        f"registered {stored}"), began)

    def held_together(self, name: str, request: dict[str, Any], copies: int, count: int, *,
                      extra: int = 0) -> list[dict[str, Any]]:
        """``copies`` runs of ``request`` held running at once (each must see ``count`` GPUs), plus ``extra`` more
        that must wait while they hold; then all are let go and must complete. Their records."""
        began = time.monotonic()
        barrier = self.lab.out / f"{name}.release"
        labels = [f"{name}-{i}" for i in range(copies + extra)]
        runs = {label: self.lab.run(request, label, barrier) for label in labels}
        early: list[str] = []
        waiting: list[tuple[str, str]] = []
        try:
            wait_for(lambda: all(self.lab.started(label) for label in labels[:copies]), RUN_TIMEOUT_S,
                     f"{copies} {name} run(s) to start together")
        except TimeoutError:
            states = {label: self.lab.state(runs[label]) for label in labels}
            barrier.touch()
            self.add(name, MISMATCH, f"not all {copies} started together: {states}", began)
            return []
        if extra:
            waiting = self._told_to_wait([runs[label] for label in labels[copies:]])
            early = [label for label in labels[copies:] if self.lab.started(label)]
        barrier.touch()
        ends = {label: self.lab.finish(run) for label, run in runs.items()}
        bad = {label: end for label, end in ends.items() if end[0] != "COMPLETED"}
        if bad:
            self.add(name, MISMATCH, f"runs did not complete: {bad}", began)
            return []
        records = [self.lab.record(label) for label in labels]
        found = [f"{r['label']}: {p}" for r in records for p in problems(r, count, self.node)]
        held = [u for r in records[:copies] for u in r["booked"]]
        if count and request.get("gpu") and len(set(held)) != len(held):
            found.append(f"runs held at once share a GPU: {held}")
        if extra:
            if early:
                found.append(f"{early} started while every GPU was booked")
            detail_wait = f"; the extra run waited ({waiting[0][0].lower()}: {waiting[0][1] or 'no message'})"
        else:
            detail_wait = ""
        detail = "; ".join(found) if found else "; ".join(seen(r) for r in records[:copies]) + detail_wait
        self.add(name, MISMATCH if found else OK, detail, began)
        return records

    def _told_to_wait(self, run_ids: list[str]) -> list[tuple[str, str]]:
        """The runs' states once the worker has said why each waits (it offers them every second and writes its
        reason on the run); after WAIT_REASON_S without one, the states as they are."""
        def states() -> list[tuple[str, str]]:
            return [self.lab.state(run_id) for run_id in run_ids]

        def with_reasons() -> list[tuple[str, str]] | None:
            now = states()
            return now if all(message for _, message in now) else None

        try:
            return wait_for(with_reasons, WAIT_REASON_S, "the worker's reason on each waiting run", interval=0.5)
        except TimeoutError:
            return states()

    def no_gpu(self) -> None:
        """A run that booked no GPU must see none: CUDA_VISIBLE_DEVICES is mn-prefect's, empty for it."""
        self.held_together("no GPU booked, none seen", {"cpu": 1}, 1, 0)

    def one_gpu_each(self) -> None:
        if not self.whole:
            self.report.rows.append(Row("one GPU per run", SKIPPED, "no GPU outside MIG mode"))
            return
        n = len(self.whole)
        self.held_together(f"one GPU per run ({n} at once, one more waits)", {"gpu": 1}, n, 1, extra=1)

    def two_gpus(self) -> None:
        request = {"gpu": 2}
        if len(self.whole) >= 2:
            self.held_together("two GPUs in one run", request, 1, 2)
            return
        began = time.monotonic()
        code, answer = self.lab.plan(request)
        placed = answer.get("status") == "runnable_now"
        self.add("two GPUs in one run", MISMATCH if placed or code == 0 else REFUSED,
                 f"{len(self.whole)} GPU(s) here; plan: {answer.get('status')}: {answer.get('reason')}", began)

    def fractions(self) -> None:
        if not self.whole:
            self.report.rows.append(Row("half a GPU per run", SKIPPED, "no GPU outside MIG mode"))
            return
        request = {"devices": [{"kind": "gpu", "shares": 0.5}]}
        records = self.held_together("half a GPU per run (two at once)", request, 2, 1)
        bad = [r["label"] for r in records if r["shares"].get("MN_GPU_SHARES") != "0.5"]
        if bad:
            self.report.rows.append(Row("fraction hints", MISMATCH, f"{bad} did not get MN_GPU_SHARES=0.5"))

    def mig_slice(self) -> None:
        if not self.slices:
            self.report.rows.append(Row("one MIG slice", SKIPPED, "no GPU in MIG mode"))
            return
        profile = self.slices[0].mig_profile
        records = self.held_together(f"one MIG slice ({profile})", {"devices": [
            {"kind": "gpu", "mig_profile": profile}]}, 1, 1)
        if records and not records[0]["booked"][0].startswith("MIG-"):
            self.report.rows.append(Row("one MIG slice", MISMATCH, f"booked {records[0]['booked']}, not a slice"))


def run_check(home: Path, api_url: str | None, progress: Callable[[str], None]) -> Report:
    from mn_prefect.inventory.nvidia import detect_nvidia

    report = Report()
    devices = detect_nvidia()
    report.machine = {"driver": driver_version(), "cuda_api": devices[0].api_version if devices else None,
                      "mps": mps_state(), "host": os.uname().nodename}
    report.gpus = describe_gpus(devices)
    if not devices:
        report.rows.append(Row("NVIDIA GPUs through NVML", MISMATCH, "NVML reports no GPU on this machine"))
        return report
    progress(f"{len(report.gpus)} GPU(s) found; starting a one-node lab in {home}")
    lab = OneNodeLab(home, api_url)
    try:
        checks = Checks(lab, devices, report, progress)
        checks.registered()
        checks.no_gpu()
        checks.one_gpu_each()
        checks.two_gpus()
        checks.fractions()
        checks.mig_slice()
    finally:
        lab.stop()
    return report


# ----------------------------------------------------------------------------------------------------- printing


def markdown(report: Report) -> str:
    m = report.machine
    lines = [f"Host {m['host']}, driver {m['driver']}, CUDA {m['cuda_api']}; MPS {m['mps']}.", "",
             "| GPU | UUID | model | memory MiB | compute capability | MIG |", "| --- | --- | --- | --- | --- | --- |"]
    for g in report.gpus:
        mig = g["mig"] + (f" ({len(g['slices'])} slices: {', '.join(g['slices'])})" if g["slices"] else "")
        lines.append(f"| {g['index']} | {g['uuid']} | {g['model']} | {g['memory_mb']:g} | "
                     f"{g['compute_capability']} | {mig} |")
    lines += ["", "| check | result | seconds | detail |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.check} | {r.result} | {r.seconds:g} | {r.detail} |" for r in report.rows]
    return "\n".join(lines) + "\n"


def print_tables(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=200)
    m = report.machine
    console.print(f"host {m['host']}, driver {m['driver']}, CUDA {m['cuda_api']}; MPS {m['mps']}")
    gpus = Table(title="GPUs (NVML)", title_justify="left")
    for column in ("index", "uuid", "model", "memory MiB", "compute capability", "MIG"):
        gpus.add_column(column)
    for g in report.gpus:
        gpus.add_row(str(g["index"]), g["uuid"], g["model"] or "", f"{g['memory_mb']:g}",
                     g["compute_capability"] or "?", g["mig"] + "".join(f"\n{s}" for s in g["slices"]))
    console.print(gpus)
    checks = Table(title="checks", title_justify="left")
    for column in ("check", "result", "s", "detail"):
        checks.add_column(column)
    for r in report.rows:
        style = "red" if r.result == MISMATCH else "green" if r.result in (OK, REFUSED) else "yellow"
        checks.add_row(r.check, f"[{style}]{r.result}[/]", f"{r.seconds:g}", r.detail)
    console.print(checks)
    console.print("[red]FAILED[/]" if report.failed else "[green]passed[/]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", type=Path, help="where the lab keeps its files (default: a new temporary folder)")
    parser.add_argument("--api-url", help="use this running Prefect server instead of starting one")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--markdown", type=Path, help="also write the report as Markdown tables to this file")
    args = parser.parse_args(argv)
    home = args.home or Path(tempfile.mkdtemp(prefix="mn-gpu-check-"))
    say = (lambda text: print(text, file=sys.stderr, flush=True))
    try:
        report = run_check(home, args.api_url, say)
    except (TimeoutError, RuntimeError, subprocess.CalledProcessError) as error:
        say(f"gpu-check could not finish: {error} (lab files in {home})")
        return 2
    if args.markdown:
        args.markdown.write_text(markdown(report))
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        print_tables(report)
    return 1 if report.failed else 0
