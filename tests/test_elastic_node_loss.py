"""A node vanishes mid-run: the run names it, shrinks to the surviving node, and grows back
to full size when a node joins again — ending with the loss of a run that never failed.

On the session's shared two-node cluster, one rank per node (the shrink: 2 -> 1, the growth:
1 -> 2): the lost node is replaced by one with the same labels, so the next module finds the
cluster it expects."""

import time

import pytest

from rayflex.constants import knob
from rayflex.testing.chaos.bounds import DetectionTiming

from conftest import run_events, wait_until_running
from test_elastic_cluster import fast_detection  # noqa: F401 - the autouse fixture
from test_elastic_cluster import GROW_STEPS, ONE_PER_NODE, _assert_recovered, _stop_once_grown, _trainer

pytestmark = pytest.mark.cluster


def test_node_loss_shrinks_then_capacity_return_grows_back(two_node_cluster, dataset_uri, tmp_path):
    cluster = two_node_cluster
    worker_node = next(iter(cluster.worker_nodes))
    # The run grows only once the newcomers are up, so it never stalls on process start;
    # it is stopped a few steps after it is whole again.
    trainer = _trainer(dataset_uri, tmp_path, "node-loss", steps=GROW_STEPS, **ONE_PER_NODE)
    handle = trainer.submit()
    st = wait_until_running(handle, 4, committed=3)
    lost_ranks = [w["rank"] for w in st["workers"] if w["node_id"] == worker_node.node_id]
    assert len(lost_ranks) == 1, st["workers"]  # one rank a node: rank 0 or 1, as placed
    lost_id = worker_node.node_id
    cluster.remove_node(worker_node)
    gone_at = time.time()  # its processes are dead: remove_node waits for them
    deadline = time.time() + 120
    while handle.status()["world_size"] != 1 or handle.status()["state"] != "RUNNING":
        assert time.time() < deadline, "the run should continue on the surviving node"
        time.sleep(0.2)
    cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1", labels={"rack": "r1"})
    result = _stop_once_grown(handle, 2, timeout_s=300)
    events = run_events(tmp_path, "node-loss")
    lost = next(e for e in events if e["kind"] in ("node_lost", "worker_died"))
    # Named by the next poll (its rank's actor is dead) or the next refresh of Ray's node
    # list once the node is gone: the chaos harness's rule for a removed node, its knobs plus
    # six of this run's own steps for Ray's notices on this host.
    timing = DetectionTiming.of_run(knob("HEARTBEAT_TIMEOUT_S"), run_events(tmp_path, "node-loss", "metrics.jsonl"))
    assert lost["time"] - gone_at <= timing.mechanism_s("remove_node") + timing.slack_s, (lost, gone_at, timing)
    node_lost = [e for e in events if e["kind"] == "node_lost"]
    assert node_lost and node_lost[0]["node_id"] == lost_id and node_lost[0]["ranks"] == lost_ranks, node_lost
    sizes = [e["world_size"] for e in events if e["kind"] == "restarted"]
    assert sizes[0] == 1 and sizes[-1] == 2, f"shrink to 1, grow back to 2: {sizes}"
    grow = next(e for e in events if e["kind"] == "restarted" and "capacity returned" in e["reason"])
    assert grow["lost_steps"] == 0, "growing resumes from the checkpoint of the step it stopped at"
    started = [e for e in events if e["kind"] == "workers_started"]
    # Against this run's own cold start (its first spawn), not a number of seconds: a
    # process start takes 3-4x longer on a slow host.
    assert started[-1]["spawn_s"] < started[0]["spawn_s"] / 2, "the newcomers were warmed before the stop, not after it"
    _assert_recovered(result, trainer, events, world_size=2, stopped=True)


def _node_processes(node) -> list:
    """The raylet of a ``cluster_utils`` node and everything it started (its workers)."""
    import psutil
    from ray._private import ray_constants

    raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    return [raylet, *raylet.children(recursive=True)]


@pytest.mark.slow  # ~35 s; test_controller_states covers the probe and the failed-start path in CI
def test_a_frozen_node_is_declared_lost_and_the_run_shrinks_and_finishes(two_node_cluster, dataset_uri, tmp_path,
                                                                        monkeypatch):
    # The machine stays up but answers nothing (a kernel hang, a saturated NIC): every
    # process of the node is SIGSTOPped, so no socket closes and nothing "dies". Ray's
    # health check (conftest: 1 s period, 5 misses: ~15 s) would declare the node dead; the
    # restart's probe (2 s here) names it unreachable first and never places ranks there.
    import signal

    monkeypatch.setenv("RAYFLEX_NODE_PROBE_TIMEOUT_S", "2")

    cluster = two_node_cluster
    worker_node = next(iter(cluster.worker_nodes))
    trainer = _trainer(dataset_uri, tmp_path, "frozen-node", steps=24, restart_while_warming=False)
    handle = trainer.submit()
    wait_until_running(handle, 4, committed=3)
    frozen = _node_processes(worker_node)
    frozen_at = time.time()
    for p in frozen:
        p.send_signal(signal.SIGSTOP)
    try:
        result = handle.wait(timeout_s=240)
    finally:
        for p in frozen:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    p.send_signal(sig)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        cluster.remove_node(worker_node, allow_graceful=False)
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1", labels={"rack": "r1"})
    events = run_events(tmp_path, "frozen-node")
    first = next(e for e in events if e["kind"] in ("node_lost", "worker_died", "hang_detected"))
    print({"first_detection": first["kind"], "after_s": round(first["time"] - frozen_at, 1)})
    node_lost = [e for e in events if e["kind"] == "node_lost"]
    assert node_lost and node_lost[0]["node_id"] == worker_node.node_id, [e["kind"] for e in events]
    print({"node_lost_after_s": round(node_lost[0]["time"] - frozen_at, 1), "reason": node_lost[0]["reason"]})
    # The heartbeat (3 s) names the frozen ranks before Ray's health check (5 misses 1 s apart)
    # can: at the first poll after their silence passed it, however long this host's cycle was.
    assert first["kind"] == "hang_detected", first
    assert first["timeout_s"] < first["stalled_s"] <= first["timeout_s"] + first["poll_gap_s"], first
    assert first["time"] - first["stalled_s"] <= frozen_at + first["poll_gap_s"], (frozen_at, first)
    assert node_lost[0]["reason"].startswith("unreachable"), node_lost[0]
    restarted = [e for e in events if e["kind"] == "restarted"]
    assert not [e for e in restarted if "while the attempt started" in e["reason"]], \
        "no attempt was placed on the frozen node"
    sizes = [e["world_size"] for e in restarted]
    assert sizes and sizes[-1] == 2, f"the run shrank to the live node: {sizes}"
    _assert_recovered(result, trainer, events, world_size=2)
