"""A checkpoint records the version of the sample order it was trained with; a resume
under another version says that later steps will see other rows (it still resumes)."""

from __future__ import annotations

import pytest

import rayflex as rf
from rayflex.control.controller import Controller
from rayflex.data.sampler import SAMPLE_ORDER
from rayflex.models.summary import ModelSummary
from rayflex.telemetry import events as ev

from checkpoint_helpers import save_committed, tiny_state
from controller_fakes import FakeClock, FakeCluster


@pytest.fixture(autouse=True)
def _no_report(monkeypatch):
    monkeypatch.setattr("rayflex.telemetry.report.write_report", lambda *a, **k: None)


def _loaded(tmp_path, saved_order) -> ev.CheckpointLoaded:
    model = ModelSummary(name="m", num_blocks=4, hidden_size=8, init_seed=1, block_params=(10, 10, 10, 10))
    spec = rf.TrainSpec(model=model, data=rf.DataConfig(uri="file:///nowhere", seq_len=8, global_batch=8),
                        run=rf.RunConfig(name="r", storage=f"file://{tmp_path}", steps=12),
                        scaling=rf.ScalingConfig(num_workers=2), checkpoint=rf.CheckpointConfig(resume=True),
                        elastic=rf.ElasticConfig(watch_ray_drain=False))
    clock = FakeClock()
    cluster = FakeCluster({"a": 2}, clock)
    cluster.committed = 6
    cluster.saved_sample_order = saved_order
    controller = Controller(spec, cluster=cluster, clock=clock)
    result = controller.run()
    assert result["status"] == "finished" and result["steps_completed"] == 12  # it resumes either way
    [loaded] = controller.ctx.recorder.timeline.of(ev.CheckpointLoaded)
    return loaded


def test_a_checkpoint_of_this_order_resumes_without_a_note(tmp_path):
    assert _loaded(tmp_path, SAMPLE_ORDER).data_order == ""


@pytest.mark.parametrize("saved", [SAMPLE_ORDER - 1, None])
def test_a_checkpoint_of_another_order_says_later_steps_see_other_rows(tmp_path, saved):
    loaded = _loaded(tmp_path, saved)
    note = loaded.data_order
    assert f"this rayflex uses order {SAMPLE_ORDER}" in note and "other rows" in note
    assert (f"sample order {saved}" if saved is not None else "before versions were recorded") in note
    assert "data_order=" in loaded.describe()


def test_the_checkpoint_records_the_order_it_was_saved_with(tmp_path):
    from rayflex.checkpoint.checkpointer import AsyncCheckpointer

    for order, name in ((SAMPLE_ORDER, "now"), (None, "old")):
        root = f"file://{tmp_path}/{name}/checkpoints"
        save_committed(root, tiny_state(sample_order=order), step=2)
        assert AsyncCheckpointer(root, rank=0, keep=2).load_latest(tiny_state())["sample_order"] == order
