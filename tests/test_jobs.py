"""Blueprint jobs without a server: restart decisions, refusals before anything runs, and the agent's
command runner (real subprocesses)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from builders import agent, blueprint, gpu, node
from hypothesis import given, strategies as st

from mn_prefect.jobs.command import CommandRefused, agent_environment, run_command
from mn_prefect.jobs.deploy import compile_blueprint
from mn_prefect.jobs.preflight import JobRefused, refusals
from mn_prefect.jobs.supervision import after_exit
from mn_prefect.model.blueprint import load_json_file, parse_blueprint
from mn_prefect.model.hints import env_hints
from mn_prefect.model.placement import Allocation, Placement
from mn_prefect.model.policies import RetryPolicy, attempts_in_window
from mn_prefect.scheduler.plan import plan_job

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples" / "blueprints").glob("*.json"))
MINUTE = 60_000

policies = st.builds(
    RetryPolicy, attempts=st.integers(0, 6), interval_ms=st.integers(0, 10 * MINUTE),
    delay_ms=st.integers(0, 10_000), delay_function=st.sampled_from(["constant", "exponential", "fibonacci"]),
    max_delay_ms=st.integers(0, 60_000), mode=st.sampled_from(["fail", "delay"]), unlimited=st.booleans())


# -- restart decisions ------------------------------------------------------------------------------------

def test_a_batch_agent_that_succeeds_is_complete():
    decision = after_exit("batch", RetryPolicy(attempts=3), [], 0, succeeded=True, how="Completed")
    assert decision.action == "complete"


def test_a_service_agent_that_exits_cleanly_is_restarted_as_an_unexpected_exit():
    policy = RetryPolicy(attempts=3, interval_ms=MINUTE, delay_ms=1000, delay_function="exponential")
    decision = after_exit("service", policy, [], 0, succeeded=True, how="Completed")
    assert decision.action == "restart" and decision.delay_ms == 1000 and "exited unexpectedly" in decision.reason


def test_restart_delays_follow_the_delay_function_per_restart_in_the_window():
    policy = RetryPolicy(attempts=5, interval_ms=10 * MINUTE, delay_ms=1000, delay_function="fibonacci",
                         max_delay_ms=30_000)
    history: list[int] = []
    delays = []
    for now in (1000, 2000, 3000, 4000, 5000):
        decision = after_exit("batch", policy, history, now, succeeded=False, how="exit 1")
        delays.append(decision.delay_ms)
        history.append(now)
    assert delays == [1000, 1000, 2000, 3000, 5000]
    assert after_exit("batch", policy, history, 6000, succeeded=False, how="exit 1").action == "fail"


def test_exhausted_restarts_fail_the_job_in_mode_fail():
    policy = RetryPolicy(attempts=2, interval_ms=MINUTE, mode="fail")
    decision = after_exit("batch", policy, [100, 200], 300, succeeded=False, how="exit 3")
    assert decision.action == "fail" and "restart attempts exhausted (2 in 60 s)" in decision.reason


def test_exhausted_restarts_wait_for_the_window_in_mode_delay():
    policy = RetryPolicy(attempts=2, interval_ms=MINUTE, delay_ms=10, mode="delay")
    decision = after_exit("service", policy, [1000, 5000], 7000, succeeded=False, how="exit 3")
    assert decision.action == "restart" and decision.delay_ms == 1000 + MINUTE - 7000


def test_mode_delay_waits_until_enough_restarts_left_the_window_when_it_holds_more_than_the_attempts():
    # Two restarts in the window and one allowed (the policy was tightened): waiting for the oldest to leave is not
    # enough, the restart waits for the second to leave too (found by the property test below).
    policy = RetryPolicy(attempts=1, interval_ms=2, mode="delay")
    decision = after_exit("batch", policy, [0, 1], 1, succeeded=False, how="x")
    assert decision.action == "restart" and decision.delay_ms == 2
    assert attempts_in_window([0, 1], 1 + decision.delay_ms, policy.interval_ms) < policy.attempts


def test_restarts_older_than_the_window_no_longer_count():
    policy = RetryPolicy(attempts=1, interval_ms=MINUTE, delay_ms=10)
    assert after_exit("batch", policy, [0], MINUTE - 1, succeeded=False, how="x").action == "fail"
    assert after_exit("batch", policy, [0], MINUTE, succeeded=False, how="x").action == "restart"


@given(policies, st.lists(st.integers(0, 20 * MINUTE), max_size=8), st.integers(0, 20 * MINUTE), st.booleans())
def test_a_failure_restarts_exactly_when_the_window_allows_and_never_waits_past_the_cap(policy, history, now, ok):
    decision = after_exit("batch", policy, history, now, succeeded=ok, how="x")
    if ok:
        assert decision.action == "complete"
        return
    allowed = policy.unlimited or attempts_in_window(history, now, policy.interval_ms) < policy.attempts
    if allowed:
        assert decision.action == "restart"
        if policy.max_delay_ms:
            assert decision.delay_ms <= policy.max_delay_ms
    elif policy.mode == "delay" and policy.interval_ms and policy.attempts:
        assert decision.action == "restart"
        # After the wait, the oldest restart in the window has left it: the restart fits the policy again.
        assert attempts_in_window(history, now + decision.delay_ms, policy.interval_ms) < policy.attempts or any(
            now < t for t in history)
    else:
        assert decision.action == "fail"


# -- refusals before anything runs ------------------------------------------------------------------------

@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates_compiles_plans_and_is_refused_explicitly_here(path):
    raw, problems = load_json_file(path)
    assert not problems
    parsed, issues = parse_blueprint(raw)
    assert not issues and parsed is not None
    nodes = [node("big", cpu=64, memory=262144, disk=10**7, runtime_drivers=["host_local"],
                  devices=[gpu(f"G{i}", i, 81920, caps=("fp16", "bf16", "fp8", "tf32")) for i in range(8)])]
    assert plan_job(parsed, nodes).status in ("runnable_now", "runnable_later", "not_runnable")
    with pytest.raises(JobRefused) as refused:
        compile_blueprint(raw)
    # Their commands live in MirrorNeuron's sandbox or catalog: each refused agent says which.
    assert refused.value.reasons
    for agent_id, why in refused.value.reasons.items():
        assert agent_id in {a.agent_id for a in parsed.agents}
        assert any(word in why for word in ("/sandbox", "catalog", "config.command"))
    assert "nothing was booked or started" in str(refused.value)


def test_a_runnable_blueprint_compiles():
    job = compile_blueprint({"job_name": "ok", "nodes": [agent("a")]})
    assert job.blueprint.job_name == "ok" and job.parameters(pool="p")["blueprint"]["job_name"] == "ok"


@pytest.mark.parametrize("config,resources,expected", [
    ({"command": ["true"], "runner_module": "MirrorNeuron.Runner.Docker"}, {}, "config.runner_module"),
    ({"command": ["true"]}, {"runtime_driver": "podman"}, "resources.runtime_driver 'podman' has no runner"),
    ({"command": ["no-such-program-xyz"]}, {}, "config.command[0]"),
    ({"command": ["true"], "workdir": "/no/such/dir"}, {}, "config.workdir"),
    ({}, {}, "config.command is missing"),
])
def test_what_mn_prefect_cannot_run_is_refused_naming_the_field(config, resources, expected):
    parsed = blueprint({"node_id": "x", "config": config, "resources": resources})
    assert expected in refusals(parsed)["x"]


def test_a_docker_agent_runs_given_an_image_and_without_one_the_blueprint_names_the_field():
    parsed = blueprint({"node_id": "x", "config": {"command": ["true"], "image": "mn-test:1"},
                        "resources": {"runtime_driver": "docker", "memory_mb": 64}})
    assert refusals(parsed) == {}
    _, issues = parse_blueprint({"job_name": "j", "nodes": [{"node_id": "x", "config": {"command": ["true"]},
                                                             "resources": {"runtime_driver": "docker"}}]})
    assert [str(i) for i in issues] == [
        "nodes[0].config.image: is required with runtime_driver docker (the container image to run in)"]


def test_a_catalog_agent_is_refused_as_unknown():
    parsed = blueprint({"node_id": "c", "uses": "mn-agents.router@1.0.0"})
    assert "catalog agent 'mn-agents.router@1.0.0'" in refusals(parsed)["c"]


# -- the agent's command ----------------------------------------------------------------------------------

def _placement() -> Placement:
    from mn_prefect.model.node import Device

    device = Device.model_validate(gpu("GPU-x", 3))
    return Placement(agent_id="a", node="n1", allocation=Allocation(devices=(device,)))


def test_only_pass_env_hints_and_the_blueprint_environment_reach_the_command():
    hints = env_hints(_placement())
    environ = {"HOME": "/h", "SECRET": "s", "MN_STORE_URL": "redis://x", **hints}
    env = agent_environment(environ, ["HOME"], {"MODE": "fast"})
    assert env["HOME"] == "/h" and env["MODE"] == "fast" and env["CUDA_VISIBLE_DEVICES"] == "3"
    assert "SECRET" not in env and "MN_STORE_URL" not in env
    assert env["MN_NODE"] == "n1" and env["MN_ALLOCATED_DEVICE_IDS"] == "GPU-x"


def test_a_blueprint_cannot_replace_mn_or_gpu_visibility_variables_but_keeps_its_own():
    environ = env_hints(_placement())
    env = agent_environment(environ, [], {"CUDA_VISIBLE_DEVICES": "7", "MN_NODE": "mine", "MODE": "x"})
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["MN_NODE"] == "n1" and env["MODE"] == "x"


def test_the_command_output_arrives_line_by_line_and_the_exit_code_is_kept(tmp_path):
    lines = []
    code = "import sys; print('one'); print('two'); print('err', file=sys.stderr); sys.exit(4)"
    result = run_command([sys.executable, "-c", code], env={}, workdir=str(tmp_path),
                         on_line=lambda s, t: lines.append((s, t)))
    assert result.exit_code == 4 and not result.ok and result.describe() == "exited with code 4"
    assert [t for s, t in lines if s == "stdout"] == ["one", "two"] and ("stderr", "err") in lines


def test_a_command_past_its_timeout_is_killed_with_its_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']); open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(60)")
    result = run_command([sys.executable, "-c", code, str(pidfile)], env={}, timeout_s=2, on_line=lambda s, t: None)
    assert result.timed_out and "timed out" in result.describe()
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the command's child survived the timeout"
        time.sleep(0.1)


def test_a_missing_program_is_refused_before_anything_runs():
    with pytest.raises(CommandRefused, match=r"config.command\[0\]"):
        run_command(["definitely-not-installed-xyz"], env={}, on_line=lambda s, t: None)


def test_the_allocation_the_command_sees_is_the_placement():
    environ = env_hints(_placement())
    env = agent_environment(environ, [], {})
    assert json.loads(env["MN_ALLOCATION_JSON"])["node"] == "n1"


def test_the_shipped_hello_blueprint_compiles_here():
    raw, problems = load_json_file(Path(__file__).resolve().parents[1] / "flows" / "blueprints" / "hello_batch.json")
    assert not problems
    job = compile_blueprint(raw)
    assert [a.agent_id for a in job.blueprint.agents] == ["prepare", "embed", "report"]
