"""The docker runtime driver end to end (docs/drivers.md): a real dockerd, a real Prefect server and real mn
workers; each run's limits are read from inside its own container. Launch-time refusals (a driver the worker
cannot launch, a volume that escapes its host path) are here too: no run sees what it did not book."""

from __future__ import annotations

import hashlib
import json
import urllib.request
import uuid
from pathlib import Path

import pytest
import servers
from builders import gpu
from bundle_builders import run_bundle, step, write_bundle
from docker_daemon import TOOLCHAIN_IMAGE, DockerDaemon
from lab import Lab
from prefect_env import stop_process

from mn_prefect.drivers import docker as docker_io
from mn_prefect.drivers.container import NODE_LABEL, RUN_LABEL, container_spec
from mn_prefect.model.node import Device
from mn_prefect.model.placement import Allocation, PlacedResources, Placement

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab

PROBE = "container_probe.py:container_probe"
MB = 1024 * 1024
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "bundles"


@pytest.fixture(scope="module")
def daemon():
    daemon = DockerDaemon()
    daemon.build_toolchain_image()
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def lab(tmp_path_factory, daemon):
    home = tmp_path_factory.mktemp("docker-lab")
    fleet = [
        {"name": "box", "cpu_cores": 2, "memory_mb": 8192, "host_paths": [str(home)], "cpuset": "0",
         "dynamic_port_range": [24000, 24999]},
        {"name": "gpu-1", "cpu_cores": 2, "memory_mb": 8192, "host_paths": [str(home)],
         "devices": [gpu("GPU-1a", 0, 24576), gpu("GPU-1b", 1, 24576)]},
        {"name": "odd-1", "cpu_cores": 1, "memory_mb": 4096, "host_paths": [str(home)],
         "runtime_drivers": ["host_local", "podman"]},
    ]
    worker_env = {**daemon.env, docker_io.TOOLCHAIN_VAR: ":".join(docker_io.default_toolchain()),
                  "MN_TEST_WORKER_ONLY": "the worker's own"}
    lab = Lab(home, fleet=fleet, worker_env=worker_env)
    yield lab
    lab.stop()


def _on(node: str) -> list[dict]:
    return [{"attribute": "node", "operator": "==", "value": node}]


def _out(lab: Lab) -> dict:
    """The lab's output folder as a rw volume at the same path, so a container can write its record there."""
    return {"name": "out", "source": str(lab.out), "target": str(lab.out), "mode": "rw"}


def _refusals(lab: Lab, run_id: str) -> list[dict]:
    """The run's launch-refused events (events reach the server a moment after the state does)."""
    return servers.wait_for(lambda: lab.events(run_id, "mn.launch.refused"), timeout=60, interval=0.5, what="the refused event")


def _containers_of(daemon: DockerDaemon, run_id: str) -> list:
    return daemon.containers(label=f"{RUN_LABEL}={run_id}")


def test_a_node_advertises_docker_only_when_its_worker_reaches_a_daemon(lab):
    drivers = {n.record.name: n.record.runtime_drivers for n in lab.store.list_nodes()}
    assert drivers["box"] == ["host_local", "docker"]
    assert drivers["odd-1"] == ["host_local", "podman", "docker"]  # the inventory's podman stays, refused at launch


def test_a_docker_run_is_a_container_with_its_booking_enforced(lab, daemon):
    (lab.scratch / "models").mkdir()
    release = lab.out / "release-serve"  # inside the rw volume: the container sees it appear
    deployment = lab.deploy({
        "image": TOOLCHAIN_IMAGE, "constraints": _on("box"), "env": {"MY_SETTING": "kept"},
        "resources": {"runtime_driver": "docker", "cpu": 0.5, "memory_mb": 128, "ports": [{"label": "api"}],
                      "volumes": [_out(lab), {"name": "models", "source": str(lab.scratch / "models"),
                                              "target": "/models", "mode": "ro"}]}}, entrypoint=PROBE)
    run_id = lab.run(deployment, mode="serve", hold_until=str(release))
    port = int(servers.wait_for(lambda: (lab.out / f"{run_id}.serving").exists()
                                and (lab.out / f"{run_id}.serving").read_text(), timeout=240, interval=0.2,
                                what="the container to serve on its booked port"))
    assert 24000 <= port <= 24999
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as answer:  # host networking
        assert answer.read() == b"hello from box"
    (container,) = _containers_of(daemon, run_id)
    host_config = container.attrs["HostConfig"]
    release.write_text("go")
    run = lab.wait(run_id, timeout=240)
    assert run["state"]["type"] == "COMPLETED", run["state"]

    record = lab.record(run_id)
    assert record["in_container"] and record["pid1"].endswith("docker-init")  # init=True reaps zombies
    limits = record["limits"]
    assert int(limits["memory"]) == 128 * MB and limits["cpuset"] == "0"
    assert limits["cpu_quota"] in ("50000", "50000 100000")  # 0.5 of a core per 100 ms period
    assert host_config["NanoCpus"] == 500_000_000 and host_config["Memory"] == host_config["MemorySwap"] == 128 * MB
    assert {(m["Target"], m.get("ReadOnly", False)) for m in host_config["Mounts"]} >= {(str(lab.out), False), ("/models", True)}
    assert record["ro_write"].endswith("errno 30")  # EROFS: the ro volume is read-only inside
    env = record["env"]
    assert env["MN_NODE"] == "box" and env["MN_PORT_API"] == str(port) and env["MY_SETTING"] == "kept"
    assert env["MN_VOLUME_MODELS_TARGET"] == "/models"
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "MN_TEST_WORKER_ONLY" not in env  # the run's env and the hints, never the worker's environment
    assert "MN_STORE_URL" not in env and "MN_GRPC_AUTH_TOKEN" not in env  # the worker's secrets stay with it
    assert env["MN_PREEMPT_NOTICE_FILE"].endswith(f"/runs/{run_id}/preempt-notice.json")
    assert record["checkpointed"] is True  # the run's folder is mounted read-write at the same path
    servers.wait_for(lambda: any(f"hello from the container of {run_id}" in line for line in lab.logs(run_id)),
                     timeout=60, what="the container's output in the run's logs", interval=0.5)
    # The run is Completed as soon as its engine says so; the worker then reads the exit code and removes it.
    servers.wait_for(lambda: _containers_of(daemon, run_id) == [], timeout=60, what="the container to be removed")
    servers.wait_for(lambda: not lab.booked(run_id), timeout=60, what="the booking to be released")


def test_an_allocation_past_the_memory_limit_is_killed(lab, daemon):
    deployment = lab.deploy({"image": TOOLCHAIN_IMAGE, "constraints": _on("box"),
                             "resources": {"runtime_driver": "docker", "memory_mb": 192, "volumes": [_out(lab)]}},
                            entrypoint=PROBE)
    run_id = lab.run(deployment, mode="hog")
    run = lab.wait(run_id, timeout=240)
    assert run["state"]["type"] in ("CRASHED", "FAILED"), run["state"]
    assert "137" in run["state"]["message"]  # SIGKILL from the kernel's OOM killer
    assert not (lab.out / f"{run_id}.json").exists()
    servers.wait_for(lambda: _containers_of(daemon, run_id) == [], timeout=60, what="the container to be removed")
    servers.wait_for(lambda: not lab.booked(run_id), timeout=60, what="the booking to be released")


def test_gpu_device_requests_name_the_exact_devices_and_a_failed_start_leaves_no_container(daemon, monkeypatch):
    devices = tuple(Device.model_validate(gpu(i, n, 24576)) for n, i in enumerate(("GPU-1a", "GPU-1b")))
    placement = Placement(agent_id="a", node="gpu-1", resources=PlacedResources(gpu_count=2),
                          allocation=Allocation(devices=devices, runtime_driver="docker"))
    run_id = str(uuid.uuid4())
    spec = container_spec(placement, run_id=run_id, run_name="gpu", image=TOOLCHAIN_IMAGE, command=["/bin/true"],
                          run_env={})
    conn = daemon.client()
    try:
        created = conn.containers.create(**spec.create_kwargs())
        try:
            (request,) = created.attrs["HostConfig"]["DeviceRequests"]
            assert request["DeviceIDs"] == ["GPU-1a", "GPU-1b"] and request["Count"] == 0
            assert request["Driver"] == "nvidia" and request["Capabilities"] == [["gpu"]]
            assert created.attrs["Config"]["Env"].count("CUDA_VISIBLE_DEVICES=GPU-1a,GPU-1b") == 1
        finally:
            created.remove(force=True)
    finally:
        conn.close()
    monkeypatch.setenv("DOCKER_HOST", daemon.host)
    run = docker_io.ContainerRun(spec, log=lambda line: None)
    with pytest.raises(Exception, match="nvidia"):  # no NVIDIA runtime here: the start fails
        run.start()
    assert _containers_of(daemon, run_id) == []


def test_a_docker_run_whose_container_cannot_start_fails_releases_and_leaves_nothing(lab, daemon):
    deployment = lab.deploy({"image": TOOLCHAIN_IMAGE,
                             "resources": {"runtime_driver": "docker", "gpu_count": 1, "volumes": [_out(lab)]}},
                            entrypoint=PROBE)
    run_id = lab.run(deployment)
    run = lab.wait(run_id, timeout=240)
    assert run["state"]["type"] == "FAILED" and "the container did not start" in run["state"]["message"], run["state"]
    assert "nvidia" in run["state"]["message"]
    assert _containers_of(daemon, run_id) == [] and not (lab.out / f"{run_id}.started").exists()
    servers.wait_for(lambda: not lab.booked(run_id), timeout=60, what="the booking to be released")
    (refused,) = _refusals(lab, run_id)
    assert refused["resource"]["prefect.resource.id"] == "mn.node.gpu-1"


def test_cancelling_a_docker_run_stops_and_removes_its_container(lab, daemon):
    deployment = lab.deploy({"image": TOOLCHAIN_IMAGE, "constraints": _on("box"),
                             "resources": {"runtime_driver": "docker", "volumes": [_out(lab)]}}, entrypoint=PROBE)
    run_id = lab.run(deployment, mode="hold", hold_until=str(lab.home / "never"))
    servers.wait_for(lambda: (lab.out / f"{run_id}.started").exists(), timeout=240, interval=0.2,
                     what="the container to start")
    lab.http.post(f"/flow_runs/{run_id}/set_state",
                  json={"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True}).raise_for_status()
    run = lab.wait(run_id, states={"CANCELLED"}, timeout=120)
    assert "container was stopped" in run["state"]["message"]
    servers.wait_for(lambda: _containers_of(daemon, run_id) == [], timeout=60, what="the container to be removed")
    servers.wait_for(lambda: not lab.booked(run_id), timeout=60, what="the booking to be released")


def test_a_restarted_worker_removes_the_containers_its_predecessor_left(lab, daemon):
    orphan_run = str(uuid.uuid4())
    conn = daemon.client()
    try:
        conn.containers.run(TOOLCHAIN_IMAGE, ["/bin/sleep", "600"], detach=True, network_mode="host",
                            labels={NODE_LABEL: "odd-1", RUN_LABEL: orphan_run},
                            mounts=[{"Type": "bind", "Source": "/usr", "Target": "/usr", "ReadOnly": True}])
    finally:
        conn.close()
    other = daemon.containers(label=f"{NODE_LABEL}=odd-1")
    assert [c.labels[RUN_LABEL] for c in other] == [orphan_run]
    stop_process(lab.worker_of("odd-1"))
    lab.restart_worker("odd-1")
    servers.wait_for(lambda: _containers_of(daemon, orphan_run) == [], timeout=120,
                     what="the restarted worker to remove the orphaned container")


def test_a_driver_the_worker_cannot_launch_is_refused_never_run_as_a_host_process(lab):
    deployment = lab.deploy({"resources": {"runtime_driver": "podman", "volumes": [_out(lab)]}}, entrypoint=PROBE)
    run_id = lab.run(deployment)
    run = lab.wait(run_id, timeout=180)
    assert run["state"]["type"] == "FAILED", run["state"]
    assert "runtime driver 'podman' has no launcher in mn-prefect" in run["state"]["message"]
    assert not (lab.out / f"{run_id}.started").exists()  # nothing ran
    servers.wait_for(lambda: not lab.booked(run_id), timeout=60, what="the booking to be released")
    (refused,) = _refusals(lab, run_id)
    assert refused["resource"]["prefect.resource.id"] == "mn.node.odd-1"


def test_a_volume_whose_source_escapes_its_host_path_at_launch_fails_before_it_starts(lab):
    # Placement compares paths as written (it cannot see the node's disk): a symlink inside the host path
    # passes it. The node's worker resolves the source again at launch and refuses the run.
    link = lab.scratch / "escape"
    link.symlink_to("/etc")
    deployment = lab.deploy({"constraints": _on("box"), "resources": {"volumes": [
        _out(lab), {"name": "data", "source": str(link), "target": "/data"}]}}, entrypoint=PROBE)
    run_id = lab.run(deployment)
    run = lab.wait(run_id, timeout=180)
    assert run["state"]["type"] == "FAILED", run["state"]
    assert f"volume data: {link} resolves to /etc, outside every advertised host path" in run["state"]["message"]
    assert not (lab.out / f"{run_id}.started").exists()
    servers.wait_for(lambda: not lab.booked(run_id), timeout=60, what="the booking to be released")
    assert [e["payload"]["reason"] for e in _refusals(lab, run_id)] == [
        f"volume data: {link} resolves to /etc, outside every advertised host path"]


def test_a_docker_run_without_an_image_fails_naming_the_field_and_books_nothing(lab):
    deployment = lab.deploy({"resources": {"runtime_driver": "docker", "cpu": 1}}, entrypoint=PROBE)
    run_id = lab.run(deployment)
    run = lab.wait(run_id, timeout=180)
    assert run["state"]["type"] == "FAILED", run["state"]
    assert "job_variables.image: is required with runtime_driver docker" in run["state"]["message"]
    assert lab.store.history(run_id) == []  # never booked



def test_a_bundle_agent_with_the_docker_runner_runs_each_step_in_its_own_container(daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", daemon.host)
    monkeypatch.setenv(docker_io.TOOLCHAIN_VAR, ":".join(docker_io.default_toolchain()))
    folder = write_bundle(tmp_path, "boxed", [step("a", mode="fail_first", attempts=2), step("b")], [("a", "b")],
                          sink_from="b", resources={"cpu_cores": 0.5, "memory_mb": 96},
                          runner="MirrorNeuron.Runner.DockerWorker", image=TOOLCHAIN_IMAGE)
    outcome, launches = run_bundle(folder, tmp_path)
    assert outcome.state == "COMPLETED", outcome.result
    assert [(entry["step"], entry["attempt"]) for entry in launches] == [("a", 1), ("a", 2), ("b", 1)]
    for entry in launches:
        assert entry["in_container"] and int(entry["memory_limit"]) == 96 * MB
        assert entry["cuda_visible_devices"] == "" and entry["docker_host"] is None  # the step's env only
        assert json.loads(entry["allocation"])["node"]
    assert daemon.containers() == []  # each attempt's container removed, the failed one included


def test_a_docker_worker_image_missing_on_the_node_is_built_from_the_bundle_and_cached_by_content(daemon, tmp_path,
                                                                                              monkeypatch):
    """MirrorNeuron's layout: a DockerWorker agent's image that the node lacks is built from
    payloads/<upload_path>/docker_worker (its Dockerfile), labelled with a digest of that folder; the next launch
    uses it as built, and changed content builds it again."""
    import docker as docker_py

    monkeypatch.setenv("DOCKER_HOST", daemon.host)
    monkeypatch.setenv(docker_io.TOOLCHAIN_VAR, ":".join(docker_io.default_toolchain()))
    tag = f"mn-test/built-step-{tmp_path.name[-6:].lower()}:local"
    folder = write_bundle(tmp_path, "baked", [step("a")], [], sink_from="a",
                          runner="MirrorNeuron.Runner.DockerWorker", image=tag)
    context = folder / "payloads" / "worker" / "docker_worker"
    context.mkdir()
    (context / "Dockerfile").write_text(f"FROM {TOOLCHAIN_IMAGE}\nCOPY baked.txt /baked.txt\n")
    (context / "baked.txt").write_text("first")
    for run in ("one", "two", "three"):
        (tmp_path / run).mkdir()
    conn = docker_py.DockerClient(base_url=daemon.host)
    try:
        outcome, launches = run_bundle(folder, tmp_path / "one")
        assert outcome.state == "COMPLETED", outcome.result
        assert launches[0]["baked"] == "first" and launches[0]["in_container"]
        built = conn.images.get(tag)
        assert built.labels[docker_io.BUILD_LABEL] == docker_io.context_digest(context)
        outcome, _ = run_bundle(folder, tmp_path / "two")
        assert outcome.state == "COMPLETED" and conn.images.get(tag).id == built.id  # the same content: not rebuilt
        (context / "baked.txt").write_text("second")
        outcome, launches = run_bundle(folder, tmp_path / "three")
        assert outcome.state == "COMPLETED" and launches[0]["baked"] == "second"
        assert conn.images.get(tag).id != built.id
    finally:
        conn.close()


def test_mirrorneurons_docker_worker_demo_builds_its_image_and_completes(daemon, tmp_path, monkeypatch):
    """examples/bundles/demo_docker_worker, unmodified: its run step's image, missing on the node, is built from
    payloads/worker/docker_worker (``FROM alpine:3.22``: with no registry here, the toolchain image stands in under
    that name), its checksum script runs in a container of it, and the host step publishes the result."""
    import docker as docker_py

    monkeypatch.setenv("DOCKER_HOST", daemon.host)
    monkeypatch.setenv(docker_io.TOOLCHAIN_VAR, ":".join(docker_io.default_toolchain()))
    conn = docker_py.DockerClient(base_url=daemon.host)
    try:
        conn.images.get(TOOLCHAIN_IMAGE).tag("alpine", "3.22")
        outcome, _ = run_bundle(EXAMPLES / "demo_docker_worker", tmp_path)
        assert outcome.state == "COMPLETED", outcome.result
        built = conn.images.get("mirror-neuron/demo-docker-worker:local")
        context = EXAMPLES / "demo_docker_worker" / "payloads" / "worker" / "docker_worker"
        assert built.labels[docker_io.BUILD_LABEL] == docker_io.context_digest(context)
    finally:
        conn.close()
    checksum = hashlib.sha256(b"mirror-neuron-demo").hexdigest()
    result = json.loads((tmp_path / "runs" / "run-1" / "result.json").read_text())
    assert checksum in json.dumps(result), result
    assert daemon.containers() == []


def test_a_build_folder_without_a_dockerfile_refuses_the_bundle_naming_the_field(tmp_path):
    from mn_prefect.bundles.bundle import load_bundle
    from mn_prefect.model.issues import InvalidInput

    folder = write_bundle(tmp_path, "unbaked", [step("a")], [], sink_from="a",
                          runner="MirrorNeuron.Runner.DockerWorker", image="mn-test/none:local")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["agents"]["nodes"][0]["config"]["build"] = "worker/image"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidInput) as refused:
        load_bundle(folder)
    assert [i.path for i in refused.value.issues] == ["agents.nodes[a].config.build"]


def test_mirrorneurons_docker_worker_demo_completes_through_the_mn_pool(lab, daemon, tmp_path):
    """examples/bundles/demo_docker_worker, unmodified, through this lab's pool (`mn-prefect blueprint run --pool`):
    its DockerWorker step is placed on a node whose worker reaches the daemon, its image is built there from the
    bundle's payload, and the run ends with the standard run store and the checksum MirrorNeuron's demo suite looks
    for."""
    import subprocess
    import sys

    import docker as docker_py

    conn = docker_py.DockerClient(base_url=daemon.host)
    conn.images.get(TOOLCHAIN_IMAGE).tag("alpine", "3.22")  # the Dockerfile's base: no registry here
    conn.close()
    runs = tmp_path / "runs"
    env = {**lab.server.env, **daemon.env, "MN_STORE_URL": lab.store_url, "HOME": str(tmp_path),
           "MN_PREFECT_HOME": str(tmp_path / ".mn-prefect")}
    env.pop("MN_INVENTORY_FILE", None)
    done = subprocess.run([str(Path(sys.executable).parent / "mn-prefect"), "blueprint", "run",
                           str(EXAMPLES / "demo_docker_worker"), "--pool", lab.pool, "--wait", "--json", "--runs-root",
                           str(runs), "--run-id", "demo-docker-1", "--timeout", "400"], env=env, capture_output=True,
                          text=True, timeout=480)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["state"] == "COMPLETED", doc
    assert doc["steps"]["run"]["node"] in {n["name"] for n in lab.nodes}, doc["steps"]
    conn = docker_py.DockerClient(base_url=daemon.host)
    try:  # built on the node from the bundle's payload, labelled with its content
        built = conn.images.get("mirror-neuron/demo-docker-worker:local")
        context = EXAMPLES / "demo_docker_worker" / "payloads" / "worker" / "docker_worker"
        assert built.labels[docker_io.BUILD_LABEL] == docker_io.context_digest(context)
    finally:
        conn.close()
    store = runs / "demo-docker-1"
    assert {"run.json", "result.json", "final_artifact.json", "events.jsonl"} <= {p.name for p in store.iterdir()}
    assert json.loads((store / "run.json").read_text())["status"] == "completed"
    assert hashlib.sha256(b"mirror-neuron-demo").hexdigest() in (store / "result.json").read_text()
    servers.wait_for(lambda: not lab.booked(doc["flow_run_id"]), timeout=60, interval=0.5,
                     what="the run's booking released once its process ended")
    assert daemon.containers() == []
