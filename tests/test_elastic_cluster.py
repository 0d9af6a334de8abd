"""Faults on a live loopback cluster: the run notices in seconds, names the rank and node,
restarts from the last committed checkpoint at the size the cluster allows, and ends with
the loss of a run that never failed."""

import os
import re
import signal
import time

import pytest

import rayflex as rf
from rayflex.constants import knob
from rayflex.testing.reference import single_process_losses

from conftest import run_events, small_gpt, wait_then_end_frozen, wait_until_running

pytestmark = pytest.mark.cluster
# Enough that a fault lands mid-run: the first save commits a few steps late (a save due
# while the previous upload runs is deferred), and a step of one rank a node takes ~0.04 s.
STEPS, GB = 24, 12


@pytest.fixture(autouse=True)
def fast_detection(monkeypatch):
    monkeypatch.setenv("RAYFLEX_HEARTBEAT_TIMEOUT_S", "3")
    monkeypatch.setenv("RAYFLEX_RELEASE_TIMEOUT_S", "5")
    monkeypatch.setenv("RAYFLEX_HANG_TIMEOUT_FLOOR_S", "15")


# One rank per node of the shared cluster (2 CPUs a node): a rank's fault is a peer's on
# another node, a node's loss takes one rank, at half the process starts (~3 CPU-s each)
# and training of 2 ranks a node.
ONE_PER_NODE = dict(workers=2, min_workers=1, cpus_per_worker=2)


def _trainer(dataset_uri, tmp_path, name, *, workers=4, min_workers=2, cpus_per_worker=1, steps=STEPS, **elastic):
    # Growth here is onto nodes the run just left or that just joined: unchecked, so the run
    # grows as soon as the newcomers are warm (a health check first would add ~15 s, some 500
    # steps of a shrunk run here: the final loss would then be compared with the
    # single-process one after ~1,000 steps, past its float tolerance). Health checks before
    # growth: tests/test_node_health.py and tests/test_straggler_cluster.py.
    elastic.setdefault("health_checks", False)
    return rf.Trainer(model=small_gpt(n_layers=2),
                      data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=GB),
                      run=rf.RunConfig(name=name, storage=f"file://{tmp_path}/runs", steps=steps,
                                       optimizer=rf.OptimizerConfig(lr=1e-2, warmup_steps=2)),
                      scaling=rf.ScalingConfig(num_workers=workers, min_workers=min_workers, max_workers=workers,
                                               cpus_per_worker=cpus_per_worker),
                      checkpoint=rf.CheckpointConfig(every_steps=3, keep=2),
                      elastic=rf.ElasticConfig(max_failures=3, resource_wait_s=60, **elastic))


# A run that must shrink and grow back gets this many steps: more than it ever needs (it is
# stopped a few steps after it is whole again, `_stop_once_grown`), so a busy machine never
# ends the run before the newcomers are warm and a quiet one does not train on for nothing.
# A shrunk run of one rank a node steps in ~0.03 s here (a process starts in ~4 s).
GROW_STEPS = 1000


def _stop_once_grown(handle, world_size: int, *, extra_steps: int = 2, timeout_s: float = 240):
    """Wait until the run has shrunk and grown back to ``world_size`` and trained
    ``extra_steps`` at that size, then stop it (a checkpoint at the stop); its Result."""
    deadline = time.time() + timeout_s
    shrunk, grown_at = False, None
    while time.time() < deadline and not handle.done():
        st = handle.status()
        size = st.get("world_size")
        if st.get("state") == "RUNNING" and size is not None:
            shrunk = shrunk or size < world_size
            if shrunk and size == world_size:
                grown_at = st["step"] if grown_at is None else grown_at
                if st["step"] >= grown_at + extra_steps:
                    return handle.stop(timeout_s=max(1.0, deadline - time.time()))
        time.sleep(0.1)
    raise AssertionError(f"the run did not grow back to {world_size} workers within {timeout_s}s")


def _assert_recovered(result, trainer, events, *, world_size, stopped=False):
    """Every step once, restarted from a checkpoint, ending at ``world_size`` with the loss
    of a run that never failed; ``stopped``: stopped by the test after growing back, so
    "every step" is every step up to the stop."""
    steps_total = result.steps_completed if stopped else trainer.spec.run.steps
    assert result.status == ("stopped" if stopped else "finished"), result.status
    assert result.steps_completed == steps_total
    restarted = [e for e in events if e["kind"] == "restarted"]
    loaded = [e for e in events if e["kind"] == "checkpoint_loaded"]
    assert restarted and loaded, "the run restarted from a checkpoint"
    assert restarted[0]["lost_steps"] <= 3, "at most one checkpoint interval is lost"
    assert result.metrics[-1]["world_size"] == world_size
    steps = [m["step"] for m in result.metrics]
    assert steps == list(range(1, steps_total + 1)), "metrics.jsonl: every step once, rolled-back steps replaced"
    # The same data and the same math at any world size: the loss of a run that never failed.
    reference = single_process_losses(trainer.spec, steps_total)
    assert result.final_loss == pytest.approx(reference[-1], rel=1e-4)


def test_killed_worker_actor_is_replaced(two_node_cluster, dataset_uri, tmp_path):
    # restart_while_warming (the default): the run restarts at once with the process that
    # survived (rank 0, on the other node), and grows back to 2 once the replacement is
    # warm; stopped soon after.
    trainer = _trainer(dataset_uri, tmp_path, "kill-actor", steps=GROW_STEPS, **ONE_PER_NODE)
    handle = trainer.submit()
    st = wait_until_running(handle, 5, committed=3)
    victim = next(w for w in st["workers"] if w["rank"] == 1)
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    result = _stop_once_grown(handle, 2)
    events = run_events(tmp_path, "kill-actor")
    died = next(e for e in events if e["kind"] == "worker_died")
    assert died["rank"] == 1 and died["node_id"] == victim["node_id"]
    # Named as a death (Ray's notice of the dead process), before the heartbeat timeout
    # would have named the silent rank frozen.
    heartbeat_s = knob("HEARTBEAT_TIMEOUT_S")
    assert died["time"] - killed_at < heartbeat_s, f"a dead actor is noticed within the {heartbeat_s:g} s heartbeat"
    restarted = [e for e in events if e["kind"] == "restarted"]
    # The first restart waits for no new process: its one rank is the survivor, which left
    # the failed attempt (blocked on the dead peer's collective, it is aborted, not killed).
    first = restarted[0]
    assert first["world_size"] == first["reused_workers"] == 1, first
    started = [e for e in events if e["kind"] == "workers_started"]
    # Quicker than starting processes is on this machine now (the run's own first spawn,
    # measured under the same load): a fixed number of seconds is a timed test on a
    # shared 2-core machine (11.6 s once, 2.8 s when idle).
    assert first["time"] - died["time"] < max(5.0, started[0]["spawn_s"]), (first, started[0])
    assert all(e["spawn_s"] < started[0]["spawn_s"] / 2 for e in started[1:]), \
        "no restart waited for a process to start (this run's own cold start is the measure)"
    assert "capacity returned" in restarted[-1]["reason"] and restarted[-1]["world_size"] == 2
    _assert_recovered(result, trainer, events, world_size=2, stopped=True)


def test_frozen_worker_is_detected_as_hang(two_node_cluster, dataset_uri, tmp_path):
    # restart_while_warming=False: the restart waits for the frozen rank's replacement.
    # Rank 1 freezes on one node; rank 0, on the other, is caught waiting for it.
    trainer = _trainer(dataset_uri, tmp_path, "sigstop", restart_while_warming=False, **ONE_PER_NODE)
    handle = trainer.submit()
    st = wait_until_running(handle, 5, committed=3)
    victim = next(w for w in st["workers"] if w["rank"] == 1)
    frozen_at = time.time()
    os.kill(victim["pid"], signal.SIGSTOP)
    result = wait_then_end_frozen(handle, victim["pid"])
    events = run_events(tmp_path, "sigstop")
    hang = next(e for e in events if e["kind"] == "hang_detected")
    assert hang["ranks"] == [1] and hang["phases"]["1"] == "unresponsive"
    # Named at the first poll after the rank's silence passed the heartbeat timeout, however
    # long this host's controller cycle (poll_gap_s) took then ...
    assert hang["timeout_s"] < hang["stalled_s"] <= hang["timeout_s"] + hang["poll_gap_s"], hang
    # ... and that silence is the SIGSTOP: the last answer came before it, or was in flight
    # then and collected by the next cycle.
    assert hang["time"] - hang["stalled_s"] <= frozen_at + hang["poll_gap_s"], (frozen_at, hang)
    # The diagnosis, from the other ranks' flight records: who waits for the frozen rank, where.
    diagnosed = next(e for e in events if e["kind"] == "hang_diagnosed")
    # The others wait in the dp group's collective, or in the checkpoint group's when the
    # SIGSTOP lands during a save (every 3 steps here).
    assert (diagnosed["diagnosis"], diagnosed["ranks"]) == ("not_responding", [1]), diagnosed
    assert diagnosed["group"] in ("dp", "checkpoint"), diagnosed
    # Wherever the SIGSTOP lands (gloo's ring all-gather can complete on the rank the frozen
    # one already sent its piece to, which then computes on), rank 0 ends up waiting for it.
    waiting = re.match(r"rank 1 is not responding; ranks? ([\d, ]+) waits? in ", diagnosed["verdict"])
    assert waiting and set(map(int, waiting.group(1).split(", "))) == {0}, diagnosed["verdict"]
    assert diagnosed["verdict"].endswith(f" of the {diagnosed['group']} group (ranks 0, 1)"), diagnosed["verdict"]
    # The survivors' records are asked for as the hang is named, for at most the diagnosis timeout.
    assert diagnosed["time"] - hang["time"] <= knob("DIAGNOSIS_TIMEOUT_S") + hang["poll_gap_s"], (hang, diagnosed)
    assert [e["world_size"] for e in events if e["kind"] == "restarted"] == [2], "one restart, at full size"
    _assert_recovered(result, trainer, events, world_size=2)
