"""Resuming with a different ``run.steps``: the learning-rate schedule follows the new total.

The schedule is a pure function of (step, the current config's ``run.steps``): step ``s``
trains at ``OptimizerConfig.lr_of_step(s, run.steps)``, whatever the checkpoint it resumed
from was trained toward. What a user sees is asserted: the ``lr`` of each step's record,
and the ``schedule_changed`` event in the run's timeline. No Ray: the worker part runs one
TrainWorker in this process (world size 1, gloo on 127.0.0.1); the controller part drives
the Controller through the fake cluster of ``controller_fakes``.
"""

from __future__ import annotations

import dataclasses

import pytest

import rayflex as rf
from rayflex.control.controller import Controller
from rayflex.models.summary import ModelSummary
from rayflex.telemetry import events as ev
from rayflex.testing.reference import single_process_losses, single_process_train

from controller_fakes import FakeClock, FakeCluster

OPT = rf.OptimizerConfig(lr=1e-2, warmup_steps=3, min_lr_ratio=0.1)


# ----------------------------------------------------------------- the schedule itself
def test_step_s_trains_at_the_factor_after_s_minus_1_optimizer_steps():
    assert OPT.lr_of_step(1, 30) == pytest.approx(OPT.lr / 3)  # warm-up starts at lr / warmup_steps
    for s in range(1, 41):
        assert OPT.lr_of_step(s, 40) == OPT.lr * OPT.lr_factor(s - 1, 40)
    assert OPT.lr_of_step(31, 30) == pytest.approx(OPT.lr * OPT.min_lr_ratio)  # past the end: the floor


# ----------------------------------------------------------------- one real worker
def _train(spec, end_step: int):
    """Set up one rank (restoring the newest checkpoint if any), train to ``end_step``,
    shut down; returns (setup info, {step: record})."""
    import torch.distributed as dist

    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.train_worker import TrainWorker

    worker = TrainWorker(0, spec, plan_mesh(spec.model, spec.parallel, spec.data, 1))
    try:
        info = worker.setup("127.0.0.1", worker.node_info()["port"], restore=True)
        worker.start(end_step)
        assert worker.join(60.0), "training did not finish in 60 s"
        status = worker.poll()
        assert status.state == "done", status.error
        return info, {r.step: r for r in status.records}
    finally:
        worker.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 30-step run resumed with run.steps=40, and the same run uninterrupted at 40."""
    from rayflex.data.dataset import write_synthetic_dataset
    from rayflex.models import gpt

    root = tmp_path_factory.mktemp("lr")
    data = write_synthetic_dataset(f"file://{root}/tokens", num_samples=64, seq_len=8, vocab_size=32,
                                   num_shards=1)
    model = gpt(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2)

    def spec(name: str, steps: int) -> rf.TrainSpec:
        return rf.TrainSpec(model=model, data=rf.DataConfig(uri=data, seq_len=8, global_batch=4),
                            run=rf.RunConfig(name=name, storage=f"file://{root}/runs", steps=steps, optimizer=OPT),
                            scaling=rf.ScalingConfig(num_workers=1),
                            checkpoint=rf.CheckpointConfig(every_steps=30, async_save=False))

    first_info, first = _train(spec("extended", 30), 30)
    resumed_info, resumed = _train(spec("extended", 40), 40)
    _, straight = _train(spec("straight", 40), 40)
    # The ground truth of the same story: 30 steps toward 30, then on to 40 toward 40.
    ref_first, ref_state = single_process_train(spec("extended", 30), 30)
    ref_resumed = single_process_losses(spec("extended", 40), 40, start_state=ref_state)
    return {"first_info": first_info, "first": first, "resumed_info": resumed_info, "resumed": resumed,
            "straight": straight, "ref_first": ref_first, "ref_resumed": ref_resumed}


def test_the_resumed_run_follows_the_new_total_from_its_first_step(runs):
    assert runs["first_info"]["restored"] is None
    assert sorted(runs["first"]) == list(range(1, 31))
    assert sorted(runs["resumed"]) == list(range(31, 41)), "resumed from the step-30 checkpoint"
    for s, record in runs["first"].items():
        assert record.lr == pytest.approx(OPT.lr_of_step(s, 30), rel=1e-12)
    for s, record in runs["resumed"].items():
        # No stale end-of-schedule LR at step 31: the new total from the first resumed step.
        assert record.lr == pytest.approx(OPT.lr * OPT.lr_factor(s - 1, 40), rel=1e-12), f"step {s}"
        assert record.lr == pytest.approx(runs["straight"][s].lr, rel=1e-12), f"step {s}"


def test_the_resumed_run_trains_like_the_reference_resumed_the_same_way(runs):
    # A stale learning rate at step 31 would show from step 32's loss on.
    assert [runs["first"][s].loss for s in range(1, 31)] == pytest.approx(runs["ref_first"], rel=1e-5)
    assert [runs["resumed"][s].loss for s in range(31, 41)] == pytest.approx(runs["ref_resumed"], rel=1e-5)


def test_the_restored_checkpoint_says_which_total_it_was_trained_toward(runs):
    restored = runs["resumed_info"]["restored"]
    assert restored["step"] == 30 and restored["total_steps"] == 30
    assert restored["world_size"] == 1 and restored["uri"].endswith("00000030")


# ----------------------------------------------------------------- the controller's event
def _resume(tmp_path, *, saved_total, steps=40, committed=30):
    model = ModelSummary(name="m", num_blocks=4, hidden_size=8, init_seed=1, block_params=(10, 10, 10, 10))
    spec = rf.TrainSpec(model=model, data=rf.DataConfig(uri="file:///nowhere", seq_len=8, global_batch=8),
                        run=rf.RunConfig(name="r", storage=f"file://{tmp_path}", steps=steps, optimizer=OPT),
                        scaling=rf.ScalingConfig(num_workers=2),
                        checkpoint=rf.CheckpointConfig(resume=True),
                        elastic=rf.ElasticConfig(watch_ray_drain=False))
    clock = FakeClock()
    cluster = FakeCluster({"a": 2}, clock)
    cluster.committed = committed  # the newest checkpoint of the earlier submission
    cluster.saved_total_steps = saved_total
    controller = Controller(spec, cluster=cluster, clock=clock)
    result = controller.run()
    return controller.ctx.recorder.timeline, result


@pytest.fixture(autouse=True)
def _no_report(monkeypatch):
    monkeypatch.setattr("rayflex.telemetry.report.write_report", lambda *a, **k: None)


def test_resuming_toward_a_new_total_records_the_schedule_change(tmp_path):
    timeline, result = _resume(tmp_path, saved_total=30, steps=40)
    assert result["status"] == "finished" and result["steps_completed"] == 40
    [changed] = timeline.of(ev.ScheduleChanged)
    assert (changed.step, changed.from_total_steps, changed.to_total_steps) == (30, 30, 40)
    assert changed.lr_before == pytest.approx(OPT.lr_of_step(31, 30))  # the old schedule's floor
    assert changed.lr_after == pytest.approx(OPT.lr_of_step(31, 40))
    assert changed.lr_before == pytest.approx(OPT.lr * OPT.min_lr_ratio)
    kinds = [type(e) for e in timeline.events]
    assert kinds.index(ev.ScheduleChanged) == kinds.index(ev.CheckpointLoaded) + 1
    assert "30 -> 40" in changed.describe()
    back = ev.parse_event(changed.to_dict())
    assert back == changed


@pytest.mark.parametrize("saved_total", [40, None], ids=["same-total", "checkpoint-without-total"])
def test_no_schedule_change_without_a_known_different_total(tmp_path, saved_total):
    timeline, result = _resume(tmp_path, saved_total=saved_total, steps=40)
    assert result["status"] == "finished"
    assert timeline.of(ev.CheckpointLoaded) and not timeline.of(ev.ScheduleChanged)


def test_shortening_a_run_is_recorded_too(tmp_path):
    timeline, _ = _resume(tmp_path, saved_total=40, steps=35, committed=20)
    [changed] = timeline.of(ev.ScheduleChanged)
    assert (changed.step, changed.from_total_steps, changed.to_total_steps) == (20, 40, 35)
    assert changed.lr_after == pytest.approx(OPT.lr_of_step(21, 35))
    assert dataclasses.asdict(changed)["lr_before"] == pytest.approx(OPT.lr_of_step(21, 40))
