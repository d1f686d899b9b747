"""Local-machine inventory through the real code paths; hardware is faked only at the lowest level.

NVIDIA: a C stand-in for ``libnvidia-ml.so.1`` (tests/fake_nvml/fake_nvml.c) that the real pynvml loads with
ctypes, so detection runs in a subprocess with LD_LIBRARY_PATH pointing at it. AMD and Apple: fake ``rocm-smi``
and ``system_profiler`` executables first on PATH, run by the real ``subprocess`` calls.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import platform
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mn_prefect.inventory.hostpaths import resolve_host_paths, volume_escapes
from mn_prefect.inventory.nvidia import mig_profile_name
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import VolumeAllocation

HERE = Path(__file__).parent
REPO = HERE.parent
MN_PREFECT = Path(sys.executable).parent / "mn-prefect"

A100 = "GPU-aaa,NVIDIA A100,40960,40000,8,0"
T4 = "GPU-bbb,Tesla T4,16384,16000,7,5"
A100_MIG = "GPU-mig,NVIDIA A100 80GB PCIe,81920,81000,8,0,on"  # last field: MIG mode on

# Prints every node local_nodes() returns, full records (api_version, os, arch, labels are not in `resource list`).
INVENTORY_SNIPPET = (
    "import json; from mn_prefect.inventory import local_nodes; "
    "print(json.dumps([n.model_dump(mode='json') for n in local_nodes()]))"
)


# --------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def fake_nvml_dir(fake_gpu_libs) -> Path:
    """A directory holding the fake ``libnvidia-ml.so.1`` (and ``libcuda.so.1``), compiled once per session."""
    return fake_gpu_libs


@pytest.fixture(scope="session")
def empty_lib_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("no_nvml")


@pytest.fixture
def base_env(fake_nvml_dir) -> dict[str, str]:
    """The inherited environment minus every MN_* / FAKE_NVML_* variable, with the fake NVML (no devices) loaded,
    so a real GPU or a developer's own MN_NODE_* settings never leak into a test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MN_", "FAKE_NVML_"))}
    env["LD_LIBRARY_PATH"] = str(fake_nvml_dir)
    env["COLUMNS"] = "250"  # rich wraps error tables at 80 columns otherwise, splitting long file names
    env.pop("PYTHONPATH", None)
    return env


def with_tool(env: dict[str, str], tool_dir: Path) -> dict[str, str]:
    return {**env, "PATH": f"{tool_dir}{os.pathsep}{env.get('PATH', '')}"}


def write_tool(directory: Path, name: str, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def inventory(env: dict[str, str]) -> tuple[int, list[dict], str]:
    """(exit code, local_nodes() as dicts, stderr) from a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", INVENTORY_SNIPPET], env=env, capture_output=True, text=True,
                          timeout=60)
    nodes = json.loads(proc.stdout) if proc.returncode == 0 else []
    return proc.returncode, nodes, proc.stderr


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    command = [str(MN_PREFECT)] if MN_PREFECT.exists() else [sys.executable, "-m", "mn_prefect.cli.app"]
    return subprocess.run(command + list(args), env=env, capture_output=True, text=True, timeout=60)


def resource_list(env: dict[str, str]) -> dict:
    proc = cli(env, "resource", "list", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout)


def only_node(env: dict[str, str]) -> dict:
    rc, nodes, stderr = inventory(env)
    assert rc == 0, stderr
    assert len(nodes) == 1
    return nodes[0]


def vendor_devices(node: dict, vendor: str) -> list[dict]:
    return [d for d in node["devices"] if d["vendor"] == vendor]


def assert_invalid(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, every needle named on stderr, and no Python traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


# ------------------------------------------------------------------------------------------------------ NVIDIA


def test_nvml_devices_are_detected_through_pynvml(base_env):
    node = only_node({**base_env, "FAKE_NVML_DEVICES": f"{A100};{T4}"})
    gpus = vendor_devices(node, "nvidia")
    assert [(d["id"], d["index"], d["model"]) for d in gpus] == [
        ("GPU-aaa", 0, "NVIDIA A100"), ("GPU-bbb", 1, "Tesla T4")]
    assert [(d["memory_total_mb"], d["memory_free_mb"]) for d in gpus] == [(40960.0, 40000.0), (16384.0, 16000.0)]
    assert {(d["kind"], d["vendor"], d["driver"], d["api_version"]) for d in gpus} == {("gpu", "nvidia", "cuda", "12.4")}
    assert gpus[0]["capabilities"] == ["sm_80", "fp16", "bf16", "tf32"]
    assert gpus[1]["capabilities"] == ["sm_75", "fp16"]
    assert {"gpu", "nvidia", "cuda"} <= set(node["capabilities"])


def test_resource_list_reports_nvml_gpus_and_their_memory(base_env):
    usage = resource_list({**base_env, "FAKE_NVML_DEVICES": f"{A100};{T4}"})
    (node,) = usage["nodes"]
    assert node["name"] == socket.gethostname()
    assert node["total"]["gpu_count"] == 2
    assert node["free"]["gpu_count"] == 2
    assert node["gpu_memory_total_mb"] == 40960.0 + 16384.0
    assert [(d["id"], d["held"]) for d in node["devices"]] == [("GPU-aaa", False), ("GPU-bbb", False)]
    assert {"gpu", "nvidia", "cuda"} <= set(node["capabilities"])


def test_no_nvml_library_means_no_nvidia_devices_not_an_error(base_env, empty_lib_dir):
    # On a machine with a real driver the system library is found past LD_LIBRARY_PATH: then the fake
    # devices must still be absent (the real ones may show), and detection must still not fail.
    real_library = ctypes.util.find_library("nvidia-ml") is not None
    env = {**base_env, "LD_LIBRARY_PATH": str(empty_lib_dir), "FAKE_NVML_DEVICES": A100}
    node = only_node(env)
    found = vendor_devices(node, "nvidia")
    assert "GPU-aaa" not in {d["id"] for d in found}
    if not real_library:
        assert found == []
    proc = cli(env, "resource", "list", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


def test_nvml_init_failure_means_no_nvidia_devices_not_an_error(base_env):
    env = {**base_env, "FAKE_NVML_DEVICES": A100, "FAKE_NVML_INIT_RESULT": "9"}  # NVML_ERROR_DRIVER_NOT_LOADED
    rc, nodes, stderr = inventory(env)
    assert rc == 0, stderr
    assert vendor_devices(nodes[0], "nvidia") == []
    assert "Driver Not Loaded" in stderr  # logged as a warning, not raised
    usage = resource_list(env)
    assert usage["nodes"][0]["total"]["gpu_count"] == 0


def test_a_gpu_nvml_cannot_describe_is_skipped_and_the_others_reported(base_env):
    env = {**base_env, "FAKE_NVML_DEVICES": f"{A100};ERR,Broken GPU,8192,8000,8,6;{T4}"}
    rc, nodes, stderr = inventory(env)
    assert rc == 0, stderr
    gpus = vendor_devices(nodes[0], "nvidia")
    assert [(d["id"], d["index"], d["model"]) for d in gpus] == [
        ("GPU-aaa", 0, "NVIDIA A100"), ("GPU-bbb", 2, "Tesla T4")]  # indices stay the driver's
    assert "GPU 1" in stderr and "skipped" in stderr


def test_fp8_is_advertised_from_compute_capability_8_9(base_env):
    node = only_node({**base_env, "FAKE_NVML_DEVICES": "GPU-ada,NVIDIA L4,23034,22000,8,9"})
    (gpu,) = vendor_devices(node, "nvidia")
    assert gpu["capabilities"] == ["sm_89", "fp16", "bf16", "tf32", "fp8"]


# ------------------------------------------------------------------------------------------------- NVIDIA MIG


def mig_slice(slot: int, uuid: str, gpu_slices: int, memory_size_mb: int, total_mb: int, free_mb: int,
              parent: str = "GPU-mig") -> str:
    """One FAKE_NVML_MIG_DEVICES entry: a MIG device at ``slot`` of ``parent``."""
    return f"{parent},{slot},{uuid},{gpu_slices},{memory_size_mb},{total_mb},{free_mb}"


def mig_env(base_env: dict[str, str], devices: str, *slices: str) -> dict[str, str]:
    return {**base_env, "FAKE_NVML_DEVICES": devices, "FAKE_NVML_MIG_DEVICES": ";".join(slices)}


SEVEN_1G_10GB = [mig_slice(i, f"MIG-{i}", 1, 9984, 9856, 9856 - i) for i in range(7)]


def test_a_gpu_in_mig_mode_reports_its_slices_as_devices(base_env):
    node = only_node(mig_env(base_env, f"{A100_MIG};{T4}", *SEVEN_1G_10GB))
    gpus = vendor_devices(node, "nvidia")
    parent, slices, t4 = gpus[0], gpus[1:8], gpus[8]
    assert (parent["id"], parent["index"], parent["mig_mode"], parent.get("parent")) == ("GPU-mig", 0, True, None)
    assert [(d["id"], d["parent"], d["mig_profile"], d["index"]) for d in slices] == [
        (f"MIG-{i}", "GPU-mig", "1g.10gb", 0) for i in range(7)]
    assert [(d["memory_total_mb"], d["memory_free_mb"]) for d in slices] == [(9856.0, 9856.0 - i) for i in range(7)]
    for field in ("kind", "vendor", "driver", "model", "api_version", "capabilities"):
        assert {json.dumps(d[field]) for d in slices} == {json.dumps(parent[field])}, field
    assert not any(d["mig_mode"] for d in slices)
    assert (t4["id"], t4["index"], t4["mig_mode"]) == ("GPU-bbb", 1, False)


def test_detected_mig_slices_make_a_valid_node_record_whose_whole_gpus_exclude_them(base_env):
    record = NodeRecord.model_validate(only_node(mig_env(base_env, f"{A100_MIG};{T4}", *SEVEN_1G_10GB)))
    assert [d.id for d in record.gpu_devices] == ["GPU-mig", "GPU-bbb"]
    assert sum(d.is_slice for d in record.devices) == 7


def test_mixed_mig_profiles_are_named_from_nvml_attributes(base_env):
    env = mig_env(base_env, A100_MIG, mig_slice(0, "MIG-big", 3, 40192, 40064, 40064),
                  mig_slice(1, "MIG-mid-a", 2, 19968, 19840, 19840), mig_slice(2, "MIG-mid-b", 2, 19968, 19840, 100))
    slices = vendor_devices(only_node(env), "nvidia")[1:]
    assert [(d["id"], d["mig_profile"], d["memory_total_mb"], d["memory_free_mb"]) for d in slices] == [
        ("MIG-big", "3g.40gb", 40064.0, 40064.0), ("MIG-mid-a", "2g.20gb", 19840.0, 19840.0),
        ("MIG-mid-b", "2g.20gb", 19840.0, 100.0)]


@pytest.mark.parametrize("gpu_slices, memory_mb, compute_slices, name", [
    (1, 9984, 1, "1g.10gb"),
    (1, 4864, 1, "1g.5gb"),
    (2, 19968, 2, "2g.20gb"),
    (3, 40192, 3, "3g.40gb"),
    (7, 81152, 7, "7g.80gb"),
    (3, 19968, 1, "1c.3g.20gb"),  # a compute instance holding part of its GPU instance
])
def test_mig_profile_names_round_memory_up_to_whole_gigabytes(gpu_slices, memory_mb, compute_slices, name):
    assert mig_profile_name(gpu_slices, memory_mb, compute_slices) == name


@pytest.mark.parametrize("mig_field", ["", ",off"], ids=["not-mig-capable", "mig-disabled"])
def test_a_gpu_not_in_mig_mode_gives_no_slices(base_env, mig_field):
    # The slices named for it are never asked for: only a GPU whose current MIG mode is on is enumerated.
    env = mig_env(base_env, f"GPU-mig,NVIDIA A100 80GB PCIe,81920,81000,8,0{mig_field}", *SEVEN_1G_10GB)
    rc, nodes, stderr = inventory(env)
    assert rc == 0, stderr
    (gpu,) = vendor_devices(nodes[0], "nvidia")
    assert (gpu["id"], gpu["mig_mode"]) == ("GPU-mig", False)
    assert "MIG" not in stderr


def test_a_mig_index_without_a_slice_is_skipped_silently(base_env):
    env = mig_env(base_env, A100_MIG, mig_slice(0, "MIG-0", 1, 9984, 9856, 9856),
                  mig_slice(3, "MIG-3", 1, 9984, 9856, 9856))
    rc, nodes, stderr = inventory(env)
    assert rc == 0, stderr
    assert [d["id"] for d in vendor_devices(nodes[0], "nvidia")] == ["GPU-mig", "MIG-0", "MIG-3"]
    assert "skipped" not in stderr


def test_a_mig_slice_nvml_cannot_describe_is_skipped_with_a_warning(base_env):
    env = mig_env(base_env, A100_MIG, mig_slice(0, "MIG-0", 1, 9984, 9856, 9856),
                  mig_slice(1, "ERR", 1, 9984, 9856, 9856), mig_slice(2, "MIG-2", 1, 9984, 9856, 9856))
    rc, nodes, stderr = inventory(env)
    assert rc == 0, stderr
    assert [d["id"] for d in vendor_devices(nodes[0], "nvidia")] == ["GPU-mig", "MIG-0", "MIG-2"]
    assert "MIG slice 1 of GPU 0" in stderr and "skipped" in stderr


# --------------------------------------------------------------------------------------------------- mock file


OVERLAY_JSON = {"name": "mock-box", "cpu_cores": 96, "labels": {"zone": "a", "rack": "r1"},
                "capabilities": ["docker"],
                "devices": [{"id": "GPU-mock-0", "index": 0, "vendor": "nvidia", "driver": "cuda",
                             "model": "H100", "memory_total_mb": 81920, "capabilities": ["sm_90"]}]}
OVERLAY_TOML = """\
name = "mock-box"
cpu_cores = 96
capabilities = ["docker"]

[labels]
zone = "a"
rack = "r1"

[[devices]]
id = "GPU-mock-0"
index = 0
vendor = "nvidia"
driver = "cuda"
model = "H100"
memory_total_mb = 81920
capabilities = ["sm_90"]
"""


@pytest.fixture(params=["json", "toml"])
def overlay_file(request, tmp_path) -> Path:
    path = tmp_path / f"inventory.{request.param}"
    path.write_text(json.dumps(OVERLAY_JSON) if request.param == "json" else OVERLAY_TOML)
    return path


def test_mock_inventory_file_is_laid_over_the_detected_machine(base_env, overlay_file):
    # The fake NVML has a GPU too: a mock record that declares devices replaces detection entirely.
    node = only_node({**base_env, "MN_INVENTORY_FILE": str(overlay_file), "FAKE_NVML_DEVICES": A100})
    assert node["name"] == "mock-box"
    assert node["cpu_cores"] == 96
    assert node["labels"] == {"zone": "a", "rack": "r1"}
    assert [(d["id"], d["model"], d["memory_total_mb"]) for d in node["devices"]] == [("GPU-mock-0", "H100", 81920)]
    # Fields the file leaves out come from detection.
    assert node["os"] == platform.system().lower()
    assert node["arch"] == platform.machine().lower()
    assert node["memory_mb"] > 0 and node["disk_mb"] > 0
    assert {"docker", "gpu", "nvidia", "cuda"} <= set(node["capabilities"])


def test_mock_file_without_devices_keeps_the_detected_devices(base_env, tmp_path):
    path = tmp_path / "inventory.json"
    path.write_text(json.dumps({"name": "renamed", "cpu_cores": 4}))
    node = only_node({**base_env, "MN_INVENTORY_FILE": str(path), "FAKE_NVML_DEVICES": A100})
    assert (node["name"], node["cpu_cores"]) == ("renamed", 4)
    assert [d["id"] for d in vendor_devices(node, "nvidia")] == ["GPU-aaa"]


@pytest.mark.parametrize("suffix", ["json", "toml"])
def test_a_fleet_file_adds_its_nodes_to_resource_list(base_env, tmp_path, suffix):
    path = tmp_path / f"fleet.{suffix}"
    if suffix == "json":
        path.write_text(json.dumps({"nodes": [
            {"name": "gpu-box", "cpu_cores": 32, "memory_mb": 65536, "disk_mb": 100000,
             "devices": [{"id": "GPU-x", "vendor": "nvidia", "driver": "cuda", "memory_total_mb": 24576}]},
            {"name": "cpu-box", "cpu_cores": 8, "memory_mb": 16384}]}))
    else:
        path.write_text(textwrap.dedent("""\
            [[nodes]]
            name = "gpu-box"
            cpu_cores = 32
            memory_mb = 65536
            disk_mb = 100000
            [[nodes.devices]]
            id = "GPU-x"
            vendor = "nvidia"
            driver = "cuda"
            memory_total_mb = 24576

            [[nodes]]
            name = "cpu-box"
            cpu_cores = 8
            memory_mb = 16384
            """))
    usage = resource_list({**base_env, "MN_INVENTORY_FILE": str(path)})
    nodes = {n["name"]: n for n in usage["nodes"]}
    assert sorted(nodes) == sorted([socket.gethostname(), "gpu-box", "cpu-box"])  # this machine plus the file's
    assert nodes["gpu-box"]["total"] == {"cpu_cores": 32.0, "memory_mb": 65536.0, "disk_mb": 100000.0, "gpu_count": 1.0}
    assert nodes["gpu-box"]["gpu_memory_total_mb"] == 24576.0
    assert {"gpu", "nvidia", "cuda"} <= set(nodes["gpu-box"]["capabilities"])
    assert nodes["cpu-box"]["total"]["gpu_count"] == 0
    assert usage["total"]["cpu_cores"] == pytest.approx(nodes[socket.gethostname()]["total"]["cpu_cores"] + 40)


MIG_GPU = {"id": "GPU-m", "index": 0, "vendor": "nvidia", "driver": "cuda", "memory_total_mb": 81920,
           "mig_mode": True}
MIG_SLICES = [{"id": f"MIG-m{i}", "index": 0, "vendor": "nvidia", "driver": "cuda", "parent": "GPU-m",
               "mig_profile": "1g.10gb", "memory_total_mb": 9728} for i in range(2)]
MIG_TOML = """\
name = "mig-box"

[[devices]]
id = "GPU-m"
vendor = "nvidia"
driver = "cuda"
memory_total_mb = 81920
mig_mode = true

[[devices]]
id = "MIG-m0"
vendor = "nvidia"
driver = "cuda"
parent = "GPU-m"
mig_profile = "1G.10GB"
memory_total_mb = 9728

[[devices]]
id = "MIG-m1"
vendor = "nvidia"
driver = "cuda"
parent = "GPU-m"
mig_profile = "1g.10gb"
memory_total_mb = 9728
"""


@pytest.mark.parametrize("suffix", ["json", "toml"])
def test_a_mock_file_declares_mig_slices(base_env, tmp_path, suffix):
    path = tmp_path / f"inventory.{suffix}"
    path.write_text(json.dumps({"name": "mig-box", "devices": [MIG_GPU, *MIG_SLICES]}) if suffix == "json"
                    else MIG_TOML)
    node = only_node({**base_env, "MN_INVENTORY_FILE": str(path), "FAKE_NVML_DEVICES": A100})
    assert [(d["id"], d["mig_mode"], d.get("parent"), d.get("mig_profile"), d["memory_total_mb"])
            for d in node["devices"]] == [("GPU-m", True, None, None, 81920), ("MIG-m0", False, "GPU-m", "1g.10gb", 9728),
                                          ("MIG-m1", False, "GPU-m", "1g.10gb", 9728)]


def test_a_mock_slice_whose_parent_is_not_in_mig_mode_exits_2_naming_the_device(base_env, tmp_path):
    path = tmp_path / "inventory.json"
    path.write_text(json.dumps({"name": "mig-box", "devices": [{**MIG_GPU, "mig_mode": False}, *MIG_SLICES]}))
    assert_invalid(cli({**base_env, "MN_INVENTORY_FILE": str(path)}, "resource", "list", "--json"),
                   str(path), "MIG-m0", "'GPU-m' is not in MIG mode")


def test_the_mig_example_fleet_file_loads(base_env):
    rc, nodes, stderr = inventory({**base_env, "MN_INVENTORY_FILE": str(REPO / "deployments" / "mock-nodes-mig.json")})
    assert rc == 0, stderr
    by_name = {n["name"]: NodeRecord.model_validate(n) for n in nodes}
    mig_node, l4_node = by_name["gpu-mig-1"], by_name["gpu-l4-1"]
    assert [(d.id, d.mig_mode) for d in mig_node.gpu_devices] == [("GPU-3a", True), ("GPU-3b", False)]
    slices = [d for d in mig_node.devices if d.is_slice]
    assert len(slices) == 7
    assert {(d.parent, d.mig_profile, d.index) for d in slices} == {("GPU-3a", "1g.10gb", 0)}
    assert all(d.id.startswith("MIG-") for d in slices)
    assert [(d.model, d.memory_total_mb) for d in l4_node.gpu_devices] == [("NVIDIA L4", 24576), ("NVIDIA L4", 24576)]


def test_mock_file_host_paths_in_object_form_are_accepted_and_resolved(base_env, tmp_path):
    real = tmp_path / "models"
    real.mkdir()
    (tmp_path / "models-link").symlink_to(real)
    path = tmp_path / "inventory.json"
    path.write_text(json.dumps({"name": "box", "host_paths": [{"path": str(tmp_path / "models-link")}]}))
    node = only_node({**base_env, "MN_INVENTORY_FILE": str(path)})
    assert node["host_paths"] == [os.path.realpath(real)]


@pytest.mark.parametrize("host_paths", [["relative/models"], "/mnt/models"])
def test_mock_file_host_paths_are_validated_before_resolution(base_env, tmp_path, host_paths):
    # A relative path must not be silently made absolute against the current directory, and a bare string
    # must not be iterated character by character.
    path = tmp_path / "inventory.json"
    path.write_text(json.dumps({"name": "box", "host_paths": host_paths}))
    assert_invalid(cli({**base_env, "MN_INVENTORY_FILE": str(path)}, "resource", "list", "--json"),
                   str(path), "host_paths")


# --------------------------------------------------------------------------------------------------- overrides


def test_mn_node_overrides_win_over_the_mock_file(base_env, tmp_path, overlay_file):
    data = tmp_path / "data"
    data.mkdir()
    real_models = tmp_path / "real-models"
    real_models.mkdir()
    (tmp_path / "models").symlink_to(real_models)
    env = {**base_env, "MN_INVENTORY_FILE": str(overlay_file),
           "MN_NODE_NAME": "env-box", "MN_NODE_CPU_CORES": "3.5", "MN_NODE_GROUP": "gpu-pool",
           "MN_NODE_CAPABILITIES": "ssd, avx512", "MN_NODE_LABELS": "zone=b,team=ml",
           "MN_NODE_HOST_PATHS": f"{data};{tmp_path / 'models'}"}
    node = only_node(env)
    assert node["name"] == "env-box" and node["group"] == "gpu-pool"
    assert node["cpu_cores"] == 3.5
    assert {"docker", "ssd", "avx512"} <= set(node["capabilities"])  # added to the file's capabilities
    assert node["labels"] == {"zone": "b", "rack": "r1", "team": "ml"}  # merged, the variable wins on zone
    assert node["host_paths"] == [os.path.realpath(data), os.path.realpath(real_models)]  # symlink resolved
    assert [d["id"] for d in node["devices"]] == ["GPU-mock-0"]  # untouched fields stay the file's

    (usage_node,) = resource_list(env)["nodes"]
    assert usage_node["name"] == "env-box"
    assert usage_node["total"]["cpu_cores"] == 3.5
    assert usage_node["host_paths"] == node["host_paths"]


@pytest.mark.parametrize("var, value", [
    ("MN_NODE_CPU_CORES", "abc"),
    ("MN_NODE_MEMORY_MB", "lots"),
    ("MN_NODE_SCHEDULING_ELIGIBLE", "maybe"),
    ("MN_NODE_LABELS", "zone"),
])
def test_a_bad_mn_node_value_exits_2_naming_the_variable(base_env, var, value):
    proc = cli({**base_env, var: value}, "resource", "list", "--json")
    assert_invalid(proc, var, repr(value))
    assert proc.stdout == ""


def test_a_relative_mn_node_host_path_is_rejected(base_env):
    assert_invalid(cli({**base_env, "MN_NODE_HOST_PATHS": "relative/dir"}, "resource", "list"),
                   "host_paths", "relative/dir")


# -------------------------------------------------------------------------------------------- bad mock files


@pytest.mark.parametrize("name, content, message", [
    ("broken.json", '{"name": "x",', "malformed JSON"),
    ("broken.toml", 'name = "x"\ncpu_cores = \n', "malformed TOML"),
    ("empty.json", "  \n", "empty"),
    ("empty.toml", "", "empty"),
    ("scalar.json", "42", "got number"),
    ("string.json", '"box"', "got string"),
    ("not-a-node.json", '{"name": "x", "cpu_cores": "many"}', "cpu_cores"),
    ("bad-fleet.json", '{"nodes": 5}', "must be a list of node records"),
])
def test_a_bad_mock_file_exits_2_naming_the_file(base_env, tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    proc = cli({**base_env, "MN_INVENTORY_FILE": str(path)}, "resource", "list", "--json")
    assert_invalid(proc, str(path), message)


def test_a_missing_mock_file_exits_2_naming_the_file(base_env, tmp_path):
    path = tmp_path / "nowhere.json"
    assert_invalid(cli({**base_env, "MN_INVENTORY_FILE": str(path)}, "resource", "list"),
                   str(path), "cannot read")


# ----------------------------------------------------------------------------------------------------- AMD


def rocm_smi_output(series_key: str) -> dict:
    """Shaped like `rocm-smi --showproductname --showmeminfo vram --showuniqueid --json` on two MI210s."""
    return {
        "card0": {series_key: "AMD Instinct MI210", "Card Model": "0x0c34", "Card Vendor": "Advanced Micro Devices, Inc. [AMD/ATI]",
                  "Card SKU": "D67301", "GFX Version": "gfx90a", "Unique ID": "0x6a2d5a8a7e1b1234",
                  "VRAM Total Memory (B)": "68702699520", "VRAM Total Used Memory (B)": "11071488"},
        "card1": {series_key: "AMD Instinct MI210", "Card Model": "0x0c34", "Card Vendor": "Advanced Micro Devices, Inc. [AMD/ATI]",
                  "Card SKU": "D67301", "GFX Version": "gfx90a", "Unique ID": "0x1f0e6c2b9d3c5678",
                  "VRAM Total Memory (B)": "3221225472", "VRAM Total Used Memory (B)": "2325348894"},
        "system": {"Driver version": "6.7.0"},
    }


def fake_rocm_smi(tool_dir: Path, payload: dict, exit_code: int = 0) -> None:
    (tool_dir / "rocm-smi.json").parent.mkdir(parents=True, exist_ok=True)
    (tool_dir / "rocm-smi.json").write_text(json.dumps(payload))
    write_tool(tool_dir, "rocm-smi", f"""\
        case "$*" in
          *--showproductname*--showmeminfo*vram*--showuniqueid*--json*) ;;
          *) echo "unexpected arguments: $*" >&2; exit 64 ;;
        esac
        cat "$(dirname "$0")/rocm-smi.json"
        exit {exit_code}
        """)


@pytest.mark.parametrize("series_key", ["Card series", "Card Series"])  # older rocm-smi / ROCm 6
def test_amd_gpus_are_detected_through_rocm_smi(base_env, tmp_path, series_key):
    fake_rocm_smi(tmp_path / "bin", rocm_smi_output(series_key))
    node = only_node(with_tool(base_env, tmp_path / "bin"))
    gpus = vendor_devices(node, "amd")
    assert [(d["id"], d["index"], d["model"]) for d in gpus] == [
        ("0x6a2d5a8a7e1b1234", 0, "AMD Instinct MI210"), ("0x1f0e6c2b9d3c5678", 1, "AMD Instinct MI210")]
    assert {(d["kind"], d["driver"]) for d in gpus} == {("gpu", "rocm")}
    assert [(d["memory_total_mb"], d["memory_free_mb"]) for d in gpus] == [(65520.0, 65509.4), (3072.0, 854.4)]
    assert [d["capabilities"] for d in gpus] == [["gfx90a"], ["gfx90a"]]
    assert {"gpu", "amd", "rocm"} <= set(node["capabilities"])


def test_amd_gpus_without_a_unique_id_get_distinct_ids(base_env, tmp_path):
    payload = rocm_smi_output("Card Series")
    for card in ("card0", "card1"):
        payload[card]["Unique ID"] = "N/A"
    fake_rocm_smi(tmp_path / "bin", payload)
    usage = resource_list(with_tool(base_env, tmp_path / "bin"))
    (node,) = usage["nodes"]
    assert [d["id"] for d in node["devices"] if d["vendor"] == "amd"] == ["amd-0", "amd-1"]
    assert node["total"]["gpu_count"] == 2


def test_a_failing_rocm_smi_means_no_amd_devices(base_env, tmp_path):
    fake_rocm_smi(tmp_path / "bin", rocm_smi_output("Card series"), exit_code=1)
    env = with_tool(base_env, tmp_path / "bin")
    rc, nodes, stderr = inventory(env)
    assert rc == 0, stderr
    assert vendor_devices(nodes[0], "amd") == []
    assert "rocm-smi failed" in stderr
    assert resource_list(env)["nodes"][0]["total"]["gpu_count"] == 0


# ---------------------------------------------------------------------------------------------------- Apple


def fake_system_profiler(tool_dir: Path, text: str) -> None:
    tool_dir.mkdir(parents=True, exist_ok=True)
    (tool_dir / "displays.json").write_text(text)
    write_tool(tool_dir, "system_profiler", """\
        [ "$1" = SPDisplaysDataType ] && [ "$2" = -json ] || { echo "unexpected arguments: $*" >&2; exit 64; }
        cat "$(dirname "$0")/displays.json"
        """)


def test_apple_gpu_is_detected_through_system_profiler(base_env, tmp_path):
    fake_system_profiler(tmp_path / "bin", json.dumps({"SPDisplaysDataType": [
        {"sppci_model": "Apple M2 Max", "spdisplays_mtlgpufamilysupport": "spdisplays_metal3"}]}))
    env = with_tool(base_env, tmp_path / "bin")
    node = only_node(env)
    (gpu,) = vendor_devices(node, "apple")
    assert (gpu["id"], gpu["index"], gpu["kind"], gpu["driver"], gpu["model"]) == (
        "apple-gpu-0", 0, "gpu", "metal", "Apple M2 Max")
    assert gpu["capabilities"] == ["metal3"]
    assert {"gpu", "apple", "metal"} <= set(node["capabilities"])
    assert resource_list(env)["nodes"][0]["total"]["gpu_count"] == 1


def test_unreadable_system_profiler_output_means_no_apple_devices(base_env, tmp_path):
    fake_system_profiler(tmp_path / "bin", "not json at all")
    rc, nodes, stderr = inventory(with_tool(base_env, tmp_path / "bin"))
    assert rc == 0, stderr
    assert vendor_devices(nodes[0], "apple") == []
    assert "system_profiler failed" in stderr


# ------------------------------------------------------------------------------------------------ host paths


def volume(source: Path | str, name: str = "models") -> VolumeAllocation:
    return VolumeAllocation(name=name, source=str(source), target="/models")


def test_volume_escapes_reports_a_symlink_pointing_out_of_the_advertised_dir(tmp_path):
    advertised = tmp_path / "shared"
    outside = tmp_path / "secrets"
    advertised.mkdir()
    outside.mkdir()
    (advertised / "sneaky").symlink_to(outside)
    problems = volume_escapes([volume(advertised / "sneaky", "sneaky")], [str(advertised)])
    assert problems == [f"volume sneaky: {advertised / 'sneaky'} resolves to {os.path.realpath(outside)}, "
                        "outside every advertised host path"]


def test_volume_escapes_accepts_a_plain_subdirectory(tmp_path):
    advertised = tmp_path / "shared"
    (advertised / "models" / "llama").mkdir(parents=True)
    assert volume_escapes([volume(advertised / "models" / "llama"), volume(advertised, "all")],
                          [str(advertised)]) == []


def test_volume_escapes_accepts_a_volume_under_a_symlinked_advertised_path(tmp_path):
    real = tmp_path / "disk" / "models"
    real.mkdir(parents=True)
    (tmp_path / "models").symlink_to(real)
    # Advertised through the link, mounted through the real path (and the other way round): both are inside.
    assert volume_escapes([volume(real / "x")], [str(tmp_path / "models")]) == []
    assert volume_escapes([volume(tmp_path / "models")], [str(real)]) == []


def test_volume_escapes_does_not_accept_a_sibling_with_a_common_prefix(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models2").mkdir()
    assert len(volume_escapes([volume(tmp_path / "models2")], [str(tmp_path / "models")])) == 1


def test_resolve_host_paths_resolves_a_symlinked_advertised_path(tmp_path):
    real = tmp_path / "disk" / "models"
    real.mkdir(parents=True)
    (tmp_path / "models").symlink_to(real)
    plain = tmp_path / "plain"
    plain.mkdir()
    assert resolve_host_paths([str(tmp_path / "models"), str(plain)]) == [os.path.realpath(real),
                                                                         os.path.realpath(plain)]
