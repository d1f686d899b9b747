"""The cluster as the scheduler sees it: node records, capacity arrays and bookings.

Speed comes from structure (see BENCHMARKS.md): nodes are grouped into classes of identical static
attributes so the static checks run once per class and ask shape; capacity and scores are numpy vectors
over all nodes; ports and devices, the only per-node Python work, are checked on the best candidates only.
"""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Literal, TypeVar

import numpy as np

from mn_prefect.model.node import Device, NodeRecord
from mn_prefect.model.placement import Allocation, DeviceShare, Placement, PortAllocation, VolumeAllocation
from mn_prefect.model.resources import DeviceRequest
from mn_prefect.scheduler import reasons
from mn_prefect.scheduler.admission import EPSILON, admission_reason, capacity_shortfall
from mn_prefect.scheduler.ask import Ask, ShapeKey
from mn_prefect.scheduler.classes import StaticInfo, fleet_for, fleet_of
from mn_prefect.scheduler.columns import FleetColumns, NodeColumns, limited
from mn_prefect.scheduler.devices import (
    amounts_of,
    describe,
    device_amounts,
    fits_by_memory,
    held_whole,
    pick_devices,
    whole_ids,
)
from mn_prefect.scheduler.feasibility import ESCAPED_CONSTRAINTS, device_requests
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.ports import family, pick_ports
from mn_prefect.scheduler.quotas import Queues
from mn_prefect.scheduler.ranking import score_few, score_nodes, score_rows
from mn_prefect.scheduler.volumes import check_volumes

# Up to this many nodes changed since a ranking was brought up to date, it catches up in plain floats (``_rank_few``).
FEW_NODES = 16

# One booking on a node, as ``book`` returns it and ``unbook`` takes it back: (node index, CPU cores, memory MB,
# disk MB, GPUs, (port family, port) pairs, device ids held whole, per-device dimensions (scheduler/devices.py)).
Booking = tuple[int, float, float, float, int, list[tuple[str, int]], list[str], dict[str, float]]


_Item = TypeVar("_Item")


class PerNode(dict[int, _Item]):
    """Per node index, what is booked there beyond the scalars (ports, devices held, device amounts), built on
    first use by ``settle``: a view of a large cluster reads these for the few nodes it tries, not for all."""

    def __init__(self, settle: Callable[[int], None]):
        super().__init__()
        # Weak: a view is freed as soon as it is dropped (its arrays' memory reused at once), not by the cycle
        # collector some plans later.
        self._settle = weakref.WeakMethod(settle)

    def __missing__(self, i: int) -> _Item:
        settle = self._settle()
        assert settle is not None  # the view lives while its maps are used
        settle(i)
        return dict.__getitem__(self, i)


_NODE = attrgetter("node")
_RESOURCES = attrgetter("resources")
_ALLOCATION = attrgetter("allocation")
_CPU, _MEMORY, _DISK, _GPU = (attrgetter(name) for name in ("cpu_cores", "memory_mb", "disk_mb", "gpu_count"))


def _add_amounts(used: dict[str, float], amounts: dict[str, float], sign: float) -> None:
    """Add (``sign`` 1) or take back (-1) a booking's per-device dimensions; a dimension back at zero is dropped."""
    for dim, amount in amounts.items():
        value = used.get(dim, 0.0) + sign * amount
        if value > EPSILON:
            used[dim] = value
        else:
            used.pop(dim, None)


@dataclass(slots=True)
class Ranking:
    """One ask shape's ``candidates`` over all nodes, as of the ``seen`` first entries of the view's change log."""

    seen: int
    fit: np.ndarray  # bool per node: static checks and capacity pass
    scores: np.ndarray  # per node; -inf where not ``fit`` (so one argmax finds the best candidate)
    wants_devices: bool  # the score counted GPUs (ranking.py)


@dataclass(slots=True)
class Choice:
    """A node chosen for one ask, with what it books there."""

    ask: Ask
    node: int
    score: float
    ports: list[PortAllocation]
    devices: list[Device]
    volumes: list[VolumeAllocation]
    runtime_driver: str | None
    gpu: int
    shares: list[DeviceShare] = field(default_factory=list)
    preferred: Literal["honored", "fallback"] | None = None
    token: Booking | None = None  # the booking, once booked


class ClusterView:
    """Nodes plus active bookings; ``book``/``unbook`` keep the arrays and sets in step."""

    def __init__(self, nodes: Iterable[NodeRecord] | NodeColumns | FleetColumns, active: Iterable[Placement] = (),
                 limits: Limits | None = None, queues: Queues | None = None):
        """``nodes``: node records, or columns (scheduler/columns.py): from a store snapshot (``FleetColumns``),
        they hold what is held there, ``active`` is held on top, and ``limits`` default to theirs."""
        # The queues' settings and use, ``active`` already counted in them (scheduler/quotas.py); ``hold`` and
        # ``unhold`` charge and refund a queue from then on.
        self.queues = queues
        held: FleetColumns | None = None
        if isinstance(nodes, FleetColumns):
            held = nodes
            self.fleet = fleet = fleet_for(nodes.nodes)
        elif isinstance(nodes, NodeColumns):
            self.fleet = fleet = fleet_for(nodes)
        else:
            self.fleet = fleet = fleet_of(nodes if isinstance(nodes, (list, tuple)) else list(nodes))
        self.nodes: list[NodeRecord] = fleet.nodes
        self.index = fleet.index
        # Rows CPU cores, memory MB, GPUs, disk MB: the first three are what the rankers score (``_rank``). The
        # capacity under the limits is read-only (kept on the columns); columns from a store snapshot hand over
        # what is free under their limits, and what is held per node on demand beyond the scalars (``_settle``).
        if held is not None and (limits is None or limits is held.limits or limits == held.limits):
            self.limits = held.limits
            self._cap_rows, self._free_rows = held.capacity, held.free.copy()
        else:
            self.limits = limits or Limits()
            self._cap_rows = limited(fleet.columns, self.limits)
            self._free_rows = self._cap_rows.copy() if held is None else self._cap_rows - held.used
        self._holding = held.holding if held is not None else None
        self.cap_cpu, self.cap_mem, self.cap_gpu, self.cap_disk = self._cap_rows
        self.free_cpu, self.free_mem, self.free_gpu, self.free_disk = self._free_rows
        self.devices: list[dict[str, Device]] = fleet.devices
        # Per node, built on first use from the allocations held there (``_settle``): the node of each active
        # placement, and its allocation.
        self._held_rows = np.zeros(0, dtype=np.int64)
        self._held: list[Allocation] = []
        self.ports_used: PerNode[set[tuple[str, int]]] = PerNode(self._settle)
        self.devices_held: PerNode[set[str]] = PerNode(self._settle)
        self.devices_used: PerNode[dict[str, float]] = PerNode(self._settle)  # per-device dimensions booked
        # Grows with every booking change on a node: the device fit of an ask shape is recomputed only where the
        # node changed since it was last computed (see ``_fit``).
        self.stamp = np.zeros(len(self.nodes), dtype=np.int64)
        self._fits: dict[ShapeKey, tuple[np.ndarray, np.ndarray]] = {}
        # Nodes whose free scalars changed, in order (``book``/``unbook``): a ranking of one ask shape catches up
        # on the nodes changed since it was computed (``_ranking``).
        self._changed: list[int] = []
        self._rankings: dict[tuple[ShapeKey, str], Ranking] = {}
        self.class_of = fleet.class_of
        self.class_members = fleet.class_members  # a representative node per class
        self._hold_all(active)

    # -- bookings ---------------------------------------------------------------------------------

    def _token(self, placement: Placement) -> Booking | None:
        i = self.index.get(placement.node)
        if i is None:
            return None
        r = placement.resources
        known = self.devices[i]
        devices = [d for d in held_whole(placement.allocation) if d in known]
        amounts = device_amounts(placement.allocation)
        ports = [(family(p.protocol), p.port) for p in placement.allocation.ports]
        return (i, r.cpu_cores, r.memory_mb, r.disk_mb, r.gpu_count, ports, devices, amounts)

    def hold(self, placement: Placement) -> None:
        """Count an existing placement against its node (unknown nodes hold nothing here)."""
        token = self._token(placement)
        if token is not None:
            self.book(*token)
        self._charge(placement, 1)

    def _charge(self, placement: Placement, sign: int) -> None:
        if self.queues is not None and placement.queue:
            self.queues.add(placement.queue, self.queues.amounts(placement.queue, [placement]), sign)

    def _hold_all(self, placements: Iterable[Placement]) -> None:
        """``hold`` for many placements: each scalar goes into its array in one call (``np.subtract.at`` subtracts
        in order, as ``book`` would one by one); ports and devices are kept aside until their node is first
        looked at (``_settle``)."""
        held = placements if isinstance(placements, (list, tuple)) else list(placements)
        rows = list(map(self.index.get, map(_NODE, held)))
        if None in rows:  # placements on nodes this view does not have hold nothing here
            held = [p for p, i in zip(held, rows, strict=True) if i is not None]
            rows = [i for i in rows if i is not None]
        if not rows:
            return
        self._held_rows = np.array(rows, dtype=np.int64)
        self._held = list(map(_ALLOCATION, held))
        resources = list(map(_RESOURCES, held))
        for free, amount in ((self.free_cpu, _CPU), (self.free_mem, _MEMORY), (self.free_disk, _DISK),
                             (self.free_gpu, _GPU)):
            np.subtract.at(free, self._held_rows, np.fromiter(map(amount, resources), dtype=float, count=len(rows)))

    def _settle(self, i: int) -> None:
        """Build node ``i``'s ports, devices held and device amounts from the allocations held there."""
        ports: set[tuple[str, int]] = set()
        held: set[str] = set()
        used: dict[str, float] = {}
        known = self.devices[i]
        base = self._holding(i) if self._holding is not None else None
        if base is not None:  # held in the columns, before ``active``, as when their holds come first
            devices, shares, pairs = base
            ports.update(pairs)
            if devices or shares:
                held.update(d for d in whole_ids(devices, shares) if d in known)
                _add_amounts(used, amounts_of(devices, shares), 1.0)
        for k in np.flatnonzero(self._held_rows == i).tolist():
            allocation = self._held[k]
            ports.update([(family(p.protocol), p.port) for p in allocation.ports])
            if allocation.devices or allocation.shares:
                held.update(d for d in held_whole(allocation) if d in known)
                _add_amounts(used, device_amounts(allocation), 1.0)
        dict.__setitem__(self.ports_used, i, ports)
        dict.__setitem__(self.devices_held, i, held)
        dict.__setitem__(self.devices_used, i, used)

    def unhold(self, placement: Placement) -> None:
        """Undo ``hold`` (a placement released while this view lives on)."""
        token = self._token(placement)
        if token is not None:
            self.unbook(token)
        self._charge(placement, -1)

    def book(self, i: int, cpu: float, mem: float, disk: float, gpu: int,
             ports: Iterable[tuple[str, int]] = (), devices: Iterable[str] = (),
             amounts: dict[str, float] | None = None) -> Booking:
        self.free_cpu[i] -= cpu
        self.free_mem[i] -= mem
        self.free_disk[i] -= disk
        self.free_gpu[i] -= gpu
        self._changed.append(i)
        ports, devices, amounts = list(ports), list(devices), amounts or {}
        self.ports_used[i].update(ports)
        self.devices_held[i].update(devices)
        self._add_device_amounts(i, amounts, 1.0)
        return (i, cpu, mem, disk, gpu, ports, devices, amounts)

    def unbook(self, token: Booking) -> None:
        i, cpu, mem, disk, gpu, ports, devices, amounts = token
        self.free_cpu[i] += cpu
        self.free_mem[i] += mem
        self.free_disk[i] += disk
        self.free_gpu[i] += gpu
        self._changed.append(i)
        self.ports_used[i].difference_update(ports)
        self.devices_held[i].difference_update(devices)
        self._add_device_amounts(i, amounts, -1.0)

    def _add_device_amounts(self, i: int, amounts: dict[str, float], sign: float) -> None:
        if amounts:
            self.stamp[i] += 1
        _add_amounts(self.devices_used[i], amounts, sign)

    def book_choice(self, choice: Choice) -> Booking:
        r = choice.ask.request
        choice.token = self.book(choice.node, r.cpu_cores, r.memory_mb, r.disk_mb, choice.gpu,
                                 [(family(p.protocol), p.port) for p in choice.ports],
                                 whole_ids(choice.devices, choice.shares), amounts_of(choice.devices, choice.shares))
        return choice.token

    def admit(self, placement: Placement) -> str | None:
        """Re-check a planned placement against the bookings held now and book it; a reason if it no longer fits
        (``admission_reason``, the rule the store's commit applies too)."""
        i = self.index.get(placement.node)
        if i is None:
            return reasons.reason(reasons.UNKNOWN_NODE, placement.node)
        why = admission_reason(self.nodes[i], self._cap(i), self._free(i), self.devices[i], self.devices_held[i],
                               self.ports_used[i], placement, self.devices_used[i])
        if why is None:
            self.hold(placement)
        return why

    def _cap(self, i: int) -> tuple[float, float, float, float]:
        return (float(self.cap_cpu[i]), float(self.cap_mem[i]), float(self.cap_disk[i]), float(self.cap_gpu[i]))

    def _free(self, i: int) -> tuple[float, float, float, float]:
        return (float(self.free_cpu[i]), float(self.free_mem[i]), float(self.free_disk[i]), float(self.free_gpu[i]))

    # -- static feasibility -------------------------------------------------------------------------

    def static_info(self, ask: Ask) -> StaticInfo:
        """Static feasibility of ``ask`` per node, shared by every view of the same records (``Fleet``)."""
        return self.fleet.static_info(ask)

    # -- dynamic checks -----------------------------------------------------------------------------

    def capacity_reason(self, i: int, cpu: float, mem: float, disk: float, gpu: int) -> str | None:
        return capacity_shortfall(self._cap(i), self._free(i), (cpu, mem, disk, gpu))

    def try_node(self, i: int, ask: Ask, implied: int) -> tuple[Choice | None, str | None]:
        """Ports and devices on node ``i`` (static checks and capacity already passed)."""
        node = self.nodes[i]
        ports: list[PortAllocation] = []
        if ask.request.ports:
            picked, why = pick_ports(ask.request.ports, self.ports_used[i], node.dynamic_port_range)
            if picked is None:
                return None, why
            ports = picked
        devices: list[Device] = []
        shares: list[DeviceShare] = []
        requests = device_requests(node, ask) if implied else ask.request.devices
        if requests:
            chosen, failing, found = pick_devices(requests, node.devices, self.devices_held[i], self.devices_used[i],
                                                  positions=self._positions(i, requests))
            if chosen is None:
                assert failing is not None  # pick_devices names the request that failed
                return None, reasons.reason(reasons.MISSING_DEVICES,
                                            f"{describe(failing)}: {found} of {failing.count} free")
            devices, shares = chosen.devices, chosen.shares
        volumes, _ = check_volumes(ask.request.volumes, node.host_paths) if ask.request.volumes else ([], None)
        first_driver = node.runtime_drivers[0] if node.runtime_drivers else None
        driver = ask.request.runtime_driver or ("host_local" if "host_local" in node.runtime_drivers else first_driver)
        return Choice(ask=ask, node=i, score=0.0, ports=ports, devices=devices, volumes=volumes or [],
                      runtime_driver=driver, gpu=ask.request.gpu_count + implied, shares=shares), None

    def explain(self, i: int, ask: Ask) -> str | None:
        """The first reason, in the order of docs/scheduling.md, why node ``i`` cannot take ``ask`` now; None if it
        can."""
        info = self.static_info(ask)
        static: tuple[int, str] | None = info.class_failure[self.class_of[i]]
        escaped = info.escaped_failure.get(i)
        if escaped is None and ask.escaped_constraints and (static is None or static[0] > reasons.STAGE_CONSTRAINTS):
            escaped = ESCAPED_CONSTRAINTS.check(self.nodes[i], ask)
        if escaped is not None and (static is None or static[0] > reasons.STAGE_CONSTRAINTS):
            static = (reasons.STAGE_CONSTRAINTS, escaped)
        if static is not None and static[0] < reasons.STAGE_CAPACITY:
            return static[1]
        implied = int(info.implied_gpu[i])
        r = ask.request
        why = self.capacity_reason(i, r.cpu_cores, r.memory_mb, r.disk_mb, r.gpu_count + implied)
        if why is not None:
            return why
        if static is not None and static[0] < reasons.STAGE_PORTS:
            return static[1]
        if r.ports:
            _, why = pick_ports(r.ports, self.ports_used[i], self.nodes[i].dynamic_port_range)
            if why is not None:
                return why
        if static is not None:
            return static[1]
        _, why = self.try_node(i, ask, implied)
        return why

    # -- placement ----------------------------------------------------------------------------------

    def candidates(self, asks: list[Ask], strategy: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Nodes passing static checks and capacity for all ``asks`` together, best first, with scores
        and the per-node implied GPU total."""
        mask: np.ndarray | None = None
        implied: np.ndarray | None = None
        cpu = mem = disk = 0.0
        gpu = 0
        for ask in asks:
            info = self.static_info(ask)
            mask = info.mask if mask is None else mask & info.mask
            implied = info.implied_gpu if implied is None else implied + info.implied_gpu
            cpu += ask.request.cpu_cores
            mem += ask.request.memory_mb
            disk += ask.request.disk_mb
            gpu += ask.request.gpu_count
        assert mask is not None and implied is not None  # asks is never empty
        gpu_need = implied + gpu
        fit = (mask & (self.free_cpu >= cpu - EPSILON) & (self.free_mem >= mem - EPSILON)
               & (self.free_disk >= disk - EPSILON) & (self.free_gpu >= gpu_need))
        idx = np.flatnonzero(fit)
        if not len(idx):
            return idx, np.zeros(0), gpu_need
        wants_devices = bool(gpu) or bool(implied[idx].any()) or any(a.request.devices for a in asks)
        scores = score_nodes(
            strategy,
            free_cpu=self.free_cpu[idx], cap_cpu=self.cap_cpu[idx], free_mem=self.free_mem[idx],
            cap_mem=self.cap_mem[idx], free_gpu=self.free_gpu[idx], cap_gpu=self.cap_gpu[idx],
            cpu=cpu, mem=mem, gpu=gpu_need[idx], wants_devices=wants_devices,
        )
        return idx, scores, gpu_need

    def _ranking(self, ask: Ask, strategy: str) -> Ranking:
        """``candidates`` for one ask, kept per ask shape and strategy over all nodes, and brought up to date on
        the nodes booked or released since (the same arithmetic on those nodes only) when they are a few
        (FEW_NODES) or an eighth of the fleet at most; else ranked anew."""
        key = (ask.capacity_key, strategy)
        ranking = self._rankings.get(key)
        changed = self._changed
        if ranking is not None and len(changed) - ranking.seen <= max(len(self.nodes) // 8, FEW_NODES):
            if ranking.seen < len(changed):
                nodes = sorted(set(changed[ranking.seen:]))
                ranking.seen = len(changed)
                if (self._rank_few(ask, strategy, ranking, nodes) if len(nodes) <= FEW_NODES
                        else self._rank(ask, strategy, ranking, np.array(nodes, dtype=np.int64))):
                    return ranking
            else:
                return ranking
        if len(changed) > 8 * len(self.nodes) + 4096:
            self._rankings.clear()  # every ranking recomputes from here: the log can start again
            changed.clear()
        elif len(self._rankings) > 256:
            self._rankings.clear()
        ranking = Ranking(seen=len(changed), fit=np.zeros(0, dtype=bool), scores=np.zeros(0), wants_devices=False)
        self._rank(ask, strategy, ranking, None)
        self._rankings[key] = ranking
        return ranking

    def _rank(self, ask: Ask, strategy: str, ranking: Ranking, nodes: np.ndarray | None) -> bool:
        """Fit and scores of ``nodes`` (all when None) into ``ranking``; False when the device term of the score
        changes (an ask implied a GPU on no candidate any more, or again): then every node is scored anew."""
        info = self.static_info(ask)
        r = ask.request
        at: slice | np.ndarray = slice(None) if nodes is None else nodes
        free, cap = ((self._free_rows, self._cap_rows) if nodes is None
                     else (self._free_rows[:, nodes], self._cap_rows[:, nodes]))
        gpu_need: int | np.ndarray
        if info.implies_any:
            gpu_need = info.implied_gpu[at] + r.gpu_count
            fit = (info.mask[at] & (free[0] >= r.cpu_cores - EPSILON) & (free[1] >= r.memory_mb - EPSILON)
                   & (free[3] >= r.disk_mb - EPSILON) & (free[2] >= gpu_need))
        else:  # the same four comparisons, as one
            gpu_need = r.gpu_count
            need = np.array([[r.cpu_cores - EPSILON], [r.memory_mb - EPSILON], [gpu_need], [r.disk_mb - EPSILON]])
            fit = info.mask[at] & (free >= need).all(axis=0)
        if nodes is None:
            ranking.fit = fit
        else:
            ranking.fit[nodes] = fit
        wants = bool(r.gpu_count) or bool(r.devices) or (info.implies_any and bool(info.implied_gpu[ranking.fit].any()))
        if nodes is not None and wants != ranking.wants_devices:
            return False
        ranking.wants_devices = wants
        fitting = np.flatnonzero(fit) if nodes is None else None
        if fitting is not None and len(fitting) < 0.75 * len(fit):
            # Scored where the ask fits only (elsewhere -inf): the same values, and fewer powers to compute.
            ranking.scores = np.full(len(fit), -np.inf)
            if len(fitting):
                ranking.scores[fitting] = score_rows(
                    strategy, np.take(free[:3], fitting, axis=1), np.take(cap[:3], fitting, axis=1), cpu=r.cpu_cores,
                    mem=r.memory_mb, gpu=gpu_need[fitting] if isinstance(gpu_need, np.ndarray) else gpu_need,
                    wants_devices=wants)
            return True
        scores = np.where(fit, score_rows(strategy, free[:3], cap[:3], cpu=r.cpu_cores, mem=r.memory_mb, gpu=gpu_need,
                                          wants_devices=wants), -np.inf)
        if nodes is None:
            ranking.scores = scores
        else:
            ranking.scores[nodes] = scores
        return True

    def _rank_few(self, ask: Ask, strategy: str, ranking: Ranking, nodes: list[int]) -> bool:
        """``_rank`` for a handful of nodes in plain floats: the same comparisons, and the same arithmetic
        (``score_few``), so fit and scores are those ``_rank`` would give; a dozen fewer array calls."""
        info = self.static_info(ask)
        r = ask.request
        free = self._free_rows[:, nodes].tolist()
        cpu, mem, disk = r.cpu_cores - EPSILON, r.memory_mb - EPSILON, r.disk_mb - EPSILON
        implied = info.implied_gpu
        gpu_need = [int(implied[i]) + r.gpu_count for i in nodes] if info.implies_any else [r.gpu_count] * len(nodes)
        mask, fit = info.mask, ranking.fit
        fitting: list[int] = []  # positions into ``nodes``
        for j, i in enumerate(nodes):
            ok = bool(mask[i]) and free[0][j] >= cpu and free[1][j] >= mem and free[3][j] >= disk and free[2][j] >= gpu_need[j]
            fit[i] = ok
            if ok:
                fitting.append(j)
        wants = bool(r.gpu_count) or bool(r.devices) or (info.implies_any and bool(implied[fit].any()))
        if wants != ranking.wants_devices:
            return False
        out = ranking.scores
        for i in nodes:
            out[i] = -np.inf
        if fitting:
            chosen = [nodes[j] for j in fitting]
            cap = self._cap_rows[:3, chosen].tolist()
            rows = [[row[j] for j in fitting] for row in free[:3]]
            scores = score_few(strategy, rows, cap, cpu=r.cpu_cores, mem=r.memory_mb,
                               gpu=[gpu_need[j] for j in fitting], wants_devices=wants)
            for i, score in zip(chosen, scores, strict=True):
                out[i] = score
        return True

    def place(self, ask: Ask, strategy: str = "binpack") -> tuple[Choice | None, dict[int, str]]:
        """Choose and book the best node for one ask. Returns (choice, reasons of nodes tried and refused)."""
        ranking = self._ranking(ask, strategy)
        refused: dict[int, str] = {}
        info = self.static_info(ask)
        implied = info.implied_gpu
        fits: tuple[np.ndarray, np.ndarray] | None = None
        if ask.request.devices or (info.implies_any and implied[ranking.fit].any()):
            fits = self._fit_entry(ask)
        by_memory = fits is not None and fits_by_memory(ask.request.devices)
        tried: int | None = None
        if not by_memory and not ask.preferred_node:
            # The best node by score usually takes the ask: one argmax over the ranking finds it (the first maximum,
            # as over the candidates in ``_best_first``), without listing the candidates.
            best = int(ranking.scores.argmax()) if len(ranking.scores) else -1
            if best < 0 or ranking.scores[best] == -np.inf:
                return None, refused
            if fits is None or not (fits[1][best] == self.stamp[best] and fits[0][best] == np.inf):
                choice = self._try(best, ask, float(ranking.scores[best]), int(implied[best]), None, fits, refused)
                if choice is not None or not ask.needs_dynamic_check:
                    return choice, refused
                tried = best
        idx = np.flatnonzero(ranking.fit)
        scores = ranking.scores[idx]
        if not len(idx):
            return None, refused
        preferred_i = self.index.get(ask.preferred_node) if ask.preferred_node else None
        if by_memory:
            order = self._best_fit_first(ask, idx, scores, implied, preferred_i)
        else:
            if fits is not None:
                # Nodes whose devices were found not to fit this ask shape, and have not changed since: skipped.
                values, stamps = fits
                keep = ~((stamps[idx] == self.stamp[idx]) & np.isinf(values[idx]))
                idx, scores = idx[keep], scores[keep]
                if not len(idx):
                    return None, refused
            order = _best_first(idx, scores, preferred_i, all_needed=ask.needs_dynamic_check)
        for pos in order:
            i = int(idx[pos])
            if i != tried:
                choice = self._try(i, ask, float(scores[pos]), int(implied[i]), preferred_i, fits, refused)
                if choice is not None:
                    return choice, refused
        return None, refused

    def _try(self, i: int, ask: Ask, score: float, implied: int, preferred: int | None,
             fits: tuple[np.ndarray, np.ndarray] | None, refused: dict[int, str]) -> Choice | None:
        """``try_node`` within ``place``: book the choice, or note why node ``i`` refused (and, when for its
        devices, that they do not fit this ask shape until a booking there changes)."""
        choice, why = self.try_node(i, ask, implied)
        if choice is None:
            refused[i] = why or "refused"
            if fits is not None and why is not None and why.startswith(reasons.MISSING_DEVICES):
                fits[0][i], fits[1][i] = np.inf, self.stamp[i]
            return None
        choice.score = score
        if ask.preferred_node:
            choice.preferred = "honored" if i == preferred else "fallback"
        self.book_choice(choice)
        return choice

    def _best_fit_first(self, ask: Ask, idx: np.ndarray, scores: np.ndarray, implied: np.ndarray,
                        preferred: int | None) -> Iterator[int]:
        """Positions into ``idx`` for an ask sized by GPU memory: the preferred node, then the nodes whose devices
        it leaves the least memory unbooked on (docs/resources.md), then by score, then by name.

        Where the fleet has a lower bound of each node's fit (``Fleet.fit_bounds``), the nodes are walked in the
        order of their bounds and a node's fit is computed only when no node before it can still come first:
        the same order as computing every fit, at the cost of the few nodes near the front."""
        first = _position(idx, preferred)
        if first is not None:
            yield first
        bounds = self.fleet.fit_bounds(ask, implied)
        if bounds is None:
            fit = self._fit(ask, idx, implied)
            usable = np.flatnonzero(np.isfinite(fit))
            for pos in usable[np.lexsort((usable, -scores[usable], fit[usable]))]:
                if pos != first:
                    yield int(pos)
            return
        values, stamps = self._fit_entry(ask)
        known = stamps[idx] == self.stamp[idx]
        keys = np.where(known, values[idx], bounds[idx])
        front = self._front(ask, idx, scores, implied, keys, known)
        if front is not None and front != first:
            yield front
        usable = np.flatnonzero(np.isfinite(keys))
        ready: list[tuple[float, float, int]] = []  # (fit, -score, position) of nodes whose fit is known
        for pos in usable[np.lexsort((usable, -scores[usable], keys[usable]))].tolist():
            if pos == front:
                continue
            key = (float(keys[pos]), -float(scores[pos]), pos)
            while ready and ready[0] < key:
                yield from _unless(heapq.heappop(ready)[2], first)
            exact = key[0] if known[pos] else self._fit_one(ask, int(idx[pos]), implied)
            if exact != np.inf:
                heapq.heappush(ready, (exact, key[1], pos))
        while ready:
            yield from _unless(heapq.heappop(ready)[2], first)

    def _front(self, ask: Ask, idx: np.ndarray, scores: np.ndarray, implied: np.ndarray, keys: np.ndarray,
               known: np.ndarray) -> int | None:
        """The first position of the best-fit order, found without sorting: the least key (ties: the best score,
        then the lowest position) whose fit is known; a node whose key is only a bound gets its fit computed
        (``keys`` and ``known`` are updated) and the search goes on. None when no node fits."""
        while len(keys):
            low = keys.min()
            if low == np.inf:
                return None
            tied = np.flatnonzero(keys == low)
            pos = int(tied[np.argmax(scores[tied])])
            if known[pos]:
                return pos
            keys[pos], known[pos] = self._fit_one(ask, int(idx[pos]), implied), True
        return None

    def _positions(self, i: int, requests: tuple[DeviceRequest, ...]) -> list[tuple[int, ...]]:
        """Per request, the positions of node ``i``'s devices that match it (``devices.matching``), per class."""
        node_class = self.fleet.classes[self.class_of[i]]
        return [node_class.matching(request) for request in requests]

    def _fit_entry(self, ask: Ask) -> tuple[np.ndarray, np.ndarray]:
        """Per node, for this ask's device requests: the GPU memory they would leave unbooked (inf: they do not
        fit), and the node's booking stamp when that was found (a different stamp now: unknown)."""
        key = ask.devices_key
        entry = self._fits.get(key)
        if entry is None:
            if len(self._fits) > 256:
                self._fits.clear()
            entry = self._fits[key] = (np.full(len(self.nodes), np.inf), np.full(len(self.nodes), -1, dtype=np.int64))
        return entry

    def _fit(self, ask: Ask, idx: np.ndarray, implied: np.ndarray) -> np.ndarray:
        """``_fit_entry`` for the candidates in ``idx``, computed now where unknown."""
        values, stamps = self._fit_entry(ask)
        for i in idx[stamps[idx] != self.stamp[idx]]:
            self._fit_one(ask, int(i), implied)
        fit: np.ndarray = values[idx]
        return fit

    def _fit_one(self, ask: Ask, i: int, implied: np.ndarray) -> float:
        """The GPU memory the ask's device requests leave unbooked on node ``i`` now (inf: they do not fit),
        recorded in ``_fit_entry`` with the node's stamp."""
        values, stamps = self._fit_entry(ask)
        node = self.nodes[i]
        requests = device_requests(node, ask) if implied[i] else ask.request.devices
        picked, _, _ = pick_devices(requests, node.devices, self.devices_held[i], self.devices_used[i],
                                    positions=self._positions(i, requests))
        fit = picked.leftover if picked is not None else float("inf")
        values[i], stamps[i] = fit, self.stamp[i]
        return fit


def _unless(pos: int, skip: int | None) -> Iterator[int]:
    if pos != skip:
        yield pos


def _position(idx: np.ndarray, node: int | None) -> int | None:
    """Where ``node`` (the preferred node) is among the candidates ``idx``; None when it is not one."""
    if node is None:
        return None
    hit = np.flatnonzero(idx == node)
    return int(hit[0]) if len(hit) else None


def _best_first(idx: np.ndarray, scores: np.ndarray, preferred: int | None, *, all_needed: bool) -> Iterator[int]:
    """Positions into ``idx`` in the order to try: the preferred node, then by score (ties by name).

    Lazy: the best node usually takes the ask, so the full O(n log n) ordering is built only if it refuses.
    """
    first = _position(idx, preferred)
    if first is not None:
        yield first
    best = int(np.argmax(scores))  # the first maximum: the lowest name among equal scores
    if best != first:
        yield best
    if not all_needed:
        return
    for pos in np.argsort(-scores, kind="stable"):
        if pos != first and pos != best:
            yield int(pos)
