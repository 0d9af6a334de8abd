"""A worker process reused by the next attempt under another rank checkpoints and hands over
its live state correctly.

Elastic restarts keep surviving processes and renumber them. DTensor caches sharding
decisions (in Python and in its C++ dispatch fast path) keyed by DeviceMesh equality, which
ignores which rank a process is: without clearing them, a process that was rank 0 and is
now rank 1 of an equal-looking mesh gets the old mesh back, its shards claim rank 0's
offsets, and DCP refuses the save ("invalid fill tensor-volume"). The C++ cache is kept per
thread, and a Ray actor answers calls on threads that outlive attempts. Plain processes, no Ray.
"""

import pickle
import time

import pytest

from conftest import SEQ_LEN, small_gpt

from rayflex.testing.chaos.local_workers import LocalWorkerPool


# Processes 0, 1 are ranks 0, 1; then a fresh process 2 takes rank 0 and process 0 is
# renumbered to rank 1 of an equal-looking mesh (what a growth restart does).
ATTEMPTS = [[0, 1], [2, 0]]


@pytest.mark.multiproc
def test_renumbered_process_checkpoints_its_own_shards(dataset_uri, tmp_path):
    import rayflex as rf

    def spec(steps):
        return rf.Trainer(model=small_gpt(n_layers=2),
                          data=rf.DataConfig(uri=dataset_uri, seq_len=SEQ_LEN, global_batch=12),
                          run=rf.RunConfig(name="reuse", storage=f"file://{tmp_path}/runs", steps=steps),
                          scaling=rf.ScalingConfig(num_workers=2, min_workers=1),
                          checkpoint=rf.CheckpointConfig(every_steps=2, keep=5)).spec

    with LocalWorkerPool(1 + max(max(a) for a in ATTEMPTS), timeout_s=240) as pool:
        for attempt, order in enumerate(ATTEMPTS):
            steps = 4 * (attempt + 1)
            got = pool.attempt(order, spec(steps), steps)
            assert got["restored_step"] == steps - 4, got
            for r in got["runs"]:
                assert r.get("state") == "done" and r["step"] == steps, r
                assert not r["checkpoint_errors"], r["checkpoint_errors"][0][-600:]
            assert got["released"] == ["left"] * len(order)

    from rayflex.checkpoint import manifest as mf

    root = f"file://{tmp_path}/runs/reuse/checkpoints"
    last = 4 * len(ATTEMPTS)
    assert mf.list_committed(root)[-1] == last
    assert mf.verify(root, last).world_size == len(ATTEMPTS[-1])


def _chunk_offsets(info) -> dict:
    """fqn -> the offsets of the chunks a live snapshot says it holds."""
    md = pickle.loads(info["metadata"])
    return {fqn: sorted(tuple(c.offsets) for c in item.chunks)
            for fqn, item in md.state_dict_metadata.items() if hasattr(item, "chunks")}


@pytest.mark.multiproc
def test_renumbered_process_snapshots_its_own_shards_on_a_call_thread_of_the_last_attempt(dataset_uri, tmp_path):
    """Live recovery's snapshot is taken on one of the actor's call threads, maybe one that
    set up the attempt before (its DTensor ops filled that thread's cache). Both processes
    swap ranks between two attempts; each attempt is set up on one call thread and snapshot
    on the other, swapped the second time. Each rank's snapshot must hold that rank's chunks
    (before: the old rank's, so a merge of the survivors missed a shard or, where all were
    renumbered, put each shard where another belongs)."""
    import rayflex as rf

    spec = rf.Trainer(model=small_gpt(n_layers=2),
                      data=rf.DataConfig(uri=dataset_uri, seq_len=SEQ_LEN, global_batch=8),
                      run=rf.RunConfig(name="reuse-live", storage=f"file://{tmp_path}/runs", steps=2),
                      scaling=rf.ScalingConfig(num_workers=2, min_workers=1),
                      checkpoint=rf.CheckpointConfig(every_steps=0)).spec
    chunks = {}
    with LocalWorkerPool(2, timeout_s=240) as pool:
        for attempt, order in enumerate([[0, 1], [1, 0]]):
            pool.each(order, "assign", lambda k: (spec, k, 2))
            port = pool.each(order[:1], "call", lambda k: ("node_info", (), {}))[0]["port"]
            set_up_on, snapshot_on = ("call-1", "call-2") if attempt == 0 else ("call-2", "call-1")
            pool.each(order, "call_on", lambda k: (set_up_on, "setup", ("127.0.0.1", port, True), {}))
            pool.each(order, "call", lambda k: ("start", (2,), {}))
            deadline = time.time() + 180
            while not all(str(s.state) == "done" for s in pool.each(order, "call", lambda k: ("poll", (), {}))):
                assert time.time() < deadline, "the attempt did not finish its 2 steps"
                time.sleep(0.2)
            pool.each(order, "call", lambda k: ("release", (30, 0, False, True), {}))
            for info, _ in pool.each(order, "call_on", lambda k: (snapshot_on, "take_live", (), {})):
                assert "error" not in info, info
                chunks[attempt, info["rank"]] = _chunk_offsets(info)
    assert chunks[0, 0] != chunks[0, 1]
    for rank in (0, 1):
        assert chunks[1, rank] == chunks[0, rank], f"rank {rank}, a renumbered process, named another rank's chunks"


class _Upload:
    """An AsyncCheckpointer stand-in whose save is (or is not) still uploading."""

    def __init__(self, running: bool):
        self.running, self.waited, self.abandoned = running, [], False

    def abandon(self) -> None:  # the attempt's collectives are aborted: it can never commit
        self.abandoned = True

    def busy(self) -> bool:
        return self.running

    def wait(self, timeout_s=None):
        self.waited.append(timeout_s)
        if self.running:
            raise TimeoutError("still uploading")
        return []

    def settle(self, timeout_s: float) -> None:
        self.waited.append(timeout_s)

    def close(self) -> None:  # the attempt is over: its staging buffers go
        self.closed = True


@pytest.mark.parametrize("running", [True, False])
def test_a_process_still_uploading_is_not_offered_for_reuse(dataset_uri, running):
    """A reused process must never write into a later attempt's checkpoints: one whose
    upload outlives the release grace says it cannot be reused (the controller then kills
    it); one with nothing in flight leaves cleanly. Even with no grace (a peer died) the
    upload gets a second to fail."""
    import rayflex as rf
    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.status import Leaving, WorkerState
    from rayflex.worker.train_worker import TrainWorker

    spec = rf.Trainer(model=small_gpt(), data=rf.DataConfig(uri=dataset_uri, seq_len=SEQ_LEN, global_batch=4),
                      run=rf.RunConfig(name="reuse-upload", steps=2)).spec
    import torch

    threads = torch.get_num_threads()
    try:
        worker = TrainWorker(0, spec, plan_mesh(spec.model, spec.parallel, spec.data, 1))
    finally:
        torch.set_num_threads(threads)  # a worker sets its own; this is the test's process
    upload = worker.checkpointer = _Upload(running)
    assert worker.release(timeout_s=2.0, checkpoint_grace_s=0.0, abort=True) == \
        (Leaving.UPLOADING if running else Leaving.LEFT)
    assert max(upload.waited) >= 1.0
    assert upload.abandoned, "the save that can no longer commit is told to write nothing more"
    assert (worker._state == WorkerState.RELEASED) is (not running)
    if not running:
        assert upload.closed, "a clean release lets go of the attempt's staging buffers"
