"""Recovery from memory on a live loopback cluster (``CheckpointConfig(memory_replicas=1)``).

On the session's two-node cluster, one rank per node (racks r0 and r1: each node's shards
are replicated to the other): a killed worker's restart reads its node's own copies, a lost
node's shards come from their replicas, and when a shard and its replica are both gone the
restart reads storage and says why; a spot notice shorter than the upload is still enough,
because the leaving node's rank only has to replicate. Every run ends with parameters bit
for bit equal to the fault-free replay of the same attempts (the storage-restore run of the
same faults: same restarts, same world sizes, read from storage in plain processes).
"""

import os
import signal

import pytest

import rayflex as rf
from rayflex.checkpoint import manifest as mf
from rayflex.testing.chaos.replay import compare, replay, segments_from_events

from conftest import run_events, small_gpt, wait_until_running
from test_elastic_cluster import fast_detection  # noqa: F401 - the autouse fixture

pytestmark = pytest.mark.cluster
# Enough that the fault lands mid-run: the first save commits a few steps late (a save due
# while the previous upload runs is deferred), and a step of one rank a node takes ~0.04 s.
STEPS = 40


def _trainer(dataset_uri, tmp_path, name, steps=STEPS, every=3, **elastic):
    return rf.Trainer(model=small_gpt(n_layers=2),
                      data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=12),
                      run=rf.RunConfig(name=name, storage=f"file://{tmp_path}/runs", steps=steps,
                                       optimizer=rf.OptimizerConfig(lr=1e-2, warmup_steps=2)),
                      # One rank per node (2 CPUs each): a node's loss takes one rank and its shard.
                      scaling=rf.ScalingConfig(num_workers=2, min_workers=1, max_workers=2, cpus_per_worker=2),
                      checkpoint=rf.CheckpointConfig(every_steps=every, keep=2, memory_replicas=1),
                      elastic=rf.ElasticConfig(max_failures=3, resource_wait_s=60, restart_while_warming=False,
                                               **elastic))


def _loaded(events) -> dict:
    loads = [e for e in events if e["kind"] == "checkpoint_loaded"]
    assert len(loads) == 1, f"one restore: {loads}"
    return loads[0]


def _assert_equals_storage_restore(trainer, events, tmp_path):
    """Final parameters bit for bit those of the same attempts restored from storage."""
    spec = trainer.spec
    steps = spec.run.steps
    segments = segments_from_events(events, steps)
    assert len(segments) == 2, segments
    replay_root = replay(spec, segments, f"file://{tmp_path}/replay")
    cmp = compare(mf.step_dir(spec.checkpoint_uri, steps), mf.step_dir(replay_root, steps))
    assert cmp["bitwise_equal"], cmp


def _keeper_of(node_id, run):
    import ray

    from rayflex.checkpoint.replicas.keepers import keeper_name

    return ray.get_actor(keeper_name(run, node_id))


def _wait_for_replicas(handle, run, *, held_by: str, of: str, timeout_s: float = 120) -> int:
    """Until the keeper on ``held_by`` holds a copy of every shard file the keeper on ``of``
    holds of the newest committed step; returns that step."""
    import time

    import ray

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        step = (handle.status().get("last_checkpoint") or {}).get("step")
        if step:
            own = ray.get(_keeper_of(of, run).inventory.remote(step))
            held = ray.get(_keeper_of(held_by, run).inventory.remote(step))
            if own and all(name in held for name, info in own.items() if info["origin_node"] == of):
                return step
        time.sleep(0.05)
    raise AssertionError(f"the replicas of node {of[:12]}'s shards never reached node {held_by[:12]}")


def _replicas_in_place(handle, run, a: str, b: str) -> int:
    """Wait until nodes ``a`` and ``b`` each hold a copy of the other's shard files of one
    committed step, the newest when last looked at; returns that step. Each look takes a
    fraction of a commit interval, so two in a row agree long before ten tries are spent."""
    for _ in range(10):
        step = _wait_for_replicas(handle, run, held_by=a, of=b)
        if _wait_for_replicas(handle, run, held_by=b, of=a) == step:
            return step
    raise AssertionError("every look at the replicas found a newer commit than the one before")


def test_a_killed_worker_restores_from_its_nodes_own_copy(two_node_cluster, dataset_uri, tmp_path):
    trainer = _trainer(dataset_uri, tmp_path, "mem-kill")
    handle = trainer.submit()
    st = wait_until_running(handle, 4, committed=3)
    victim = next(w for w in st["workers"] if w["rank"] == 1)
    assert victim["node_id"] != next(w for w in st["workers"] if w["rank"] == 0)["node_id"], st["workers"]
    # A commit's replicas reach the peer node after it (on a slow host, seconds after): the
    # kill waits for them, or the restore would rightly read a file over the network.
    replicated = _replicas_in_place(handle, "mem-kill", *(w["node_id"] for w in st["workers"]))
    os.kill(victim["pid"], signal.SIGKILL)
    result = handle.wait(timeout_s=180)
    assert result.status == "finished", result.status
    events = run_events(tmp_path, "mem-kill")
    loaded = _loaded(events)
    # Every shard file from memory, none from storage; and when the restore loaded the step
    # whose replicas were seen in place (a newer commit can land between that look and the
    # kill), each node read its files from its own memory (its own copies and its peer's
    # replicas): nothing over the network.
    sources = loaded["sources"]
    assert sources["storage"] == 0 and loaded["fell_back"] == {}, loaded
    if loaded["step"] == replicated:
        assert sources["own_copy"] >= 2 and loaded["remote_reads"] == 0, (replicated, loaded)
    _assert_equals_storage_restore(trainer, events, tmp_path)


def _run_losing_the_worker_node(cluster, dataset_uri, tmp_path, name, *, and_the_heads_keeper: bool):
    """A run whose worker node is removed once a checkpoint is committed (and, if asked,
    the head's keeper killed first: the replicas of that node's shards go too); returns
    the trainer, the run's events and its one ``checkpoint_loaded``."""
    trainer = _trainer(dataset_uri, tmp_path, name)
    handle = trainer.submit()
    wait_until_running(handle, 4, committed=3)
    worker = next(iter(cluster.worker_nodes))
    if and_the_heads_keeper:
        import ray

        ray.kill(_keeper_of(cluster.head_node.node_id, name), no_restart=True)
    else:
        # The premise: the head holds the replicas of the lost node's shards. A commit does
        # not wait for them (they are pushed after the local save), so on a slow host the
        # node could go before they arrived.
        _wait_for_replicas(handle, name, held_by=cluster.head_node.node_id, of=worker.node_id)
    cluster.remove_node(worker)
    result = handle.wait(timeout_s=180)
    assert result.status == "finished", result.status
    events = run_events(tmp_path, name)
    return trainer, events, _loaded(events)


@pytest.fixture
def node_returns(two_node_cluster):
    """The removed node comes back (same rack label) for the modules that follow."""
    yield two_node_cluster
    if len(two_node_cluster.worker_nodes) == 0:
        two_node_cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1", labels={"rack": "r1"})


def test_a_lost_node_restores_from_the_replicas_of_its_shards(node_returns, dataset_uri, tmp_path):
    trainer, events, loaded = _run_losing_the_worker_node(node_returns, dataset_uri, tmp_path, "mem-node",
                                                          and_the_heads_keeper=False)
    # The rank on the head reads both files saved at dp=2: the head's own, and the lost
    # node's from the replica the head kept of it.
    assert loaded["world_size"] == 1 and loaded["saved_world_size"] == 2
    assert loaded["sources"] == {"own_copy": 1, "replica": 1, "storage": 0}, loaded
    assert loaded["fell_back"] == {}
    _assert_equals_storage_restore(trainer, events, tmp_path)


def test_a_shard_and_its_replica_both_lost_fall_back_to_storage(node_returns, dataset_uri, tmp_path):
    trainer, events, loaded = _run_losing_the_worker_node(node_returns, dataset_uri, tmp_path, "mem-both",
                                                          and_the_heads_keeper=True)
    # Both files saved at dp=2 (each node's own) from storage, each with why.
    assert loaded["sources"]["storage"] >= 2 and loaded["sources"]["own_copy"] == loaded["sources"]["replica"] == 0
    assert len(loaded["fell_back"]) == 2 and all("no live keeper holds it" in why
                                                  for why in loaded["fell_back"].values()), loaded["fell_back"]
    _assert_equals_storage_restore(trainer, events, tmp_path)


def test_a_notice_shorter_than_the_upload_is_enough_the_replicas_upload_after_the_node_went(
        node_returns, dataset_uri, tmp_path, monkeypatch):
    """A spot notice of twice the run's own estimate (at least 3 s), and every upload takes
    12 s more (a slow link to storage): the
    leaving node's rank hands its shard to the other node's keeper and stops; the node
    goes; the controller commits the step once that keeper's uploads are done, and the
    restart resumes from it with no step lost (from memory)."""
    from test_preemption_cluster import preempt_and_wait

    steps, upload_extra_s = 60, 12.0  # the notice lands mid-run even when steps are quick (~0.04 s)
    monkeypatch.setenv("RAYFLEX_SLOW_UPLOAD", f"1:{upload_extra_s:g}:{steps - 1}")  # not the final save
    # No save is timed before the notice (periodic saves are off): assume a quick one (1 s).
    monkeypatch.setenv("RAYFLEX_EMERGENCY_CHECKPOINT_DEFAULT_S", "1")
    name = "mem-notice"
    trainer = _trainer(dataset_uri, tmp_path, name, steps=steps, every=100, emergency_margin_s=0.5)
    handle = trainer.submit()
    st = wait_until_running(handle, 3)
    # Twice what the run itself judges long enough for an emergency save (a step, the save,
    # the margin: a step takes 3-4x longer on a slow host, and a host can get slower mid-run:
    # with its own estimate + 1 s, load that started beside a slow-host run made the save
    # outlast a 3.3 s notice); still shorter than the upload, which must outlast it.
    notice_s = max(3.0, 2 * st["emergency_notice_s"])
    assert notice_s < upload_extra_s, f"steps too slow for this scenario: {st['emergency_notice_s']:.1f}s per notice"
    node = next(iter(node_returns.worker_nodes))
    assert any(w["node_id"] == node.node_id for w in st["workers"])
    import ray

    for n in (node_returns.head_node.node_id, node.node_id):  # the keepers are up (an attempt's first
        ray.get(_keeper_of(n, name).stats.remote(), timeout=60)  # seconds may have none yet: storage only)
    result, deadline = preempt_and_wait(node_returns, node.node_id, notice_s, handle, timeout_s=180)
    assert result.status == "finished" and result.steps_completed == steps, result.status
    events = run_events(tmp_path, name)
    notice = next(e for e in events if e["kind"] == "preemption_notice")
    assert notice["action"] == "emergency_checkpoint", notice
    emergency = next(e for e in events if e["kind"] == "checkpoint_committed" and e["reason"] == "emergency")
    # the keepers' uploads carried the injected delay: the save took at least that long to commit
    assert emergency["upload"] == "replica_keepers" and emergency["total_s"] >= upload_extra_s, emergency
    assert emergency["time"] > deadline, "committed after the node went: its upload outlasted the notice"
    restarted = next(e for e in events if e["kind"] == "restarted")
    assert restarted["lost_steps"] == 0 and restarted["from_step"] == emergency["step"], restarted
    loaded = _loaded(events)
    assert loaded["step"] == emergency["step"] and loaded["sources"]["storage"] == 0, loaded
    _assert_equals_storage_restore(trainer, events, tmp_path)
