"""A slow node on a real cluster: one of 3 ranks held to a tenth of a core (a CPU quota of
its own, rayflex.testing.throttle) is named, weighed, and left: the run restarts on the two
healthy nodes without losing a step and trains exactly what an uninterrupted run trains.
How fast that happens is measured by benchmarks/stragglers.py, not here."""

import time

import pytest

import rayflex as rf
from rayflex.testing.reference import single_process_losses
from rayflex.testing.throttle import cpu_throttled, throttle_problem

from conftest import loopback_cluster, run_events, small_gpt, wait_until_running

pytestmark = pytest.mark.cluster
STEPS = 150


@pytest.fixture
def three_nodes(monkeypatch):
    problem = throttle_problem()
    if problem:
        pytest.skip(f"no slow node here: {problem}")
    # A shorter look-back and confirmation than production's (20 s, 10 s): the same rules
    # on fewer seconds of a slow run.
    monkeypatch.setenv("RAYFLEX_STRAGGLER_WINDOW_S", "8")
    monkeypatch.setenv("RAYFLEX_STRAGGLER_CONFIRM_S", "3")
    with loopback_cluster([{"num_cpus": 1}, {"num_cpus": 1}, {"num_cpus": 1}]) as cluster:
        yield cluster


def test_a_throttled_node_is_named_weighed_and_left(three_nodes, dataset_uri, tmp_path):
    trainer = rf.Trainer(model=small_gpt(n_layers=2), data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=12),
                         run=rf.RunConfig(name="slow", storage=f"file://{tmp_path}/runs", steps=STEPS),
                         scaling=rf.ScalingConfig(num_workers=3, min_workers=2))
    handle = trainer.submit()
    st = wait_until_running(handle, 5)
    victim = next(w for w in st["workers"] if w["rank"] == 2)
    with cpu_throttled([victim["pid"]], 0.1):
        # Slow until the run acts (it stops to restart without the node) or ends.
        while handle.status()["state"] == "RUNNING" and not handle.done():
            time.sleep(0.2)
    result = handle.wait(timeout_s=240)
    events = run_events(tmp_path, "slow")
    story = "\n".join(str((e["kind"], e.get("step"), e.get("rank"), (e.get("node_id") or "")[:8],
                            (e.get("reason") or "")[:200])) for e in events)
    assert result.status == "finished" and result.steps_completed == STEPS, story
    named = [e for e in events if e["kind"] == "straggler_detected"]
    assert [e["rank"] for e in named] == [2] and named[0]["node_id"] == victim["node_id"], story
    (decided,) = [e for e in events if e["kind"] == "straggler_decided"]
    assert decided["action"] == "evict_node" and decided["node_id"] == victim["node_id"], decided
    assert decided["gain_s"] > 0 and decided["to_world"] == 2 and decided["slow_step_s"] > decided["healthy_step_s"]
    (restart,) = [e for e in events if e["kind"] == "restarted"]
    assert restart["lost_steps"] == 0 and "straggler" in restart["reason"] and restart["world_size"] == 2, restart
    last_plan = [e for e in events if e["kind"] == "plan_chosen"][-1]
    assert victim["node_id"] not in last_plan["rank_to_node"], "the slow node was left"
    assert [m["step"] for m in result.metrics] == list(range(1, STEPS + 1)), "every step trained once"
    assert result.final_loss == pytest.approx(single_process_losses(trainer.spec, STEPS)[-1], rel=1e-4)
