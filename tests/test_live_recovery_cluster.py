"""Live recovery on a loopback cluster: an HSDP run (2 replicas x 2 shards, a replica per
node) that loses a worker (SIGKILL) and later a whole node, or a frozen worker (SIGSTOP),
resumes from the survivors' memory each time — no step lost, nothing read from storage —
and ends with the parameters of a run that never failed, bit for bit (it restarts at the
same size: the replacement is waited for)."""

import os
import signal
import time

import numpy as np
import pytest

import rayflex as rf
from rayflex.checkpoint import manifest as mf
from rayflex.constants import knob
from rayflex.data.dataset import TokenDataset
from rayflex.testing.chaos.bounds import DetectionTiming
from rayflex.testing.chaos.replay import Segment, compare, replay

from conftest import run_events, small_gpt, wait_for, wait_then_end_frozen, wait_until_running
from test_elastic_cluster import fast_detection  # noqa: F401 - the autouse fixture

pytestmark = pytest.mark.cluster
# No checkpoint before step 16: a rollback would lose every step trained before the kill.
STEPS, EVERY = 32, 16


def _trainer(dataset_uri, tmp_path, name):
    return rf.Trainer(model=small_gpt(n_layers=2),
                      data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=8, log_samples=True),
                      run=rf.RunConfig(name=name, storage=f"file://{tmp_path}/runs", steps=STEPS,
                                       optimizer=rf.OptimizerConfig(lr=1e-2, warmup_steps=2)),
                      parallel=rf.ParallelConfig(dp_shard=2),
                      # min_workers=4: a restart waits for a lost node's replacement.
                      scaling=rf.ScalingConfig(num_workers=4, min_workers=4, cpus_per_worker=1),
                      checkpoint=rf.CheckpointConfig(every_steps=EVERY, keep=3),
                      # The replacement is waited for: the run stays at 4 ranks, so the fault-free
                      # run is the reference "at the same size".
                      elastic=rf.ElasticConfig(max_failures=2, resource_wait_s=60, restart_while_warming=False))


@pytest.fixture(scope="module")
def fault_free(dataset_uri, tmp_path_factory):
    """The final step of the same run without a fault, trained in plain local processes
    (the chaos replay's pool: no Ray actors to start); its checkpoint directory."""
    root = tmp_path_factory.mktemp("live-ref")
    spec = _trainer(dataset_uri, root, "live-ref").spec
    return mf.step_dir(replay(spec, [Segment(4, 0, STEPS)], f"file://{root}/replay"), STEPS)


# A fault inside a step's closing all-reduce can leave the survivors a step apart (a ring
# all-reduce completes on some ranks before others: CI, 2026-12-07, steps 5 and 6): those left
# inside it hold the step's gradients and roll forward, so no window loses a step.
def _assert_live_recovered(trainer, tmp_path, name, result, fault_free, lost_ranks_per_fault):
    """Each fault (its lost ranks, in order) recovered from live peers; every step trained
    once on its own samples; the final parameters those of the fault-free run."""
    assert result.status == "finished" and result.steps_completed == STEPS
    events = run_events(tmp_path, name)
    chosen = [e for e in events if e["kind"] == "recovery_chosen"]
    assert [e["source"] for e in chosen] == ["live_peers"] * len(lost_ranks_per_fault), chosen
    restarted = [e for e in events if e["kind"] == "restarted"]
    loaded = [e for e in events if e["kind"] == "checkpoint_loaded"]
    committed = [e for e in events if e["kind"] == "checkpoint_committed"]
    assert 4 <= chosen[0]["step"] < EVERY, "recovered past every checkpoint (there was none yet)"
    for live, lost, restart in zip(chosen, lost_ranks_per_fault, restarted, strict=True):
        load = next((e for e in loaded if live["time"] <= e["time"] <= restart["time"]), None)
        step = live["step"]
        assert not set(lost) & set(live["holders"]), f"the lost shards were read from their live replicas: {live}"
        assert restart["lost_steps"] == 0 and restart["from_step"] == step, restart
        assert load is not None and load["uri"] == "live peers" and load["step"] == step, load
        # Committed after the first resumed step, so a second failure cannot roll back past it.
        after = next(c for c in committed if c["step"] > step)
        assert after["step"] == step + 1 and after["reason"] == "live_recovery", after

    metrics = run_events(tmp_path, name, "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), "every step trained and recorded once"
    sampler = TokenDataset(trainer.spec.data.uri).sampler(trainer.spec.data)
    samples = {s["step"]: s["indices"] for s in run_events(tmp_path, name, "samples.jsonl")}
    assert sorted(samples) == list(range(1, STEPS + 1))
    for step, indices in samples.items():
        np.testing.assert_array_equal(indices, sampler.indices(step - 1, 0, 1))

    same = compare(mf.step_dir(trainer.spec.checkpoint_uri, STEPS), fault_free)
    assert same["bitwise_equal"], f"the final parameters differ from the fault-free run's: {same}"


def _signal_rank_once_running(trainer, rank: int, sig) -> tuple:
    """Submit the run, wait for step 4, send ``sig`` to ``rank``'s process: (handle, its pid)."""
    handle = trainer.submit()
    st = wait_until_running(handle, 4)
    victim = next(w for w in st["workers"] if w["rank"] == rank)
    os.kill(victim["pid"], sig)
    return handle, victim


def test_a_killed_worker_and_then_a_lost_node_lose_no_step(two_node_cluster, dataset_uri, tmp_path, fault_free):
    """A SIGKILLed rank, then (after the live step's commit) the node of the other replica:
    both restarts resume from the survivors' memory."""
    cluster = two_node_cluster
    worker_node = next(iter(cluster.worker_nodes))
    trainer = _trainer(dataset_uri, tmp_path, "live-kill-node")
    handle, _ = _signal_rank_once_running(trainer, 1, signal.SIGKILL)
    # Past the commit of the first live step (its first resumed step). How many steps the run
    # trains while that commit is reported varies with the host (12 on a loaded one), so the
    # doomed node's workers are frozen first: the run cannot pass its next collective until
    # the node is gone, and only a run that ended before the commit showed misses the window.
    st = wait_until_running(handle, 8, timeout_s=180, committed=5)
    doomed = [w for w in st["workers"] if w["node_id"] == worker_node.node_id]
    assert len(doomed) == 2, st["workers"]
    try:
        for w in doomed:
            os.kill(w["pid"], signal.SIGSTOP)
        assert not handle.done(), f"the run ended before its live commit was reported: {handle.status()}"
        gone_at = time.time()
        cluster.remove_node(worker_node)
    finally:
        # A removed node's processes are gone: the frozen ones too (never left stopped).
        for w in doomed:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(w["pid"], sig)
                except ProcessLookupError:
                    pass
    lost_ranks = sorted(w["rank"] for w in doomed)
    try:
        # The restart waits for 4 slots (min_workers=4; the head has 2): a node like the lost
        # one joins once the run is restarting. The run's own detection bounds this wait (it
        # is asserted below); pytest's timeout catches a run that never notices.
        while handle.status()["state"] != "RESTARTING":
            assert not handle.done(), f"the run ended instead of restarting: {handle.status()}"
            time.sleep(0.2)
    finally:
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1", labels={"rack": "r1"})
    _assert_live_recovered(trainer, tmp_path, "live-kill-node", handle.wait(timeout_s=240), fault_free,
                           [[1], lost_ranks])
    # Named as the chaos harness's rule for a removed node has it: the next poll or node-list
    # refresh after it went, plus a few of this run's own steps for Ray's notices.
    named = next(e for e in run_events(tmp_path, "live-kill-node")
                 if e["kind"] in ("node_lost", "worker_died", "worker_failed") and e["time"] > gone_at)
    timing = DetectionTiming.of_run(knob("HEARTBEAT_TIMEOUT_S"), run_events(tmp_path, "live-kill-node", "metrics.jsonl"))
    assert named["time"] - gone_at <= timing.mechanism_s("remove_node") + timing.slack_s, (named, gone_at, timing)


HELD = 6  # the step inside whose closing agreement rank 1 is held


def test_a_frozen_worker_loses_no_step(two_node_cluster, dataset_uri, tmp_path, fault_free, monkeypatch):
    """Rank 2 frozen (SIGSTOP) with the survivors a step apart: rank 1 is held inside step 6's
    closing all-reduce after its share went out (the test-only collective fault ``hold``, the
    step's second all-reduce on the world group), so ranks 0 and 3 finish step 6 and it does not.
    The hang is named, rank 2 replaced, rank 1 applies step 6's update it holds: no step lost."""
    log = tmp_path / "faults.jsonl"
    monkeypatch.setenv("RAYFLEX_COLLECTIVE_FAULT", f"1:{HELD}:hold:all_reduce:world:2")
    monkeypatch.setenv("RAYFLEX_FAULT_LOG", str(log))
    trainer = _trainer(dataset_uri, tmp_path, "live-freeze")
    handle = trainer.submit()
    try:
        # Once rank 1's all-reduce returned (every share was sent), its peers finish step 6.
        wait_for(lambda: log.exists() and "holding" in log.read_text(), 180, "rank 1 held inside step 6's agreement",
                 interval_s=0.05)
        victim = next(w for w in handle.status()["workers"] if w["rank"] == 2)
        os.kill(victim["pid"], signal.SIGSTOP)
    except BaseException:
        handle.stop(timeout_s=60)
        raise
    result = wait_then_end_frozen(handle, victim["pid"])
    assert any(e["kind"] == "hang_detected" for e in run_events(tmp_path, "live-freeze"))
    _assert_live_recovered(trainer, tmp_path, "live-freeze", result, fault_free, [[2]])
    chosen = next(e for e in run_events(tmp_path, "live-freeze") if e["kind"] == "recovery_chosen")
    assert chosen["step"] == HELD and f"rank 1 was left inside step {HELD}'s closing agreement" in chosen["reason"], chosen
