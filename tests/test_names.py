"""One name rule for nodes, groups and queues (mn_prefect/model/names.py): letters, digits, '.', '_' and '-',
starting with a letter or digit, no '..', at most 128 characters (a group's at most 63). A bad name is refused
where it is read and at registration, naming the field and showing the name, with nothing written."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mn_prefect.model.issues import InvalidInput
from mn_prefect.model.names import STORED, name_issue
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.queues import QueueSpec, parse_queues
from mn_prefect.store import open_store
from mn_prefect.store.groups import check_group_name
from tests.builders import node
from tests.lab import nodes as lab_nodes

BAD = ["a\nb", "a/b", "..", ".", "x" * 300, "a\x1b[31mb", "a b", "a..b", "-a", "a:b", "naïve", "a\u2028b"]


def _shown(name: str) -> str:
    return repr(name[:80]) if len(name) > 80 else repr(name)


@pytest.mark.parametrize("name", BAD)
def test_a_bad_node_name_is_refused_naming_the_field(name):
    with pytest.raises(ValidationError) as raised:
        NodeRecord.model_validate({"name": name})
    [error] = raised.value.errors()
    assert error["loc"] == ("name",) and "is not a valid node name" in error["msg"] and _shown(name) in error["msg"]


@pytest.mark.parametrize("name", BAD)
def test_a_bad_group_name_is_refused_naming_the_field(name):
    with pytest.raises(ValueError, match="^MN_NODE_GROUP: .* is not a valid group name") as raised:
        check_group_name(name, "MN_NODE_GROUP")
    assert _shown(name) in str(raised.value)
    with pytest.raises(ValidationError) as in_record:
        NodeRecord.model_validate({"name": "n1", "group": name})
    assert [e["loc"] for e in in_record.value.errors()] == [("group",)]


@pytest.mark.parametrize("name", BAD)
def test_a_bad_queue_name_is_refused_naming_the_field(name):
    with pytest.raises(InvalidInput) as raised:
        parse_queues({name: {"quota": {"gpu": 1}}, "ok": {"cohort": name}})
    paths = {issue.path: issue.message for issue in raised.value.issues}
    assert set(paths) == {f"queues.{name}", "queues.ok.cohort"}
    assert "is not a valid queue name" in paths[f"queues.{name}"] and _shown(name) in paths[f"queues.{name}"]
    assert "is not a valid cohort name" in paths["queues.ok.cohort"]
    with pytest.raises(ValidationError):
        QueueSpec(name=name)


@pytest.mark.parametrize("name", BAD)
def test_registration_refuses_a_bad_name_that_slipped_past_the_model(tmp_path, name):
    store = open_store(f"sqlite:///{tmp_path}/s.db")
    try:
        with pytest.raises(ValueError, match="^name: .* is not a valid node name"):
            store.register_node(node("n1").model_copy(update={"name": name}))
        with pytest.raises(ValueError, match="^group: .* is not a valid group name"):
            store.register_node(node("n1").model_copy(update={"group": name}))
        assert store.list_nodes() == []
    finally:
        store.close()


def test_the_longest_names_pass_and_one_more_character_does_not():
    assert name_issue("n" * 128, "node") is None and name_issue("n" * 129, "node") is not None
    assert check_group_name("g" * 63) == "g" * 63
    with pytest.raises(ValueError):
        check_group_name("g" * 64)


def test_the_lab_names_and_the_usual_ones_pass(tmp_path):
    names = [n["name"] for n in lab_nodes(tmp_path)] + ["gpu-l4-1", "node.example.com", "host_1", "A100-x8"]
    for name in names:
        assert NodeRecord.model_validate({"name": name}).name == name
    for group in ("default", "mn-lab-worker-ab12cd", "team_a.gpu"):
        assert check_group_name(group) == group
    assert set(parse_queues({"train": {"cohort": "lab"}, "team-a": {}, "eval.v2": {}})) == {"train", "team-a",
                                                                                            "eval.v2"}


def test_a_record_read_back_from_a_store_keeps_a_name_an_older_release_let_in():
    record = NodeRecord.model_validate({"name": "a b", "group": "x/y"}, context=STORED)
    assert (record.name, record.group) == ("a b", "x/y")
    assert QueueSpec.model_validate({"name": "a b"}, context=STORED).name == "a b"
