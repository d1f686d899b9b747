"""An independent check of a store's bookings: recomputes everything from the raw rows it holds.

It shares no arithmetic with the commit path: usage is summed again from the booked placements, and every
held device and port is matched against exactly one live job. GPUs are checked as docs/resources.md words it: a
GPU's fractions add up to at most one GPU and its memory; a GPU held whole is not shared and gives no slices.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from mn_prefect.scheduler.ports import family

TOLERANCE = 1e-6


def audit(view: dict) -> list[str]:
    """Problems found in a consistent view (``store.consistent_view()``); an empty list means sound."""
    problems: list[str] = []
    nodes = view["nodes"]
    limits = view["limits"]
    used: dict[str, Counter] = defaultdict(Counter)
    devices: dict[tuple[str, str], list[str]] = defaultdict(list)
    ports: dict[tuple[str, str], list[str]] = defaultdict(list)
    shared: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)  # (node, gpu) -> (shares, MB)
    slices: dict[tuple[str, str], list[str]] = defaultdict(list)  # (node, parent gpu) -> jobs holding its slices
    inner: dict[tuple[str, str], Counter] = defaultdict(Counter)  # (node, reservation) -> what runs inside use
    holding: dict[str, Counter] = defaultdict(Counter)  # node -> what holds book there (past capacity, by design)
    for job, placements in view["bookings"].items():
        for p in placements:
            if p.node not in nodes:
                problems.append(f"job {job} holds capacity on unknown node {p.node}")
                continue
            # A run inside a reservation uses the reservation's capacity, in its own space on the node.
            counts = inner[(p.node, p.reservation)] if p.reservation else used[p.node]
            space = f"{p.reservation}/" if p.reservation else ""
            for each in (counts, holding[p.node]) if p.hold else (counts,):
                each["cpu"] += p.resources.cpu_cores
                each["mem"] += p.resources.memory_mb
                each["disk"] += p.resources.disk_mb
                each["gpu"] += p.resources.gpu_count
            fractions = {s.id: s for s in p.allocation.shares}
            for d in p.allocation.devices:
                if d.id in fractions:
                    shared[(p.node, space + d.id)].append((fractions[d.id].shares, fractions[d.id].memory_mb))
                    continue
                devices[(p.node, space + d.id)].append(job)
                if d.parent is not None:
                    slices[(p.node, space + d.parent)].append(job)
            for port in p.allocation.ports:
                ports[(p.node, f"{family(port.protocol)}:{port.port}")].append(job)
    for name, info in nodes.items():
        record = info["record"]
        pct = limits.for_node(name)
        capacity = {"cpu": record.cpu_cores * pct["cpu"] / 100, "mem": record.memory_mb * pct["memory"] / 100,
                    "disk": record.disk_mb * pct["disk"] / 100,
                    "gpu": math.floor(len(record.gpu_devices) * pct["gpu"] / 100 + 1e-9)}
        for key, cap in capacity.items():
            # A hold books past capacity on purpose; what runs hold (the hold's capacity taken over included) may not.
            running = used[name][key] - holding[name][key]
            if running > cap + TOLERANCE:
                problems.append(f"node {name} over capacity: {key} {running:g} > {cap:g}")
            if abs(used[name][key] - info[key]) > 1e-3:
                problems.append(f"node {name} usage counter {key}={info[key]:g} but bookings sum to {used[name][key]:g}")
        node_ids = {d.id for d in record.devices}
        for node, device_id in devices:
            if node == name and device_id.rsplit("/", 1)[-1] not in node_ids:
                problems.append(f"device {device_id} booked on {name}, which does not have it")
    problems += _reservation_problems(view, nodes, inner)
    for (node, device_id), jobs in devices.items():
        if len(jobs) > 1:
            problems.append(f"device {node}/{device_id} held by {len(jobs)} placements: {sorted(jobs)}")
    problems += _gpu_problems(nodes, devices, shared, slices)
    for (node, key), jobs in ports.items():
        if len(jobs) > 1:
            problems.append(f"port {node}/{key} held by {len(jobs)} placements: {sorted(jobs)}")
    held: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for kind, node, key, job in view["held"]:
        held[(kind, node, key)].append(job)
    live = set(view["bookings"])
    for (kind, node, key), jobs in held.items():
        if len(jobs) != 1:
            problems.append(f"{kind} {node}/{key} has {len(jobs)} holders")
        for job in jobs:
            if job not in live:
                problems.append(f"{kind} {node}/{key} held by {job}, which has no live booking")
    expected = {("device", n, k): j[0] for (n, k), j in devices.items()}
    expected.update({("port", n, k): j[0] for (n, k), j in ports.items()})
    for where, job in expected.items():
        holders = held.get(where)
        if holders != [job]:
            problems.append(f"{where[0]} {where[1]}/{where[2]} booked by {job} but held by {holders}")
    return problems


def _gpu_problems(nodes: dict, devices: dict[tuple[str, str], list[str]],
                  shared: dict[tuple[str, str], list[tuple[float, float]]],
                  slices: dict[tuple[str, str], list[str]]) -> list[str]:
    """Fractions within one GPU's shares and memory; never a GPU both whole and shared, or whole and sliced; the
    store's per-GPU counters (``share:``, ``gmem:``) equal to what the bookings say."""
    problems = []
    for (node, gpu), parts in shared.items():
        total_shares = sum(s for s, _ in parts)
        memory = sum(m for _, m in parts)
        if total_shares > 1 + TOLERANCE:
            problems.append(f"GPU {node}/{gpu} shared beyond one GPU: shares add up to {total_shares:g}")
        record = nodes[node]["record"] if node in nodes else None
        size = next((d.memory_total_mb for d in record.devices if d.id == gpu), None) if record else None
        if size is not None and memory > size + TOLERANCE:
            problems.append(f"GPU {node}/{gpu} memory overbooked: fractions hold {memory:g} of {size:g} MB")
        if devices.get((node, gpu)):
            problems.append(f"GPU {node}/{gpu} is both held whole and shared")
    for (node, gpu), jobs in slices.items():
        if devices.get((node, gpu)):
            problems.append(f"GPU {node}/{gpu} is held whole while {len(jobs)} of its MIG slices are held")
    for name, info in nodes.items():
        for gpu in {d.id for d in info["record"].devices}:
            whole = 1.0 if devices.get((name, gpu)) and not _is_slice(info["record"], gpu) else 0.0
            want = whole + sum(s for s, _ in shared.get((name, gpu), []))
            if abs(info.get(f"share:{gpu}", 0.0) - want) > 1e-3:
                problems.append(f"node {name} counter share:{gpu}={info.get(f'share:{gpu}', 0.0):g} "
                                f"but bookings sum to {want:g}")
            memory = sum(m for _, m in shared.get((name, gpu), []))
            if abs(info.get(f"gmem:{gpu}", 0.0) - memory) > 1e-3:
                problems.append(f"node {name} counter gmem:{gpu}={info.get(f'gmem:{gpu}', 0.0):g} "
                                f"but bookings sum to {memory:g}")
    return problems


def _reservation_problems(view: dict, nodes: dict, inner: dict[tuple[str, str], Counter]) -> list[str]:
    """Runs inside a live reservation within what it holds on their node; each reservation's counters
    (``rsv:<id>:cpu``...) equal to what its runs book. Runs inside one that has ended hold nothing to check."""
    problems = []
    for (node, reservation), counts in inner.items():
        held = [p for p in view["bookings"].get(reservation, []) if p.reserves == reservation and p.node == node]
        if held:
            holds = {"cpu": sum(p.resources.cpu_cores for p in held), "mem": sum(p.resources.memory_mb for p in held),
                     "disk": sum(p.resources.disk_mb for p in held), "gpu": sum(p.resources.gpu_count for p in held)}
            for key, cap in holds.items():
                if counts[key] > cap + TOLERANCE:
                    problems.append(f"runs inside reservation {reservation} on {node} use {key} {counts[key]:g} "
                                    f"> the {cap:g} it holds")
        for key, amount in counts.items():
            counter = nodes[node].get(f"rsv:{reservation}:{key}", 0.0)
            if abs(counter - amount) > 1e-3:
                problems.append(f"node {node} counter rsv:{reservation}:{key}={counter:g} but bookings sum to "
                                f"{amount:g}")
    return problems


def _is_slice(record, device_id: str) -> bool:
    return any(d.id == device_id and d.parent is not None for d in record.devices)


def audit_queues(queues, bookings: dict | None = None) -> list[str]:
    """Problems with the queues' accounts (``store.queues()``): a queue past its quota and borrowing limit, a
    cohort past the sum of its queues' quotas; with ``bookings`` (job -> placements, read after the accounts
    with nothing committed between), a queue's CPU, memory, disk and GPU counters that differ from what its
    live bookings hold, summed again here from their placements."""
    problems: list[str] = []
    for name, record in sorted(queues.queues.items()):
        spec = record.spec
        for dim, quota in spec.quota.items():
            limit = spec.borrow_limit(dim)
            ceiling = quota + (math.inf if limit is None else limit)
            if record.used.get(dim, 0.0) > ceiling + TOLERANCE:
                problems.append(f"queue {name} over quota: {dim} {record.used[dim]:g} > {ceiling:g}")
    for name, cohort in sorted(queues.cohorts.items()):
        for dim, amount in cohort.nominal.items():
            if cohort.used.get(dim, 0.0) > amount + TOLERANCE:
                problems.append(f"cohort {name} over its queues' quotas: {dim} {cohort.used[dim]:g} > {amount:g}")
    if bookings is None:
        return problems
    held: dict[str, Counter] = defaultdict(Counter)
    for placements in bookings.values():
        for p in placements:
            if p.queue in queues.queues:
                r = p.resources
                whole = sum(1 for d in p.allocation.devices if d.kind == "gpu") - len(p.allocation.shares)
                held[p.queue].update({"cpu": r.cpu_cores, "memory": r.memory_mb, "disk": r.disk_mb,
                                      "gpu": max(whole + sum(s.shares for s in p.allocation.shares), r.gpu_count)})
    for name, record in sorted(queues.queues.items()):
        for dim in ("cpu", "memory", "disk", "gpu"):
            if abs(record.used.get(dim, 0.0) - held[name][dim]) > 1e-3:
                problems.append(f"queue {name} counter {dim}={record.used.get(dim, 0.0):g} but its bookings hold "
                                f"{held[name][dim]:g}")
    return problems
