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
             usage={"cpu": 1, "mem": 0, "disk": 0, "gpu": 1, "share:g0": 1})
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


def sharing(gpu_id, shares, memory):
    return Placement(agent_id="f", node="g", allocation={"devices": [gpu(gpu_id, 0)],
                                                         "shares": [{"id": gpu_id, "shares": shares, "memory_mb": memory}]})


def test_fractions_beyond_one_gpu_or_its_memory_and_a_gpu_both_whole_and_shared_are_found():
    fine = view({"j1": [sharing("g0", 0.5, 8000)], "j2": [sharing("g0", 0.5, 8000)]}, [],
                usage={"cpu": 0, "mem": 0, "disk": 0, "gpu": 0, "share:g0": 1.0, "gmem:g0": 16000})
    assert audit(fine) == []
    over = view({"j1": [sharing("g0", 0.75, 8000)], "j2": [sharing("g0", 0.5, 9000)]}, [],
                usage={"cpu": 0, "mem": 0, "disk": 0, "gpu": 0, "share:g0": 1.25, "gmem:g0": 17000})
    problems = audit(over)
    assert any("shared beyond one GPU: shares add up to 1.25" in p for p in problems)
    assert any("memory overbooked: fractions hold 17000 of 16384 MB" in p for p in problems)
    both = view({"j1": [holding("g0")], "j2": [sharing("g0", 0.25, 100)]}, [("device", "g", "g0", "j1")],
                usage={"cpu": 0, "mem": 0, "disk": 0, "gpu": 1, "share:g0": 1.25, "gmem:g0": 100})
    assert any("both held whole and shared" in p for p in audit(both))
    drift = view({"j2": [sharing("g0", 0.25, 100)]}, [], usage={"cpu": 0, "mem": 0, "disk": 0, "gpu": 0})
    assert any("counter share:g0=0 but bookings sum to 0.25" in p for p in audit(drift))


def test_a_gpu_held_whole_while_its_slices_are_held_is_found():
    parent = {**gpu("m0", 0), "mig_mode": True}
    piece = {**gpu("MIG-m0-0", 0, 9984), "parent": "m0", "mig_profile": "1g.10gb"}
    n = node("g", cpu=4, memory=1000, devices=[parent, piece])
    whole = Placement(agent_id="w", node="g", resources={"gpu_count": 1}, allocation={"devices": [parent]})
    cut = Placement(agent_id="s", node="g", allocation={"devices": [piece]})
    v = {"nodes": {"g": {"record": n, "cpu": 0, "mem": 0, "disk": 0, "gpu": 1, "share:m0": 1}},
         "bookings": {"j1": [whole], "j2": [cut]}, "held": [("device", "g", "m0", "j1"), ("device", "g", "MIG-m0-0", "j2")],
         "limits": Limits()}
    assert any("held whole while 1 of its MIG slices are held" in p for p in audit(v))
