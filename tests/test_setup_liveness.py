"""A rank frozen while a new attempt starts is named within the heartbeat timeout, not
after the whole setup timeout (found by the overlap chaos run: a SIGSTOP during a restore
stalled the restart for 300 s). The controller pings every rank from another actor thread
while the ranks rendezvous, build and restore."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rayflex.errors import SetupFailed

pytestmark = pytest.mark.cluster


def _slow_setup_actor():
    """Stands in for a TrainWorker: ``setup`` takes a while, ``ping`` answers meanwhile
    (defined in a function so Ray ships it by value: workers cannot import test modules)."""
    import ray

    class SlowSetup:
        def pid(self) -> int:
            return os.getpid()

        def setup(self, seconds: float) -> int:
            time.sleep(seconds)
            return os.getpid()

        def ping(self) -> int:
            return os.getpid()

    return ray.remote(num_cpus=0, max_concurrency=2)(SlowSetup)


def test_a_rank_frozen_during_setup_fails_the_phase_within_the_heartbeat_timeout(two_node_cluster, monkeypatch):
    import ray

    from rayflex.group.worker_group import _gather

    monkeypatch.setenv("RAYFLEX_HEARTBEAT_TIMEOUT_S", "2")
    cls = _slow_setup_actor()
    actors = [cls.remote(), cls.remote()]
    pids = ray.get([a.pid.remote() for a in actors])
    try:
        refs = [a.setup.remote(60) for a in actors]
        os.kill(pids[1], signal.SIGSTOP)
        t0 = time.time()
        with pytest.raises(SetupFailed) as failed:
            _gather(refs, 120, "rendezvous, build and restore", liveness=dict(enumerate(actors)))
        took = time.time() - t0
        # Rank 0 is still in its 60 s setup too, past the heartbeat timeout: it answers its
        # pings, so only the frozen rank is named.
        assert failed.value.frozen and failed.value.slow == [1] and failed.value.dead == {}
        assert "rank 1 stopped answering for 2s (frozen?)" in str(failed.value)
        # Named by the heartbeat, not when rank 0's 60 s setup ends or the 120 s gather gives up.
        assert took < 30, f"named after {took:.1f}s, not within the heartbeat timeout"
    finally:
        os.kill(pids[1], signal.SIGCONT)
        for a in actors:
            ray.kill(a)
