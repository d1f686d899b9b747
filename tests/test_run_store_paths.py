"""A run id names a folder of the run store and cannot leave it (mn_prefect/bundles/runner.py, ``run_id_issue``):
`blueprint run --run-id ../../x` is refused naming --run-id before anything runs or is written, and a run id that
reaches the runner another way (a flow parameter) is refused there too."""

from __future__ import annotations

import hashlib
import json

import pytest
from bundle_builders import step, write_bundle
from cli_runner import run

from mn_prefect.bundles.runner import new_ids


@pytest.mark.parametrize("run_id", ["../../x", "..", "a/b", "/etc", "a\nb", "x" * 200, ".hidden", "a..b"])
def test_a_run_id_that_could_leave_the_run_store_is_refused_naming_it_and_nothing_is_written(tmp_path, run_id):
    folder = write_bundle(tmp_path / "bundle", "paths", [step("only")], [], sink_from="only")
    runs_root = tmp_path / "deep" / "runs"
    done = run(["blueprint", "run", str(folder), "--local", "--runs-root", str(runs_root), "--run-id", run_id,
                "--json"], env={"HOME": str(tmp_path)})
    assert done.returncode == 2, done.stdout + done.stderr
    [issue] = json.loads(done.stdout)["errors"]
    assert issue["path"] == "--run-id" and "not a run id" in issue["message"]
    assert not runs_root.exists() and not (tmp_path / "deep" / "x").exists() and not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="^run_id: "):
        new_ids(run_id, None, "paths")


def test_a_plain_run_id_is_kept_and_its_job_id_is_one_per_run_id():
    digest = hashlib.sha256(b"nightly-2026.12.02_a").hexdigest()[:8]
    assert new_ids("nightly-2026.12.02_a", None, "paths") == (f"paths-{digest}", "nightly-2026.12.02_a")
    assert new_ids("nightly-2026.12.02_b", None, "paths")[0] != f"paths-{digest}"  # same prefix, another run


def _with_config(folder, **config) -> None:
    manifest = folder / "manifest.json"
    doc = json.loads(manifest.read_text())
    for agent in doc["agents"]["nodes"] if "agents" in doc else []:
        if agent["node_id"] == "only":
            agent["config"].update(config)
    manifest.write_text(json.dumps(doc))


WORKDIR = "agents.nodes[only].config.workdir"


@pytest.mark.parametrize(("config", "path", "why"), [
    ({"workdir": "/home"}, WORKDIR, "is outside the sandbox"),
    ({"workdir": "/sandbox/job/../../etc"}, WORKDIR, "climbs out of the sandbox"),
    ({"workdir": "../up"}, WORKDIR, "climbs out of the sandbox"),
    ({"upload_as": "../../outside"}, "agents.nodes[0].config.upload_as", "must stay inside"),
])
def test_a_step_cannot_work_or_upload_outside_its_sandbox(tmp_path, config, path, why):
    from mn_prefect.bundles.bundle import load_bundle
    from mn_prefect.model.issues import InvalidInput

    folder = write_bundle(tmp_path, "escape", [step("only")], [], sink_from="only")
    _with_config(folder, **config)
    with pytest.raises(InvalidInput) as refused:
        load_bundle(folder)
    assert [i.path for i in refused.value.issues if why in i.message] == [path], refused.value.issues


def test_a_link_in_an_uploaded_folder_to_outside_the_bundle_is_refused_and_one_inside_is_kept(tmp_path):
    from mn_prefect.bundles.bundle import load_bundle
    from mn_prefect.model.issues import InvalidInput

    folder = write_bundle(tmp_path, "links", [step("only")], [], sink_from="only")
    worker = folder / "payloads" / "worker"
    (worker / "same.py").symlink_to(worker / "worker.py")  # inside the bundle: fine
    load_bundle(folder)
    (worker / "secrets").symlink_to(tmp_path)  # a folder outside the bundle
    with pytest.raises(InvalidInput) as refused:
        load_bundle(folder)
    [issue] = refused.value.issues
    assert issue.path == "agents.nodes[only].config.upload_path"
    assert issue.message == "worker/secrets is a link to a place outside the bundle"
