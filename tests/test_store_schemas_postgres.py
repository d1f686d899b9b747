"""A PostgreSQL store written by any earlier schema opens with today's code on a real PostgreSQL server and is
upgraded in place: its nodes, bookings and records are kept, it takes new placements, the audit finds it sound, it
has the shape of a new store, and upgrading it again changes nothing; one whose upgrade fails is refused naming
the step and left as it was.

Each tests/stores/pg-schema-*.sql is pg_dump's plain SQL of a store the code of the commit its first line names
wrote on a throwaway PostgreSQL server (tests/stores/write_store.py with a PostgreSQL URL), one per form a store
took, as the SQLite dumps beside them (tests/test_store_schemas.py).
"""

import re
import subprocess
import uuid
from pathlib import Path

import psycopg
import pytest
from servers import pg_bin
from sqlalchemy import create_engine

from mn_prefect.lifecycle.owner_audit import owner_findings
from mn_prefect.model.resources import resource_request
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler import Ask
from mn_prefect.store import open_store
from mn_prefect.store.audit import audit
from mn_prefect.store.sql_tables import SCHEMA_VERSION, StoreNeedsUpgrade, create_or_upgrade

pytestmark = pytest.mark.lab

STORES = Path(__file__).parent / "stores"
DUMPS = sorted(STORES.glob("pg-schema-*.sql"))


def schema_of(dump: Path) -> int:
    match = re.fullmatch(r"pg-schema-(\d+)[a-z]?\.sql", dump.name)
    assert match, dump.name
    return int(match.group(1))


def database(server) -> str:
    return server.create_database(f"up_{uuid.uuid4().hex[:12]}")


def rebuilt(dump: Path, server) -> str:
    """The store the dump was taken of, in a new database of ``server``: its URL."""
    url = database(server)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(dump.read_text())
    return url


def dumped(url: str) -> list[str]:
    """Everything in the database (tables, rows, indexes, functions) as pg_dump writes it, its random lines left
    out, sorted: a row written again with the same values moves in the table, and the dump's rows come in the
    table's physical order."""
    out = subprocess.run([pg_bin("pg_dump"), "--inserts", "--no-owner", "--no-privileges", url], check=True,
                         capture_output=True, text=True).stdout
    return sorted(line for line in out.splitlines() if not line.startswith(("\\restrict ", "\\unrestrict ")))


def shape(url: str) -> dict[str, set[str]]:
    """Every table's columns with their types, every index and every function, by name: what an upgrade must leave
    as a new store has it."""
    with psycopg.connect(url) as conn:
        out: dict[str, set[str]] = {}
        for table, column, kind in conn.execute(
                "SELECT table_name, column_name, data_type FROM information_schema.columns "
                "WHERE table_schema = 'public'"):
            out.setdefault(table, set()).add(f"{column} {kind}")
        out["indexes"] = {i for (i,) in conn.execute("SELECT indexname FROM pg_indexes WHERE schemaname = 'public'")}
        out["functions"] = {f for (f,) in conn.execute(
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'public'")}
    return out


def sound(store) -> list[str]:
    """What ``mn-prefect store audit`` reports without a Prefect server: the bookings' problems and the owners'."""
    return audit(store.consistent_view()) + [f.text for f in owner_findings(store)]


def ask(**resources) -> Ask:
    return Ask(agent_id="w", request=resource_request(resources))


@pytest.fixture
def opened():
    stores = []

    def open_(url: str):
        stores.append(open_store(url))
        return stores[-1]

    yield open_
    for store in stores:
        store.close()


def test_there_is_a_stored_postgresql_store_of_every_schema_the_code_knows():
    assert {schema_of(d) for d in DUMPS} == set(range(1, int(SCHEMA_VERSION) + 1))
    sqlite_forms = {p.name for p in STORES.glob("schema-*.sql")}
    assert {d.name.removeprefix("pg-") for d in DUMPS} == sqlite_forms  # each form a store took, on both
    for dump in DUMPS:  # each written by its commit's own code (tests/stores/write_store.py), not by hand
        assert re.match(r"-- A store written by mn_prefect at commit [0-9a-f]{7} \(schema \d\)", dump.read_text())


@pytest.mark.parametrize("dump", DUMPS, ids=lambda d: d.stem)
def test_an_older_postgresql_store_opens_upgraded_with_its_nodes_bookings_and_records(dump, postgres_server, opened):
    store = opened(rebuilt(dump, postgres_server))
    assert [n.record.name for n in store.list_nodes()] == ["c-1", "g-1"]
    assert sorted(store.active_jobs()) == ["job-cpu", "job-gpu"]
    assert [d.id for p in store.active_placements(job_id="job-gpu") for d in p.allocation.devices] == ["g0"]
    assert {(b.kind, b.node, b.key, b.job_id) for b in store.bookings()} == {
        ("device", "g-1", "g0", "job-gpu"), ("port", "g-1", "tcp:8080", "job-gpu")}
    record = store.get_job("rec-1")
    assert record is not None and (record.status, record.spec) == ("running", {"steps": 3})
    assert sound(store) == []


@pytest.mark.parametrize("dump", DUMPS, ids=lambda d: d.stem)
def test_an_upgraded_postgresql_store_takes_new_placements_and_releases_old_ones(dump, postgres_server, opened):
    store = opened(rebuilt(dump, postgres_server))
    placed = place_and_commit(store, "job-new", [ask(cpu_cores=1, gpu=1)])
    assert placed.commit is not None and placed.commit.ok
    assert [d.id for p in placed.commit.placements for d in p.allocation.devices] == ["g1"]  # g0 is still held
    assert sound(store) == []
    assert store.release("job-gpu") and store.release("job-cpu")  # what their demands free is what they hold
    assert sound(store) == [] and sorted(store.active_jobs()) == ["job-new"]
    assert store.consistent_view()["nodes"]["c-1"]["cpu"] == 0


@pytest.mark.parametrize("dump", DUMPS, ids=lambda d: d.stem)
def test_an_upgraded_postgresql_store_has_the_shape_of_a_new_one_and_upgrading_again_changes_nothing(
        dump, postgres_server, opened):
    url = rebuilt(dump, postgres_server)
    opened(url).close()
    new = database(postgres_server)
    opened(new).close()
    assert shape(url) == shape(new)
    before = dumped(url)
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:
        create_or_upgrade(conn)
    engine.dispose()
    assert dumped(url) == before


def test_a_postgresql_store_of_a_newer_schema_is_refused_naming_the_upgrade_to_run(postgres_server):
    url = rebuilt(STORES / f"pg-schema-{SCHEMA_VERSION}.sql", postgres_server)
    newer = str(int(SCHEMA_VERSION) + 1)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE mn_meta SET value = %s WHERE key = 'schema_version'", (newer,))
    with pytest.raises(StoreNeedsUpgrade, match=f"schema {newer}.*pip install --upgrade mn-prefect"):
        open_store(url)


def test_a_postgresql_store_whose_upgrade_fails_is_refused_naming_the_step_and_left_as_it_was(postgres_server):
    url = rebuilt(STORES / "pg-schema-1b.sql", postgres_server)
    with psycopg.connect(url, autocommit=True) as conn:  # a schema-1 store missing a table its upgrade reads
        conn.execute("DROP TABLE mn_held_ports")
    before = dumped(url)
    with pytest.raises(StoreNeedsUpgrade,
                       match='upgrade of the store from schema 1 to .* failed .*relation "mn_held_ports" does not exist'):
        open_store(url)
    assert dumped(url) == before
