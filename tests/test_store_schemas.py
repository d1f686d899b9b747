"""A SQLite store written by any earlier schema opens with today's code and is upgraded in place: its nodes,
bookings and records are kept, it takes new placements, and the audit (``mn-prefect store audit``) finds it sound.

Each store in tests/stores/ was written by the code of the commit its first line names (tests/stores/write_store.py),
one per form a store took: schema-1a (the first: no capacity totals, no demands), schema-1b (totals and demands),
schema-2a (one held table, usage as JSON, no per-GPU counters), schema-2b (per-GPU counters), schema-3 (groups),
schema-4 (change counters), schema-5a (the records' index), schema-5b (the reservations' expiry index), schema-6.
"""

import re
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from mn_prefect.lifecycle.owner_audit import owner_findings
from mn_prefect.model.resources import resource_request
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler import Ask
from mn_prefect.store import open_store
from mn_prefect.store.audit import audit
from mn_prefect.store.sql_tables import SCHEMA_VERSION, StoreNeedsUpgrade, create_or_upgrade

STORES = Path(__file__).parent / "stores"
DUMPS = sorted(STORES.glob("schema-*.sql"))


def schema_of(dump: Path) -> int:
    match = re.fullmatch(r"schema-(\d+)[a-z]?\.sql", dump.name)
    assert match, dump.name
    return int(match.group(1))


def rebuilt(dump: Path, tmp_path: Path) -> Path:
    """The store the dump was taken of, as a SQLite file."""
    path = tmp_path / "state.db"
    conn = sqlite3.connect(path)
    conn.executescript(dump.read_text())
    conn.close()
    return path


def shape(path: Path) -> dict[str, set[str]]:
    """Every table's columns and every index, by name: what an upgrade must leave as a new store has it."""
    conn = sqlite3.connect(path)
    tables = [t for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    out = {table: {row[1] for row in conn.execute(f"PRAGMA table_info({table})")} for table in tables}
    out["indexes"] = {i for (i,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")}
    conn.close()
    return out


def sound(store) -> list[str]:
    """What ``mn-prefect store audit`` reports without a Prefect server: the bookings' problems and the owners'."""
    return audit(store.consistent_view()) + [f.text for f in owner_findings(store)]


def ask(**resources) -> Ask:
    return Ask(agent_id="w", request=resource_request(resources))


def test_there_is_a_stored_store_of_every_schema_the_code_knows():
    assert {schema_of(d) for d in DUMPS} == set(range(1, int(SCHEMA_VERSION) + 1))


@pytest.mark.parametrize("dump", DUMPS, ids=lambda d: d.stem)
def test_an_older_store_opens_upgraded_with_its_nodes_bookings_and_records(dump, tmp_path):
    store = open_store(f"sqlite:///{rebuilt(dump, tmp_path)}")
    assert [n.record.name for n in store.list_nodes()] == ["c-1", "g-1"]
    assert sorted(store.active_jobs()) == ["job-cpu", "job-gpu"]
    assert [d.id for p in store.active_placements(job_id="job-gpu") for d in p.allocation.devices] == ["g0"]
    assert {(b.kind, b.node, b.key, b.job_id) for b in store.bookings()} == {
        ("device", "g-1", "g0", "job-gpu"), ("port", "g-1", "tcp:8080", "job-gpu")}
    record = store.get_job("rec-1")
    assert record is not None and (record.status, record.spec) == ("running", {"steps": 3})
    assert sound(store) == []


@pytest.mark.parametrize("dump", DUMPS, ids=lambda d: d.stem)
def test_an_upgraded_store_takes_new_placements_and_releases_old_ones_and_stays_sound(dump, tmp_path):
    store = open_store(f"sqlite:///{rebuilt(dump, tmp_path)}")
    placed = place_and_commit(store, "job-new", [ask(cpu_cores=1, gpu=1)])
    assert placed.commit is not None and placed.commit.ok
    assert [d.id for p in placed.commit.placements for d in p.allocation.devices] == ["g1"]  # g0 is still held
    assert sound(store) == []
    assert store.release("job-gpu") and store.release("job-cpu")  # what their demands free is what they hold
    assert sound(store) == [] and sorted(store.active_jobs()) == ["job-new"]
    assert store.consistent_view()["nodes"]["c-1"]["cpu"] == 0


@pytest.mark.parametrize("dump", DUMPS, ids=lambda d: d.stem)
def test_an_upgraded_store_has_the_shape_of_a_new_one_and_upgrading_again_changes_nothing(dump, tmp_path):
    path = rebuilt(dump, tmp_path)
    open_store(f"sqlite:///{path}").close()
    (tmp_path / "new").mkdir()
    new = tmp_path / "new" / "state.db"
    open_store(f"sqlite:///{new}").close()
    assert shape(path) == shape(new)
    before = list(sqlite3.connect(path).iterdump())
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        create_or_upgrade(conn)
    engine.dispose()
    assert list(sqlite3.connect(path).iterdump()) == before


def test_a_store_of_a_newer_schema_is_refused_naming_the_upgrade_to_run(tmp_path):
    path = rebuilt(STORES / f"schema-{SCHEMA_VERSION}.sql", tmp_path)
    newer = str(int(SCHEMA_VERSION) + 1)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE mn_meta SET value = ? WHERE key = 'schema_version'", (newer,))
    with pytest.raises(StoreNeedsUpgrade, match=f"schema {newer}.*pip install --upgrade mn-prefect"):
        open_store(f"sqlite:///{path}")


def test_a_store_whose_upgrade_fails_is_refused_in_words_and_left_as_it_was(tmp_path):
    path = rebuilt(STORES / "schema-1b.sql", tmp_path)
    with sqlite3.connect(path) as conn:  # a schema-1 store missing a table its upgrade reads
        conn.execute("DROP TABLE mn_held_ports")
    before = list(sqlite3.connect(path).iterdump())
    with pytest.raises(StoreNeedsUpgrade, match="upgrade of the store from schema 1 to .* failed .*no such table"):
        open_store(f"sqlite:///{path}")
    assert list(sqlite3.connect(path).iterdump()) == before
