"""Where mn-prefect finds MirrorNeuron's agent catalog (docs/bundles.md, "Steps expanded from the source format"):
``MN_AGENTS_ROOT``, else ``~/.mn/agents``; never a ``mn-agents`` folder above the working directory, and the error
says how to get it. Fast: MirrorNeuron's converter on a copy of the catalog, no server."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mn_prefect.bundles.bundle import load_bundle
from mn_prefect.model.issues import InvalidInput

SOURCE = Path(__file__).parent / "bundles" / "source"


@pytest.fixture
def bundle(tmp_path, monkeypatch):
    monkeypatch.delenv("MN_AGENTS_ROOT", raising=False)
    folder = tmp_path / "work" / "bp"
    shutil.copytree(SOURCE / "source_two_steps", folder)
    return folder


def test_a_catalog_in_a_parent_folder_of_the_working_directory_is_not_used(bundle, tmp_path, monkeypatch):
    shutil.copytree(SOURCE / "mn-agents", tmp_path / "mn-agents")  # where the SDK alone would pick it up
    monkeypatch.chdir(bundle)
    with pytest.raises(InvalidInput) as refused:
        load_bundle(bundle)
    message = refused.value.issues[0].message
    assert "MN_AGENTS_ROOT" in message and str(Path.home() / ".mn" / "agents") in message, message
    assert "git clone https://github.com/MirrorNeuronLab/mn-agents ~/.mn/agents" in message, message


def test_the_catalog_is_found_at_the_documented_default(bundle):
    shutil.copytree(SOURCE / "mn-agents", Path.home() / ".mn" / "agents")
    assert load_bundle(bundle).spec.steps.keys() == {"first", "second"}


def test_mn_agents_root_names_the_catalog(bundle, tmp_path, monkeypatch):
    shutil.copytree(SOURCE / "mn-agents", tmp_path / "catalog")
    monkeypatch.setenv("MN_AGENTS_ROOT", str(tmp_path / "catalog"))
    assert load_bundle(bundle).spec.steps.keys() == {"first", "second"}
