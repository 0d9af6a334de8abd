"""Live recovery, the bytes: survivors of a broken HSDP attempt hand over the state of their
last finished step, and the next attempt loads it at another size, with no storage read,
bitwise as a checkpoint of that step would have been loaded. Plain processes, no Ray."""

import time

import pytest
import torch

from conftest import SEQ_LEN, small_gpt

from rayflex.faults.live_recovery import roll_forward
from rayflex.testing.chaos.local_workers import LocalWorkerPool
from rayflex.local_ray import free_ports

STEPS, FAIL_AT = 8, 5  # rank 0 raises when it starts step 5: the survivors hold step 4


def _spec(dataset_uri, root, every_steps):
    import rayflex as rf

    return rf.Trainer(model=small_gpt(n_layers=2),
                      data=rf.DataConfig(uri=dataset_uri, seq_len=SEQ_LEN, global_batch=8),
                      run=rf.RunConfig(name="live", storage=f"file://{root}", steps=STEPS,
                                       optimizer=rf.OptimizerConfig(lr=1e-2, warmup_steps=2)),
                      parallel=rf.ParallelConfig(dp_shard=2),
                      scaling=rf.ScalingConfig(num_workers=4, min_workers=2),
                      checkpoint=rf.CheckpointConfig(every_steps=every_steps, keep=5)).spec


def _call(pool, order, method, *args, **kwargs):
    return pool.each(order, "call", lambda k: (method, args, kwargs))


def _wait(pool, order, states, timeout_s=180):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = _call(pool, order, "poll")
        if all(str(s.state) in states for s in got):
            return got
        time.sleep(0.2)
    raise AssertionError(f"ranks {order} did not reach {states}: {[(s.state, s.step) for s in got]}")


def _final_model(root):
    from rayflex.checkpoint import manifest as mf
    from rayflex.checkpoint.reader import CheckpointWeights

    uri = f"file://{root}/live/checkpoints"
    weights = CheckpointWeights(step_uri=mf.step_dir(uri, STEPS), step=STEPS, model={}, description="final")
    return weights.load(sorted(weights.tensors()))


@pytest.mark.multiproc
def test_survivors_state_resumes_at_another_size_bitwise_like_a_checkpoint(dataset_uri, tmp_path, monkeypatch):
    world4, world2 = [0, 1, 2, 3], [0, 1]
    with LocalWorkerPool(4, timeout_s=240) as pool:
        # The reference: a fault-free run that saves step 4 at 4 ranks (HSDP 2 x 2) and
        # resumes it from storage at 2 (FSDP 2).
        ref = _spec(dataset_uri, tmp_path / "ref", every_steps=4)
        pool.each(world4, "assign", lambda k: (ref, k, 4))
        port = free_ports(1)[0]
        _call(pool, world4, "setup", "127.0.0.1", port, True)
        _call(pool, world4, "start", FAIL_AT - 1)
        _wait(pool, world4, {"done"})
        _call(pool, world4, "release", 30, 0)
        pool.each(world2, "assign", lambda k: (ref, k, 2))
        port = free_ports(1)[0]
        restored = _call(pool, world2, "setup", "127.0.0.1", port, True)
        assert restored[0]["restored"]["step"] == FAIL_AT - 1
        _call(pool, world2, "start", STEPS)
        _wait(pool, world2, {"done"})
        _call(pool, world2, "release", 30, 0)

    # Rank 1 stays inside step 4's closing agreement (the step's second all-reduce on the world
    # group) after its share went out, as a rank frozen there would: its peers finish step 4.
    monkeypatch.setenv("RAYFLEX_COLLECTIVE_FAULT", f"1:{FAIL_AT - 1}:hold:all_reduce:world:2")
    # A pool of its own: a process keeps the spec (and environment) it was started with.
    with LocalWorkerPool(4, timeout_s=240) as pool:
        # Live: rank 0 raises at step 5 and the others are aborted out of its collectives;
        # ranks 1, 2, 3 hand over step 4, which no checkpoint holds (saves only at the end) —
        # rank 1 first applies step 4's update, whose reduced gradients it holds.
        run = _spec(dataset_uri, tmp_path / "run", every_steps=STEPS)
        pool.each(world4, "assign", lambda k: (run, k, 4))
        port = free_ports(1)[0]
        _call(pool, world4, "setup", "127.0.0.1", port, True)
        _call(pool, [0], "set_fail_at", FAIL_AT, "injected")
        _call(pool, world4, "start", STEPS)
        _wait(pool, [0], {"failed"}, timeout_s=60)
        survivors = [1, 2, 3]
        left = _call(pool, survivors, "release", 30, 0, True, True)
        assert [str(x) for x in left] == ["left"] * 3
        held = dict(zip(survivors, _call(pool, survivors, "held_step")))
        assert {r: (h["step"], h["pending"]) for r, h in held.items()} == {
            1: (FAIL_AT - 2, FAIL_AT - 1), 2: (FAIL_AT - 1, None), 3: (FAIL_AT - 1, None)}, held
        forward = roll_forward(held)
        assert forward is not None and forward.ranks == (1,) and forward.step == FAIL_AT - 1, forward
        taken = dict(zip(survivors, pool.each(survivors, "call", lambda k: (
            "take_live", (dict(forward.agreed) if survivors[k] in forward.ranks else None,), {}))))
        _call(pool, [0], "release", 30, 0, True)
        infos = {r: info for r, (info, _) in taken.items()}
        assert all("error" not in i and i["step"] == FAIL_AT - 1 for i in infos.values()), infos
        assert infos[1]["rolled_forward"] == FAIL_AT - 1 and "rolled_forward" not in infos[2], infos
        live = {"step": FAIL_AT - 1, "infos": infos, "files": {r: files for r, (_, files) in taken.items()},
                "world_size": 4}
        # The new attempt: processes 1 and 2 (old ranks 1 and 2) become ranks 0 and 1.
        new = [1, 2]
        pool.each(new, "assign", lambda k: (run, k, 2))
        port = free_ports(1)[0]
        got = _call(pool, new, "setup", "127.0.0.1", port, True, live)
        for g in got:
            assert g["restored"]["uri"] == "live peers" and g["restored"]["step"] == FAIL_AT - 1, g["restored"]
        _call(pool, new, "start", STEPS)
        _wait(pool, new, {"done"})
        _call(pool, new, "release", 30, 0)

    from rayflex.checkpoint import manifest as mf

    saved = mf.list_committed(f"file://{tmp_path}/run/live/checkpoints")
    assert saved == [FAIL_AT, STEPS], "committed after the first resumed step, then the final one"
    want, have = _final_model(tmp_path / "ref"), _final_model(tmp_path / "run")
    assert want.keys() == have.keys()
    for key in want:
        assert torch.equal(want[key], have[key]), key


@pytest.mark.multiproc
def test_survivors_that_turn_out_not_to_hold_every_shard_fall_back_to_the_checkpoint(dataset_uri, tmp_path):
    # FSDP over 2 ranks saving every 2 steps; rank 0 raises at step 5. Handed only rank 1's
    # snapshot (half of every parameter, as a survivor whose snapshot lacks a shard would), the
    # next attempt cannot load the survivors' state: it loads step 4's checkpoint instead of
    # failing the run, saying why.
    import dataclasses

    import rayflex as rf

    world = [0, 1]
    spec = dataclasses.replace(_spec(dataset_uri, tmp_path / "run", every_steps=2), parallel=rf.ParallelConfig(),
                               scaling=rf.ScalingConfig(num_workers=2))
    with LocalWorkerPool(2, timeout_s=240) as pool:
        pool.each(world, "assign", lambda k: (spec, k, 2))
        _call(pool, world, "setup", "127.0.0.1", free_ports(1)[0], True)
        _call(pool, world, "start", FAIL_AT - 1)  # step 4 committed (a run's end waits for its save)
        _wait(pool, world, {"done"})
        _call(pool, [0], "set_fail_at", FAIL_AT, "injected")
        _call(pool, world, "start", STEPS)
        _wait(pool, [0], {"failed"}, timeout_s=60)
        _call(pool, [1], "release", 30, 0, True, True)
        info, files = _call(pool, [1], "take_live")[0]
        _call(pool, [0], "release", 30, 0, True)
        assert "error" not in info and info["step"] == FAIL_AT - 1, info
        live = {"step": FAIL_AT - 1, "infos": {1: info}, "files": {1: files}, "world_size": 2}
        pool.each(world, "assign", lambda k: (spec, k, 2))
        got = _call(pool, world, "setup", "127.0.0.1", free_ports(1)[0], True, live)
        for g in got:
            restored = g["restored"]
            assert restored["uri"].endswith("step_00000004") and restored["step"] == FAIL_AT - 1, restored
            assert "the survivors hold" in restored["live_failed"], restored
        _call(pool, world, "start", STEPS)
        _wait(pool, world, {"done"})
        _call(pool, world, "release", 30, 0)
