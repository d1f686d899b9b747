"""The order a worker offers capacity to the runs of one poll (mn_prefect/worker/routing.py, ``Router.in_order``),
on a real PostgreSQL store: by the pool's tag priorities while the store answers, and Prefect's own order, with
the worker polling on, when the store goes away in the middle of it (a restarting database ended the worker)."""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import anyio
import anyio.to_thread
import pytest
import servers

from mn_prefect.model.pool_policy import PoolPolicy
from mn_prefect.placement.placing import Placer
from mn_prefect.store import open_store
from mn_prefect.store.records import PoolPolicyRecord, pool_policy_id, put_record
from mn_prefect.worker.routing import Remembered, Router
from mn_prefect.worker.worker import MNWorker

POOL = "routing-pool"


def entry(tags: list[str], waited_s: float) -> SimpleNamespace:
    """One polled run as Prefect's answer lists it."""
    run = SimpleNamespace(id=uuid.uuid4(), tags=tags, created=None, work_queue_name="default", deployment_id=None,
                          job_variables={}, flow_id=uuid.uuid4(),
                          expected_start_time=datetime.now(UTC) - timedelta(seconds=waited_s))
    return SimpleNamespace(flow_run=run)


def router(store, in_store, polled: list) -> Router:
    """A node's router; each polled run's job configuration as its worker remembers it (no priority of its own)."""
    log = logging.getLogger("mn-test-routing")
    remembered = Remembered(configs={e.flow_run.id: SimpleNamespace(priority=None) for e in polled})
    return Router(store=store, placer=Placer(store), node="n1", in_store=in_store, remembered=remembered,
                  releaser=None, client=lambda: None, work_pool=lambda: SimpleNamespace(name=POOL),
                  template=MNWorker.get_default_base_job_template, start_soon=None, is_announcer=None, logger=log,
                  run_logger=lambda run: log)


@pytest.mark.lab
def test_a_store_gone_while_the_runs_are_ordered_leaves_prefects_order_and_the_worker_polling(caplog):
    pg = servers.PostgresServer()
    try:
        store = open_store(pg.create_database("routing"))
        policy = PoolPolicy(tag_priorities={"urgent": 10})
        put_record(store, PoolPolicyRecord(job_id=pool_policy_id(POOL), pool=POOL, policy=policy))
        stop_after_first = {"on": False}

        async def in_store(fn, *args, **kwargs):
            out = await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))
            if stop_after_first["on"]:  # the queues were read; the database restarts before the pool's policy is
                stop_after_first["on"] = False
                pg.stop()
            return out

        polled = [entry([], waited_s=60), entry(["urgent"], waited_s=1)]  # Prefect's order: the oldest first
        routing = router(store, in_store, polled)

        ordered = anyio.run(routing.in_order, polled)
        assert [e.flow_run.tags for e in ordered] == [["urgent"], []]  # the pool's priority for the tag goes first

        stop_after_first["on"] = True
        with caplog.at_level(logging.WARNING, logger="mn-test-routing"):
            during = anyio.run(routing.in_order, polled)
        assert during == polled  # Prefect's order this poll, not an error that would end the worker
        assert any("could not order the runs (Prefect's order this poll)" in r.getMessage() and
                   "OperationalError" in r.getMessage() for r in caplog.records), caplog.text

        pg.start()
        after = anyio.run(routing.in_order, polled)  # the next poll, the database back: the pool's order again
        assert [e.flow_run.tags for e in after] == [["urgent"], []]
    finally:
        pg.cleanup()


class _Client:
    def __init__(self):
        self.states = []

    async def set_flow_run_state(self, run_id, state, force=False):
        self.states.append((run_id, state))


def test_a_run_whose_placement_raises_shows_the_error_on_its_state_once_and_is_tried_again(tmp_path, caplog):
    from prefect.states import Scheduled

    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    client, log = _Client(), logging.getLogger("mn-test-routing")
    routing = Router(store=store, placer=Placer(store), node="n1", in_store=None, remembered=Remembered(),
                     releaser=None, client=lambda: client, work_pool=lambda: None, template=None, start_soon=None,
                     is_announcer=None, logger=log, run_logger=lambda run: log)
    run = entry([], waited_s=5).flow_run
    run.state, run.next_scheduled_start_time = Scheduled(), None
    error = ValueError("Exceeds the limit (4300 digits) for integer string conversion")
    with caplog.at_level(logging.WARNING, logger="mn-test-routing"):
        anyio.run(routing.placement_failed, run, error)
        run.state = client.states[-1][1]  # the next poll reads the state it set
        anyio.run(routing.placement_failed, run, error)
    [(run_id, state)] = client.states  # set once: the same error the next poll is only a log line
    assert run_id == run.id and state.is_scheduled()
    assert state.message == ("mn: placement failed, tried again at each poll: ValueError: Exceeds the limit (4300 "
                             "digits) for integer string conversion")
    assert [r.levelname for r in caplog.records] == ["ERROR", "WARNING"]  # the traceback once, a line after
    assert caplog.records[0].exc_info is not None
    store.close()
