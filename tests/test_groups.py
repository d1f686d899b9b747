"""Resource groups (docs/operating.md): kept in the store on all three backends (real SQLite files, redis-server,
PostgreSQL), managed from the command line, reported by workers, and never sharing capacity."""

import json
import sys
from pathlib import Path

import cli_runner
import pytest
from builders import gpu, node
from lab import Lab
from stores import store_url

from mn_prefect.model.resources import resource_request
from mn_prefect.placement.placing import Placer, place_and_commit
from mn_prefect.scheduler import Ask
from mn_prefect.store import open_store
from mn_prefect.store.base import GroupInUse, UnknownGroup

MN = str(Path(sys.executable).parent / "mn-prefect")


def ask(name="w", **resources):
    return Ask(agent_id=name, request=resource_request(resources))


def groups(store) -> dict[str, int]:
    return {g.name: g.nodes for g in store.list_groups()}


@pytest.fixture
def two_groups(store):
    """Group a with a CPU node, group b with a GPU node, and a node left in default."""
    store.create_group("a")
    store.create_group("b")
    store.register_node(node("a-1", cpu=8, group="a"))
    store.register_node(node("b-1", cpu=8, devices=[gpu("b-gpu", 0)], group="b"))
    store.register_node(node("d-1", cpu=8))
    return store


# -- the store ---------------------------------------------------------------------------------------------

def test_default_always_exists_and_cannot_be_deleted(store):
    assert groups(store) == {"default": 0}
    assert store.create_group("default") is False
    with pytest.raises(ValueError, match="always exists"):
        store.delete_group("default")


def test_creating_is_idempotent_and_listing_counts_each_groups_nodes(two_groups):
    assert two_groups.create_group("a") is False
    assert groups(two_groups) == {"a": 1, "b": 1, "default": 1}
    created = {g.name: g.created_at for g in two_groups.list_groups()}
    assert created["default"] is None and created["a"] > 0


def test_registering_in_an_unknown_group_is_refused_and_writes_nothing(store):
    with pytest.raises(UnknownGroup, match="node 'n' reports group 'nope', which does not exist: create it with "
                                           "`mn-prefect group create nope`"):
        store.register_node(node("n", group="nope"))
    assert store.list_nodes() == [] and groups(store) == {"default": 0}


def test_a_group_with_nodes_cannot_be_deleted_until_they_leave(two_groups):
    with pytest.raises(GroupInUse, match="group 'a' still has 1 node\\(s\\): a-1"):
        two_groups.delete_group("a")
    assert "a" in groups(two_groups)
    two_groups.register_node(node("a-1", cpu=8, group="b"))  # its worker came back in another pool
    two_groups.delete_group("a")
    assert groups(two_groups) == {"b": 2, "default": 1}
    with pytest.raises(UnknownGroup, match="group 'a' does not exist"):
        two_groups.delete_group("a")


@pytest.mark.parametrize("name", ["", "with space", "-leading", "a/b", "x" * 64, "naïve"])
def test_bad_group_names_are_refused_naming_the_field(store, name):
    with pytest.raises(ValueError, match=r"group: .* is not a valid group name \(1-63 letters"):
        store.create_group(name)


def test_a_groups_snapshot_holds_only_its_nodes_and_their_bookings(two_groups):
    assert place_and_commit(two_groups, "on-b", [ask(gpu=1)], group="b").placed
    assert place_and_commit(two_groups, "on-a", [ask(cpu_cores=2)], group="a").placed
    snap = two_groups.snapshot(group="b")
    assert [n.name for n in snap.nodes] == ["b-1"]
    assert [(h.node, h.device_ids) for h in snap.holds] == [("b-1", ["b-gpu"])]
    assert [n.name for n in two_groups.snapshot(group="default").nodes] == ["d-1"]
    assert [n.name for n in two_groups.snapshot().nodes] == ["a-1", "b-1", "d-1"]


def test_a_groups_placer_books_only_its_nodes_and_stamps_the_group(two_groups):
    placer = Placer(two_groups, group="a")
    for i in range(3):
        result = placer.place(f"run-{i}", [ask(cpu_cores=2)], strategy="spread")
        assert result.placed and [(p.node, p.group) for p in result.commit.placements] == [("a-1", "a")]
    assert {p.group for p in two_groups.active_placements()} == {"a"}
    # Only b's node has a GPU: a run of a waits rather than taking it.
    refused = placer.place("needs-gpu", [ask(gpu=1)])
    assert not refused.placed and refused.plan.status == "not_runnable"
    assert two_groups.active_placements(job_id="needs-gpu") == []


def test_the_store_refuses_a_placement_on_a_node_of_another_group(two_groups):
    placed = place_and_commit(two_groups, "probe", [ask(cpu_cores=1)], group="b").commit.placements[0]
    two_groups.release("probe")
    stray = placed.model_copy(update={"node": "a-1"})  # planned for group b, aimed at a's node
    result = two_groups.commit_plan("stray", [stray])
    assert not result.ok and "a-1 is in group 'a'" in result.conflict.reason
    assert two_groups.active_placements() == []


def test_a_sql_store_of_schema_2_is_upgraded_with_its_nodes_in_default(tmp_path):
    from sqlalchemy import create_engine, text

    url = f"sqlite:///{tmp_path / 'state.db'}"
    open_store(url).register_node(node("old"))
    engine = create_engine(url)
    with engine.begin() as conn:  # what a store written before groups looks like
        conn.exec_driver_sql("DROP TABLE mn_groups")
        conn.exec_driver_sql("DROP INDEX ix_mn_nodes_node_group")
        conn.exec_driver_sql("ALTER TABLE mn_nodes DROP COLUMN node_group")
        conn.execute(text("UPDATE mn_meta SET value = '2' WHERE key = 'schema_version'"))
    engine.dispose()
    store = open_store(url)
    assert groups(store) == {"default": 1} and [n.name for n in store.snapshot(group="default").nodes] == ["old"]
    assert store.create_group("new") is True


def test_a_sql_store_of_schema_4_gains_the_indexes_of_its_records_and_keeps_them(tmp_path):
    from sqlalchemy import create_engine, text

    from mn_prefect.store import JobRecord

    url = f"sqlite:///{tmp_path / 'state.db'}"
    open_store(url).put_job(JobRecord(job_id="rsv-1", job_type="reservation", status="active",
                                      spec={"expires_at": 5.0}))
    engine = create_engine(url)
    with engine.begin() as conn:  # what a store written before the index looks like
        conn.exec_driver_sql("DROP INDEX ix_mn_jobs_status_type")
        conn.exec_driver_sql("DROP INDEX ix_mn_jobs_expiry")
        conn.execute(text("UPDATE mn_meta SET value = '4' WHERE key = 'schema_version'"))
    store = open_store(url)
    with engine.begin() as conn:
        indexes = {r[0] for r in conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'index'")}
    engine.dispose()
    assert {"ix_mn_jobs_status_type", "ix_mn_jobs_expiry"} <= indexes
    assert [r.job_id for r in store.reservations_due(10.0)[0]] == ["rsv-1"]


# -- the command line --------------------------------------------------------------------------------------

def mn(*args, env=None):
    return cli_runner.run(args, env=env)


def test_group_commands_create_list_and_delete(backend, request, tmp_path):
    url = store_url(backend, request, tmp_path)
    created = mn("group", "create", "gpu-pool", "--store-url", url, "--json")
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout) == {"group": "gpu-pool", "created": True}
    again = mn("group", "create", "gpu-pool", "--store-url", url)
    assert again.returncode == 0 and "group gpu-pool already exists" in again.stdout
    open_store(url).register_node(node("g-1", group="gpu-pool"))

    listed = mn("group", "list", "--store-url", url, "--json")
    assert [(g["name"], g["nodes"]) for g in json.loads(listed.stdout)] == [("default", 0), ("gpu-pool", 1)]
    table = mn("group", "list", "--store-url", url)
    assert table.returncode == 0 and "gpu-pool" in table.stdout and "built in" in table.stdout

    refused = mn("group", "delete", "gpu-pool", "--store-url", url, "--json")
    assert refused.returncode == 1 and "still has 1 node(s): g-1" in refused.stderr
    assert json.loads(refused.stdout)["deleted"] is False
    open_store(url).register_node(node("g-1"))  # the node moves to default
    deleted = mn("group", "delete", "gpu-pool", "--store-url", url)
    assert deleted.returncode == 0 and "deleted group gpu-pool" in deleted.stdout
    assert [g["name"] for g in json.loads(mn("group", "list", "--store-url", url, "--json").stdout)] == ["default"]


def test_group_command_errors_name_what_is_wrong(tmp_path):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    bad = mn("group", "create", "no spaces", "--store-url", url)
    assert bad.returncode == 2 and "NAME" in bad.stderr and "not a valid group name" in bad.stderr
    unknown = mn("group", "delete", "ghost", "--store-url", url)
    assert unknown.returncode == 1 and "group 'ghost' does not exist" in unknown.stderr
    builtin = mn("group", "delete", "default", "--store-url", url)
    assert builtin.returncode == 1 and "cannot be deleted" in builtin.stderr


def test_resource_list_and_plan_take_a_group(tmp_path):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = open_store(url)
    store.create_group("a")
    store.create_group("b")
    store.register_node(node("a-1", cpu=4, group="a"))
    store.register_node(node("b-1", cpu=64, devices=[gpu("b-gpu", 0)], group="b"))

    listed = json.loads(mn("resource", "list", "--store-url", url, "--group", "b", "--json").stdout)
    assert listed["group"] == "b" and [(n["name"], n["group"]) for n in listed["nodes"]] == [("b-1", "b")]
    assert listed["total"]["cpu_cores"] == 64
    everything = json.loads(mn("resource", "list", "--store-url", url, "--json").stdout)
    assert [(n["name"], n["group"]) for n in everything["nodes"]] == [("a-1", "a"), ("b-1", "b")]
    table = mn("resource", "list", "--store-url", url, "--group", "a")
    assert table.returncode == 0 and "a-1" in table.stdout and "b-1" not in table.stdout

    in_a = mn("plan", "--request", '{"gpu": 1}', "--store-url", url, "--group", "a")
    assert in_a.returncode == 1 and json.loads(in_a.stdout)["status"] == "not_runnable"
    in_b = mn("plan", "--request", '{"gpu": 1}', "--store-url", url, "--group", "b")
    assert in_b.returncode == 0 and [p["node"] for p in json.loads(in_b.stdout)["placements"]] == ["b-1"]
    ghost = mn("plan", "--request", '{"cpu": 1}', "--store-url", url, "--group", "ghost")
    assert ghost.returncode == 2 and "no group 'ghost' in the store" in ghost.stdout
    bad = mn("resource", "list", "--store-url", url, "--group", "a b")
    assert bad.returncode == 2 and "--group" in bad.stderr


def test_plan_against_a_nodes_file_keeps_only_the_groups_nodes(tmp_path):
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps([{"name": "x", "cpu_cores": 4, "group": "a"},
                                 {"name": "y", "cpu_cores": 4, "group": "b"}]))
    plan = mn("plan", "--request", '{"cpu": 1}', "--nodes", str(nodes), "--group", "b")
    assert plan.returncode == 0 and [p["node"] for p in json.loads(plan.stdout)["placements"]] == ["y"]


# -- two mn pools on one store: real Prefect server, real worker processes ----------------------------------

A_NODE = {"name": "a-cpu", "cpu_cores": 4, "memory_mb": 8192}
B_NODE = {"name": "b-gpu", "cpu_cores": 16, "memory_mb": 32768, "devices": [gpu("B-GPU", 0, 24576)]}


def run_in(lab: Lab, pool: str, resources: dict) -> str:
    """A run in the lab's pool named ``pool`` here (its real name: ``lab.pools[pool]``, unique on the server)."""
    return lab.run(lab.deploy({"resources": resources}, pool=lab.pools[pool]))


def ran_on(lab: Lab, run_id: str) -> str:
    assert lab.wait(run_id)["state"]["type"] == "COMPLETED"
    return lab.record(run_id)["env"]["MN_NODE"]


@pytest.fixture(scope="module")
def two_pools(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("two-pools"), pools={"pool-a": [A_NODE], "pool-b": [B_NODE]})
    yield lab
    lab.stop()


@pytest.mark.lab
def test_each_pools_worker_creates_its_group_and_reports_its_node_in_it(two_pools):
    a, b = two_pools.pools["pool-a"], two_pools.pools["pool-b"]
    assert groups(two_pools.store) == {"default": 0, a: 1, b: 1}
    assert {n.record.name: n.record.group for n in two_pools.store.list_nodes()} == {"a-cpu": a, "b-gpu": b}


@pytest.mark.lab
def test_runs_of_each_pool_land_only_on_their_groups_node(two_pools):
    runs_a = [run_in(two_pools, "pool-a", {"cpu": 1, "memory_mb": 256}) for _ in range(2)]
    run_b = run_in(two_pools, "pool-b", {"gpu": 1, "memory_mb": 256})
    assert [ran_on(two_pools, r) for r in runs_a] == ["a-cpu", "a-cpu"]
    assert ran_on(two_pools, run_b) == "b-gpu"
    booked = [h for r in runs_a for h in two_pools.store.history(r)]
    assert {(p.node, p.group) for h in booked for p in h.placements} == {("a-cpu", two_pools.pools["pool-a"])}


@pytest.mark.lab
def test_a_run_only_another_groups_node_could_take_fails_in_its_own_pool_naming_only_its_nodes(two_pools):
    refused = run_in(two_pools, "pool-a", {"cpu": 8, "memory_mb": 256})  # only b-gpu has 8 cores
    # No node of its pool could ever take it: it fails at its first poll, naming pool-a's node only.
    run = two_pools.wait(refused)
    message = run["state"]["message"] or ""
    assert run["state"]["type"] == "FAILED" and message.startswith("mn: no node can ever take this run"), message
    assert "a-cpu" in message and "b-gpu" not in message  # pool-a never even considered pool-b's node
    # Pool-b takes the same request at once; the refused run was never booked.
    same_in_b = run_in(two_pools, "pool-b", {"cpu": 8, "memory_mb": 256})
    assert ran_on(two_pools, same_in_b) == "b-gpu"
    assert two_pools.store.active_placements(job_id=refused) == [] and two_pools.store.history(refused) == []


@pytest.mark.lab
def test_a_worker_reporting_an_unknown_group_is_refused_registration(two_pools):
    import prefect_env

    stray = {"name": "stray", "cpu_cores": 2, "memory_mb": 2048}
    worker = prefect_env.start_worker(two_pools.server, two_pools.pools["pool-a"], stray, two_pools.store_url, two_pools.home / "stray",
                                      extra_env={"MN_NODE_GROUP": "nope"})
    try:
        code = worker.wait(120)
    finally:
        prefect_env.stop_process(worker)
    log = (two_pools.home / "stray" / "worker-stray.log").read_text()
    assert code != 0, log
    assert "mn worker not started: node 'stray' reports group 'nope', which does not exist" in log
    assert two_pools.store.get_node("stray") is None
