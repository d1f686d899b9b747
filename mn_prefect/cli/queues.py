"""``mn-prefect queue ...``: quotas, borrowing, weights and priorities of the ``mn`` pool's work queues."""

from __future__ import annotations

import math
import time
from typing import Annotated, Any

import typer
from rich.table import Table

from mn_prefect import events
from mn_prefect.cli import render
from mn_prefect.cli.options import EXIT_REFUSED, JsonFlag, StoreURLArg, open_store_option
from mn_prefect.model.estimates import UNKNOWN, Estimate, duration_words, read_max_runtime
from mn_prefect.model.issues import Issues
from mn_prefect.model.queues import MAX_PRIORITY, QueueSpec, amount_words, check_name, parse_amounts
from mn_prefect.ops.preemption_losses import Losses, losses_by_queue
from mn_prefect.placement.estimates import estimate_for, run_key
from mn_prefect.placement.holding import covered, hold_message, read_holds, running_of
from mn_prefect.scheduler.quotas import Queues, borrowed
from mn_prefect.scheduler.view import ClusterView
from mn_prefect.store.base import StoreError

queue_app = typer.Typer(help="Queues of a shared fleet: each work queue of an mn pool may have a quota per "
                             "dimension, borrow within its cohort, and a weight and priority.", no_args_is_help=True)

NameArg = Annotated[str, typer.Argument(metavar="NAME", help="The work queue's name (as in the Prefect pool).",
                                        show_default=False)]
AMOUNTS_HELP = ("DIMENSION=AMOUNT,...: cpu, memory (MB) or memory_gb, disk or disk_gb, gpu, gpu_memory (MB) or "
                "gpu_memory_gb, gpu:<model> (GPUs whose model contains it)")
WAITING_STATES = ("SCHEDULED", "PENDING")


@queue_app.command("set")
def queue_set(
    name: NameArg,
    quota: Annotated[str | None, typer.Option("--quota", help="What the queue is entitled to: " + AMOUNTS_HELP)] = None,
    borrow: Annotated[str | None, typer.Option(
        "--borrow", help="How far past its quota it may borrow from its cohort (default: whatever the cohort leaves "
                         "unused): " + AMOUNTS_HELP)] = None,
    weight: Annotated[float, typer.Option("--weight", help="Its share when queues compete for the same capacity.")] = 1.0,
    priority: Annotated[int, typer.Option("--priority", help="Its runs' default priority (higher goes first).")] = 0,
    cohort: Annotated[str | None, typer.Option("--cohort", help="The queues it lends to and borrows from.")] = None,
    pool: Annotated[str | None, typer.Option(
        "--pool", help="The mn work pool whose work queue NAME is checked (default: every mn pool).")] = None,
    create: Annotated[bool, typer.Option(
        "--create", help="Create work queue NAME in --pool (or the one mn pool) when it has none.")] = False,
    store_url: StoreURLArg = None,
    as_json: JsonFlag = False,
) -> None:
    """Set a queue's settings (all of them: an option left out takes its default). Its runs' use is kept. Warns
    when no mn pool has a work queue NAME (its settings would never apply), or creates it with --create."""
    issues = Issues()
    check_name(name, "NAME", issues)
    fields: dict[str, Any] = {"name": name, "weight": weight, "priority": priority, "cohort": cohort}
    fields["quota"] = parse_amounts(quota or "", "--quota", issues) or {}
    if borrow is not None:
        fields["borrow"] = parse_amounts(borrow, "--borrow", issues)
    if not math.isfinite(weight) or weight <= 0:  # NaN passes `<= 0` and reached the model's raw message
        issues.add("--weight", f"must be a finite number greater than 0, got {weight:g}")
    if abs(priority) > MAX_PRIORITY:
        issues.add("--priority", f"must be between {-MAX_PRIORITY} and {MAX_PRIORITY}, got {priority}")
    if cohort is not None:
        check_name(cohort, "--cohort", issues, "cohort")
    issues.raise_if_any()
    record = open_store_option(store_url).set_queue(QueueSpec(**fields))
    events.queue_changed("updated", name, record.model_dump(mode="json"))
    work_queue = _work_queue_check(name, pool, create)
    if as_json:
        render.print_json({**record.model_dump(mode="json"), "work_queue": work_queue})
    else:
        render.console.print(f"set queue {name}: {_quota_words(record.spec)}", soft_wrap=True)
        if work_queue["warning"]:
            render.errors.print(f"[yellow]warning[/]: {work_queue['warning']}", soft_wrap=True)
        elif work_queue["created"]:
            render.console.print(f"created work queue {name} in pool {work_queue['created']}", soft_wrap=True)


def _work_queue_check(name: str, pool: str | None, create: bool) -> dict[str, Any]:
    """Whether a Prefect work queue ``name`` exists in ``pool`` (else in any mn pool): ``pools`` holding one,
    ``created`` (the pool it was created in, with ``create``), ``warning`` (what to do; None when all is well)."""
    from prefect.settings import PREFECT_API_URL

    out: dict[str, Any] = {"pools": [], "created": None, "warning": None}
    if not PREFECT_API_URL.value():
        out["warning"] = (f"no Prefect server is configured (PREFECT_API_URL): not checked that a work queue {name} "
                          "exists; its settings apply only to the runs of an mn pool's work queue of that name")
        return out
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterType

    try:
        with get_client(sync_client=True) as client:
            if pool is not None:
                pools = [client.read_work_pool(pool)]
            else:
                pools = client.read_work_pools(work_pool_filter=WorkPoolFilter(type=WorkPoolFilterType(any_=["mn"])))
            out["pools"] = [p.name for p in pools if name in {q.name for q in client.read_work_queues(
                work_pool_name=p.name)}]
            if out["pools"]:
                return out
            names = [p.name for p in pools]
            if create and len(names) == 1:
                client.create_work_queue(name=name, work_pool_name=names[0])
                out["created"], out["pools"] = names[0], [names[0]]
                return out
            where = f"pool {pool}" if pool else ("no mn pool" if not names else f"no mn pool ({', '.join(names)})")
            has = f"{where} has no work queue {name}" if pool else f"{where} has a work queue {name}"
            target = pool or (names[0] if len(names) == 1 else "POOL")
            out["warning"] = (f"{has}: these settings apply to no run until one exists. Create it with "
                              f"`prefect work-queue create {name} --pool {target}`, or run this again with --create"
                              + ("" if pool or len(names) == 1 else f" --pool {target}"))
    except Exception as error:  # the settings are set; the check is advice
        out["warning"] = f"could not check the work queues at {PREFECT_API_URL.value()}: {error}"
    return out


@queue_app.command("delete")
def queue_delete(name: NameArg, store_url: StoreURLArg = None, as_json: JsonFlag = False) -> None:
    """Delete a queue's settings (its runs are then not limited). Refused while its runs hold anything."""
    try:
        open_store_option(store_url).delete_queue(name)
    except StoreError as error:
        if as_json:
            render.print_json({"queue": name, "deleted": False, "reason": str(error)})
        render.errors.print(f"[red]refused[/]: {error}", soft_wrap=True)
        raise typer.Exit(EXIT_REFUSED) from None
    events.queue_changed("deleted", name, {})
    if as_json:
        render.print_json({"queue": name, "deleted": True, "reason": None})
    else:
        render.console.print(f"deleted the settings of queue {name}", soft_wrap=True)


@queue_app.command("list")
def queue_list(store_url: StoreURLArg = None, as_json: JsonFlag = False) -> None:
    """Every queue with settings: quota, what its runs use, borrowed, lent, weight, priority, cohort."""
    queues = open_store_option(store_url).queues()
    rows = [_summary(queues, name) for name in sorted(queues.queues)]
    if as_json:
        render.print_json(rows)
        return
    table = Table(title="queues", title_justify="left")
    for column in ("queue", "quota", "used", "borrowed", "lent", "weight", "priority", "cohort"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["queue"], _amounts(row["quota"]), _amounts(row["used"]), _amounts(row["borrowed"]),
                      _amounts(row["lent"]), f"{row['weight']:g}", str(row["priority"]), row["cohort"] or "-")
    render.console.print(table)


@queue_app.command("status")
def queue_status(
    name: NameArg,
    pool: Annotated[str | None, typer.Option("--pool", help="Only the runs of this work pool.")] = None,
    store_url: StoreURLArg = None,
    as_json: JsonFlag = False,
) -> None:
    """One queue: its quota, use, borrowing and lending, the head-of-line holds standing for its runs (what each
    holds of what its run needs, where, and when the run is expected to start), and each of its runs waiting to be
    placed with why it waits (from the Prefect server configured, when there is one)."""
    store = open_store_option(store_url)
    queues = store.queues()
    status: dict[str, Any] = _summary(queues, name) if name in queues.queues else {"queue": name, "settings": None}
    status["holds"] = queue_holds(store, name)
    status["preemption"] = losses_by_queue(store).get(name, Losses()).as_json()
    waiting, source = _waiting_runs(name, pool, store)
    status["waiting"] = waiting
    status["waiting_from"] = source
    if as_json:
        render.print_json(status)
        return
    if status.get("settings") is None and "quota" not in status:
        render.console.print(f"queue {name} has no settings: its runs are not limited", soft_wrap=True)
    else:
        table = Table(title=f"queue {name}", title_justify="left", show_header=False)
        table.add_column("field")
        table.add_column("value", overflow="fold")
        for field in ("quota", "used", "borrowed", "lent"):
            table.add_row(field, _amounts(status[field]))
        table.add_row("borrow limit", _amounts(status["borrow_limit"]) if status["borrow_limit"] is not None
                      else ("whatever the cohort leaves unused" if status["cohort"] else "none (no cohort)"))
        table.add_row("weight", f"{status['weight']:g}")
        table.add_row("priority", str(status["priority"]))
        table.add_row("cohort", status["cohort"] or "-")
        render.console.print(table)
    lost = status["preemption"]
    if lost["preempted"]:
        render.console.print(
            f"preempted: {lost['preempted']} runs ({lost['checkpointed']} checkpointed, {lost['killed']} killed); "
            f"work done again {lost['lost_gpu_s'] / 3600:.2f} GPU-h, {lost['lost_cpu_s'] / 3600:.2f} CPU-h",
            soft_wrap=True)
    if status["holds"]:
        render.console.print(_holds_table(status["holds"], {run["id"]: run["name"] for run in waiting}))
    runs = Table(title=f"waiting runs ({source})", title_justify="left")
    for column in ("run", "state", "waiting since", "runs for", "why it waits"):
        runs.add_column(column, overflow="fold")
    for run in waiting:
        runs.add_row(run["name"], run["state"], run["since"] or "-", run["estimate_words"], run["why"])
    render.console.print(runs)


def queue_holds(store: Any, queue: str, now: float | None = None) -> list[dict[str, Any]]:
    """The holds standing for runs of ``queue`` (docs/scheduling.md, "Holds and backfill"), oldest expected start
    first: the run held for, per node what the hold holds and of it what is free there already (GPUs), when the
    run is expected to start (epoch seconds, and seconds from ``now``; None: unknown) and the run's waiting reason
    in words, as its worker words it."""
    now = time.time() if now is None else now
    holds = [h for h in read_holds(store).values() if h.queue == queue]
    if not holds:
        return []
    snap = store.snapshot()
    view = ClusterView(snap.columns, (), snap.limits)  # the holds booked: what the held runs' messages read
    running = running_of(store.active_placements())
    out = []
    for hold in sorted(holds, key=lambda h: (h.expected_start is None, h.expected_start or 0.0, h.hold_id)):
        out.append({"hold": hold.hold_id, "run": hold.run_id, "nodes": list(hold.nodes),
                    "held": [{"node": node, "gpus_free": free, "gpus": want} for node, free, want in covered(view, hold)],
                    "expected_start": hold.expected_start,
                    "expected_start_s": None if hold.expected_start is None
                    else round(max(hold.expected_start - now, 0.0), 1),
                    "message": hold_message(hold, view, running, now)})
    return out


def _holds_table(holds: list[dict[str, Any]], names: dict[str, str]) -> Table:
    table = Table(title=f"holds ({len(holds)})", title_justify="left")
    for column in ("run", "nodes", "held of needed", "expected start"):
        table.add_column(column, overflow="fold")
    for h in holds:
        held = ", ".join(f"{x['gpus_free']} of {x['gpus']} GPUs on {x['node']}" if x["gpus"] else f"capacity on {x['node']}"
                         for x in h["held"]) or "-"
        start = "unknown" if h["expected_start_s"] is None else f"in about {duration_words(h['expected_start_s'])}"
        table.add_row(names.get(h["run"], h["run"]), ", ".join(h["nodes"]), held, start)
    return table


def _summary(queues: Queues, name: str) -> dict[str, Any]:
    record = queues.queues[name]
    spec = record.spec
    return {"queue": name, "quota": spec.quota, "used": {d: v for d, v in record.used.items() if v},
            "borrowed": {d: v for d, v in borrowed(record).items() if v}, "lent": {d: v for d, v in queues.lent(name).items() if v},
            "borrow_limit": spec.borrow, "weight": spec.weight, "priority": spec.priority, "cohort": spec.cohort,
            "version": record.version}


def _amounts(amounts: dict[str, float] | None) -> str:
    if not amounts:
        return "-"
    return ", ".join(amount_words(v, d) for d, v in sorted(amounts.items()))


def _quota_words(spec: QueueSpec) -> str:
    parts = [f"quota {_amounts(spec.quota) if spec.quota else 'none (not limited)'}"]
    if spec.cohort:
        parts.append(f"cohort {spec.cohort}, borrowing " + (_amounts(spec.borrow) if spec.borrow is not None
                                                            else "what the cohort leaves unused"))
    parts.append(f"weight {spec.weight:g}, priority {spec.priority}")
    return "; ".join(parts)


def _waiting_runs(queue: str, pool: str | None, store: Any) -> tuple[list[dict[str, Any]], str]:
    """The queue's runs not placed yet, with the reason their worker put on their state and their runtime
    estimate (``_run_estimate``)."""
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        return [], "no Prefect server is configured"
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        WorkPoolFilter,
        WorkPoolFilterName,
        WorkQueueFilter,
        WorkQueueFilterName,
    )
    from prefect.client.schemas.objects import StateType

    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                    any_=[StateType(s) for s in WAITING_STATES]))),
                work_queue_filter=WorkQueueFilter(name=WorkQueueFilterName(any_=[queue])),
                work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])) if pool else None,
                limit=200)
        deployments: dict[Any, dict[str, Any]] = {}
        for run in runs:
            if run.deployment_id is not None and run.deployment_id not in deployments:
                try:
                    deployments[run.deployment_id] = dict(client.read_deployment(run.deployment_id).job_variables
                                                          or {})
                except Exception:  # deleted meanwhile: the run's own variables still say what they say
                    deployments[run.deployment_id] = {}
    except Exception as error:  # the accounts above are still worth showing
        return [], f"could not read the runs from {PREFECT_API_URL.value()}: {error}"
    out = []
    for run in sorted(runs, key=lambda r: r.expected_start_time or r.created or 0):
        estimate = _run_estimate(store, run, {**deployments.get(run.deployment_id, {}), **(run.job_variables or {})})
        message = (run.state.message or "") if run.state else ""
        why = message[len("mn "):] if message.startswith("mn ") else "not looked at by a worker yet"
        since = run.expected_start_time
        out.append({"id": str(run.id), "name": run.name, "state": run.state.name if run.state else "-",
                    "since": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since.timestamp())) if since else None,
                    "why": why, "estimate": estimate.as_json(), "estimate_words": estimate.describe()})
    return out, f"read from {PREFECT_API_URL.value()}"


def _run_estimate(store: Any, run: Any, job_variables: dict[str, Any]) -> Estimate:
    """A waiting run's estimate as its worker makes it: its declared ``max_runtime_seconds``, else its flow's
    timeout (``flow_timeout_seconds``), else learned from its deployment's completed runs. A declared value that is
    no valid runtime is left out here: the worker fails such a run, naming the field."""
    found = Issues()
    declared = read_max_runtime(job_variables.get("max_runtime_seconds"), "max_runtime_seconds", found)
    timeout = read_max_runtime(job_variables.get("flow_timeout_seconds"), "flow_timeout_seconds", found)
    try:
        return estimate_for(store, run_key(run), declared=declared, timeout=timeout,
                            is_limit=job_variables.get("max_runtime_is_limit") is True)
    except Exception:  # the store is away: the accounts above said so already
        return UNKNOWN


@queue_app.command("fair-share")
def queue_fair_share(
    half_life: Annotated[float | None, typer.Option(
        "--half-life", min=0, help="Set the seconds over which a queue's past use halves (0: only what it holds "
                                   "now counts).")] = None,
    store_url: StoreURLArg = None,
    as_json: JsonFlag = False,
) -> None:
    """Who goes next among runs of equal priority: each queue's standing (its dominant share of the fleet, past
    use included, over its weight; lower goes first). With --half-life, set how fast past use is forgotten."""
    from mn_prefect.placement.fair_share import read_usage, set_half_life
    from mn_prefect.scheduler.fairshare import capacity_of, dominant_share

    store = open_store_option(store_url)
    if half_life is not None:
        set_half_life(store, half_life)
    queues, usage = store.queues(), read_usage(store)
    capacity = capacity_of(n.record for n in store.list_nodes())  # as the workers measure it: every node
    rows = []
    for name, record in sorted(queues.queues.items()):
        past = usage.equivalent(name)
        rows.append({"queue": name, "weight": record.spec.weight, "priority": record.spec.priority,
                     "holds": dominant_share(record.used, capacity), "past": dominant_share(past, capacity),
                     "standing": dominant_share({d: record.used.get(d, 0.0) + past.get(d, 0.0) for d in capacity},
                                                capacity) / record.spec.weight})
    rows.sort(key=lambda r: (-r["priority"], r["standing"]))
    if as_json:
        render.print_json({"half_life_s": usage.half_life_s, "queues": rows})
        return
    table = Table(title=f"fair share (past use halves every {render.duration(usage.half_life_s)}); next first",
                  title_justify="left")
    for column in ("queue", "priority", "weight", "holds now", "past use", "standing"):
        table.add_column(column, justify="left" if column == "queue" else "right")
    for r in rows:
        table.add_row(r["queue"], str(r["priority"]), f"{r['weight']:g}", f"{100 * r['holds']:.1f}%",
                      f"{100 * r['past']:.1f}%", f"{r['standing']:.3f}")
    render.console.print(table)


@queue_app.command("policy")
def queue_policy(
    pool: Annotated[str, typer.Option("--pool", help="The mn work pool the policy is for.")],
    deny: Annotated[list[str] | None, typer.Option(
        "--deny", help="Refuse runs whose deployment (flow/deployment), flow or a tag matches a glob pattern, saying "
                       "why: SUBJECT:PATTERN=REASON, e.g. tag:experimental*=no experiments on this pool. Repeat it.")]
    = None,
    tag_priority: Annotated[list[str] | None, typer.Option(
        "--tag-priority", help="The default priority of runs with this tag: TAG=PRIORITY. Repeat it.")] = None,
    holds: Annotated[str | None, typer.Option(
        "--holds", help="on (the default): the first waiting run that does not fit gets a head-of-line hold; off: runs "
                        "that fit go ahead of it (greedy).")] = None,
    max_holds: Annotated[int | None, typer.Option(
        "--max-holds", min=0, max=100, help="Holds standing at once per queue (per pool without queues); default 1.")]
    = None,
    max_preemption_grace: Annotated[float | None, typer.Option(
        "--max-preemption-grace", help="The longest preemption_grace_seconds a run of the pool may ask for, in "
                                       "seconds (default 600); a run asking for more is refused.")] = None,
    idle_gpu_percent: Annotated[float | None, typer.Option(
        "--idle-gpu-percent", help="A booked GPU under this utilisation (percent, 0-100) for --idle-gpu-minutes is "
                                   "idle: mn.device.idle (default 5).")] = None,
    idle_gpu_minutes: Annotated[float | None, typer.Option(
        "--idle-gpu-minutes", help="How long a booked GPU stays under --idle-gpu-percent before it is said idle "
                                   "(default 30, at most 7 days).")] = None,
    clear: Annotated[bool, typer.Option("--clear", help="Remove the pool's policy.")] = False,
    store_url: StoreURLArg = None,
    as_json: JsonFlag = False,
) -> None:
    """A pool's deny-list, default priorities by tag, head-of-line holds, preemption grace and idle GPUs: set them (all at once: what is left out
    is removed or back to its default), or with no option show them. A refused run fails before anything is booked,
    with the rule's reason."""
    from mn_prefect.model.grace import DEFAULT_POOL_MAX_GRACE_S, grace_problem
    from mn_prefect.model.pool_policy import PoolPolicy, parse_deny, parse_tag_priority
    from mn_prefect.store.records import PoolPolicyRecord, get_record, pool_policy_id, put_record

    issues = Issues()
    store = open_store_option(store_url)
    record = get_record(store, pool_policy_id(pool), PoolPolicyRecord)
    if deny or tag_priority or clear or holds is not None or max_holds is not None or max_preemption_grace is not None \
            or idle_gpu_percent is not None or idle_gpu_minutes is not None:
        rules = [r for r in (parse_deny(text, "--deny", issues) for text in deny or ()) if r is not None]
        pairs = [p for p in (parse_tag_priority(text, "--tag-priority", issues) for text in tag_priority or ())
                 if p is not None]
        if holds is not None and holds not in ("on", "off"):
            issues.add("--holds", f"{holds!r} is not on or off")
        grace_issue = None if max_preemption_grace is None else grace_problem(max_preemption_grace)
        if grace_issue is not None:
            issues.add("--max-preemption-grace", grace_issue)
        if idle_gpu_percent is not None and not (math.isfinite(idle_gpu_percent) and 0 <= idle_gpu_percent <= 100):
            issues.add("--idle-gpu-percent", f"must be a percentage from 0 to 100, got {idle_gpu_percent}")
        if idle_gpu_minutes is not None and not (math.isfinite(idle_gpu_minutes) and 0 < idle_gpu_minutes <= 7 * 1440):
            issues.add("--idle-gpu-minutes", f"must be more than 0 and at most 7 days of minutes, got {idle_gpu_minutes}")
        issues.raise_if_any()
        policy = PoolPolicy() if clear else PoolPolicy(
            deny=tuple(rules), tag_priorities=dict(pairs), holds=holds != "off",
            max_holds=1 if max_holds is None else max_holds,
            max_preemption_grace_s=DEFAULT_POOL_MAX_GRACE_S if max_preemption_grace is None else max_preemption_grace,
            **({"idle_gpu_percent": idle_gpu_percent} if idle_gpu_percent is not None else {}),
            **({"idle_gpu_seconds": idle_gpu_minutes * 60} if idle_gpu_minutes is not None else {}))
        record = PoolPolicyRecord(job_id=pool_policy_id(pool), pool=pool, policy=policy)
        put_record(store, record)
        events.queue_changed("policy", pool, {"pool": pool, **policy.model_dump(mode="json")})
    policy = record.policy if record is not None else PoolPolicy()
    if as_json:
        render.print_json({"pool": pool, **policy.model_dump(mode="json")})
        return
    table = Table(title=f"pool {pool}: deny-list and priorities by tag", title_justify="left")
    for column in ("rule", "effect"):
        table.add_column(column, overflow="fold")
    for rule in policy.deny:
        table.add_row(f"deny {rule}", rule.reason)
    for tag, priority in sorted(policy.tag_priorities.items()):
        table.add_row(f"tag {tag}", f"default priority {priority}")
    table.add_row("holds", f"on, at most {policy.max_holds} per queue (per pool without queues)" if policy.holds
                  else "off: runs that fit go ahead of a waiting run that does not")
    table.add_row("preemption grace", f"at most {policy.max_preemption_grace_s:g} s")
    table.add_row("idle GPUs", f"booked and under {policy.idle_gpu_percent:g}% for "
                               f"{duration_words(policy.idle_gpu_seconds)}: mn.device.idle")
    if not policy.deny and not policy.tag_priorities:
        table.add_row("-", "no policy: every run is admitted, priorities come from runs and queues")
    render.console.print(table)
