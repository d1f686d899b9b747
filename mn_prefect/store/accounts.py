"""Queue and cohort accounts in the store: kept beside the nodes, applied to by the same compare-and-apply.

An account is stored like a node (a row of ``mn_nodes`` in the group ``@accounts`` on SQLite and PostgreSQL, a
``node:`` hash outside the ``nodes`` set on Redis): its record is the queue's settings (or the cohort's quota),
its ``used`` what the runs charged to it hold, its ``version`` grows with every change of the settings. A commit
names the accounts of its queue beside its nodes; the backends check versions and ceilings and add the amounts
exactly as for a node (store/admission.py), and a release takes them off again from the booking's demands: no
backend script knows what a quota is. Node names never start with ``@`` (model/node.py), so none is mistaken
for an account.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from typing import Any

from mn_prefect.model.names import STORED
from mn_prefect.model.placement import Placement
from mn_prefect.model.queues import MODEL_PREFIX, CohortRecord, QueueRecord, QueueSpec
from mn_prefect.scheduler.quotas import (
    COHORT_ACCOUNT,
    QUEUE_ACCOUNT,
    Queues,
    charge,
    cohort_account,
    is_account,
    nominal,
    queue_account,
)
from mn_prefect.store.base import StoreError
from mn_prefect.store.dimensions import CLAIM_KINDS

ACCOUNTS_GROUP = "@accounts"
QUEUE_STATUS = "queue"
COHORT_STATUS = "cohort"

class QueueInUse(StoreError):
    """A queue's settings cannot be deleted while its runs hold something."""


@functools.lru_cache(maxsize=1024)
def _spec(text: str) -> QueueSpec:
    return QueueSpec.model_validate_json(text, context=STORED)


def account_of(name: str, text: str, used: Mapping[str, float | str], version: int) -> QueueRecord | CohortRecord:
    """A stored account (its row's record text, usage and version) as a record."""
    amounts = {k: float(v) for k, v in used.items()}
    if name.startswith(QUEUE_ACCOUNT):
        return QueueRecord(spec=_spec(text), used=amounts, version=version)
    data = json.loads(text)
    return CohortRecord(name=data["name"], nominal=data.get("nominal", {}), used=amounts, version=version)


def queues_of(accounts: Iterable[QueueRecord | CohortRecord]) -> Queues:
    accounts = list(accounts)
    return Queues.of([a for a in accounts if isinstance(a, QueueRecord)],
                     [a for a in accounts if isinstance(a, CohortRecord)])


def cohort_text(name: str, amounts: Mapping[str, float]) -> str:
    return json.dumps({"name": name, "nominal": dict(sorted(amounts.items()))}, sort_keys=True)


# The cohort each queue was last seen in (any process's read): a commit names that cohort's account with its
# queue's, and reads again if the queue turns out to be in another one.
_COHORT_OF: dict[str, str | None] = {}


def accounts_for(queues: Iterable[str]) -> list[str]:
    """The accounts a commit of runs from ``queues`` reads: each queue's, and its cohort's as last seen."""
    out = []
    for queue in sorted(set(queues)):
        out.append(queue_account(queue))
        cohort = _COHORT_OF.get(queue)
        if cohort:
            out.append(cohort_account(cohort))
    return out


def missing_accounts(queues: Queues, names: Iterable[str]) -> list[str]:
    """The cohort accounts a read should have named and did not (a queue's cohort changed); remembers them."""
    names = set(names)
    out = []
    for queue, record in queues.queues.items():
        _COHORT_OF[queue] = record.spec.cohort
        if record.spec.cohort and cohort_account(record.spec.cohort) not in names:
            out.append(cohort_account(record.spec.cohort))
    return out


def settle(specs: Mapping[str, QueueSpec], spec: QueueSpec | None, name: str) -> tuple[str | None, dict[str, str | None]]:
    """Setting queue ``name`` to ``spec`` (None: deleting it) among the queues ``specs`` as stored: its new record
    text (None: delete), and each cohort whose quota changes with its new record text (None: no queue left in
    it, delete)."""
    before = specs.get(name)
    after = {**specs, name: spec} if spec is not None else {k: v for k, v in specs.items() if k != name}
    touched = {c for c in (before.cohort if before else None, spec.cohort if spec else None) if c}
    cohorts: dict[str, str | None] = {}
    for cohort in sorted(touched):
        members = [s for s in after.values() if s is not None and s.cohort == cohort]
        cohorts[cohort] = cohort_text(cohort, nominal(members, cohort)) if members else None
    return (spec.model_dump_json() if spec is not None else None), cohorts


def check_deletable(record: QueueRecord | None, name: str) -> None:
    if record is None:
        raise StoreError(f"queue {name!r} has no settings to delete")
    held = {d: v for d, v in record.used.items() if v > 0}
    if held:
        raise QueueInUse(f"queue {name!r} still holds " + ", ".join(f"{d}={v:g}" for d, v in sorted(held.items()))
                         + ": delete its settings once its runs have ended")


def split_release(stored: Mapping[str, Any], gone: list[Placement]) -> tuple[dict[str, dict], dict[str, dict]]:
    """The account part of a partial release: per account the booking charged (``stored``: its demands), what
    the ``gone`` placements took of it, and what the rest keeps (its version and ceilings as stored)."""
    empty: dict[str, list[str]] = {kind: [] for kind in CLAIM_KINDS}
    gone_out: dict[str, dict] = {}
    kept_out: dict[str, dict] = {}
    for name, demand in stored.items():
        if not is_account(name):
            continue
        add = demand.get("add", {})
        models = [d[len(MODEL_PREFIX):] for d in add if d.startswith(MODEL_PREFIX)]
        took = charge([p for p in gone if p.queue], models)
        goes = {d: min(took.get(d, 0.0), float(v)) for d, v in add.items()}
        gone_out[name] = {"add": goes, "claim": empty}
        kept_out[name] = {**demand, "add": {d: round(float(v) - goes[d], 6) for d, v in add.items()}}
    return gone_out, kept_out


def is_cohort(name: str) -> bool:
    return name.startswith(COHORT_ACCOUNT)
