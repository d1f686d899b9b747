"""The independent checker finds what it is meant to find (so a clean audit means something)."""

from builders import gpu, node

from mn_prefect.model.placement import Placement
from mn_prefect.scheduler import Limits
from mn_prefect.store.audit import audit


def view(bookings, held, usage=None, limits=None):
    n = node("g", cpu=4, memory=1000, devices=[gpu("g0", 0), gpu("g1", 1)])
    used = usage or {"cpu": 0, "mem": 0, "disk": 0, "gpu": 0}
    return {"nodes": {"g": {"record": n, **used}}, "bookings": bookings, "held": held, "limits": limits or Limits()}


def holding(device=None, port=None, cpu=0.0):
    allocation = {}
    if device:
        allocation["devices"] = [gpu(device, 0)]
    if port:
        allocation["ports"] = [{"label": "p", "port": port, "protocol": "http"}]
    return Placement(agent_id="a", node="g", resources={"cpu_cores": cpu, "gpu_count": 1 if device else 0}, allocation=allocation)


def test_a_sound_view_has_no_problems():
    v = view({"j1": [holding("g0", 80, 1)]}, [("device", "g", "g0", "j1"), ("port", "g", "tcp:80", "j1")],
             usage={"cpu": 1, "mem": 0, "disk": 0, "gpu": 1})
    assert audit(v) == []


def test_a_device_held_twice_is_found():
    v = view({"j1": [holding("g0")], "j2": [holding("g0")]}, [("device", "g", "g0", "j1")], usage={"cpu": 0, "mem": 0, "disk": 0, "gpu": 2})
    assert any("held by 2 placements" in p for p in audit(v))


def test_a_port_held_twice_across_protocol_aliases_is_found():
    other = Placement(agent_id="b", node="g", allocation={"ports": [{"label": "q", "port": 80, "protocol": "tcp"}]})
    v = view({"j1": [holding(port=80)], "j2": [other]}, [("port", "g", "tcp:80", "j1")])
    assert any("port g/tcp:80 held by 2" in p for p in audit(v))


def test_over_capacity_and_counter_drift_are_found():
    v = view({"j1": [holding(cpu=3)], "j2": [holding(cpu=2)]}, [], usage={"cpu": 3, "mem": 0, "disk": 0, "gpu": 0})
    problems = audit(v)
    assert any("over capacity: cpu 5 > 4" in p for p in problems)
    assert any("usage counter cpu=3" in p for p in problems)
    assert any("over capacity" in p for p in audit(view({"j": [holding(cpu=3)]}, [], usage={"cpu": 3, "mem": 0, "disk": 0, "gpu": 0},
                                                          limits=Limits(cpu=50))))


def test_orphan_and_missing_holds_are_found():
    v = view({}, [("device", "g", "g1", "gone")])
    assert any("no live booking" in p for p in audit(v))
    v = view({"j1": [holding("g0")]}, [], usage={"cpu": 0, "mem": 0, "disk": 0, "gpu": 1})
    assert any("booked by j1 but held by None" in p for p in audit(v))
