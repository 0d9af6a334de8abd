"""Checkpoints due more often than uploads finish never stall training (the default
``CheckpointConfig(when_busy="defer")``): a save that falls due while the previous one is
still being written is taken at the first step boundary after that upload ended, a
``checkpoint_deferred`` event names the save it waited for, and no step is lost."""

import json

import pytest

import rayflex as rf
from rayflex.checkpoint import manifest as mf

from conftest import small_gpt

pytestmark = pytest.mark.cluster

UPLOAD_EXTRA_S = 1.5  # every upload from step 3 on takes this much longer (a slow bucket)
# Long enough that uploads end mid-run: 80 steps outlast a 1.5 s upload at anything above
# 0.02 s a step (~0.09 s measured on this kind of host).
STEPS = 80


def test_saves_every_step_while_uploads_lag_defer_without_blocking_training(
        two_node_cluster, dataset_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFLEX_SLOW_UPLOAD", f"3:{UPLOAD_EXTRA_S:g}")
    storage, name = f"file://{tmp_path}/runs", "deferral"
    trainer = rf.Trainer(model=small_gpt(), data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=8),
                         run=rf.RunConfig(name=name, storage=storage, steps=STEPS),
                         scaling=rf.ScalingConfig(num_workers=2),
                         checkpoint=rf.CheckpointConfig(every_steps=1, keep=2))
    result = trainer.fit(progress=False)
    assert result.status == "finished" and result.steps_completed == STEPS

    events = [json.loads(x) for x in (tmp_path / "runs" / name / "events.jsonl").read_text().splitlines()]
    deferred = [e for e in events if e["kind"] == "checkpoint_deferred"]
    committed = [e for e in events if e["kind"] == "checkpoint_committed"]
    # Saves were due every step and each slow upload outlasted many steps: they were deferred,
    # each naming the save it waited for, and the waiting save was taken later (once).
    assert deferred and all(e["behind_step"] is not None and e["behind_step"] < e["step"] for e in deferred), deferred
    taken_late = [c for c in committed if c.get("due_step") is not None]
    assert taken_late and all(c["step"] > c["due_step"] for c in taken_late), committed
    assert {c["due_step"] for c in taken_late} <= {e["step"] for e in deferred}
    # Training never waited for an upload: a save that had waited for the slow one before it
    # would have been blocked at least UPLOAD_EXTRA_S (the last save waits: it ends the run).
    slow = [c for c in committed if c["step"] >= 3 and c["reason"] != "final"]
    assert slow and all(c["blocked_s"] < UPLOAD_EXTRA_S for c in slow), [(c["step"], c["blocked_s"]) for c in slow]
    # Far fewer saves than steps, every one committed and whole; the run's last step saved.
    assert len(committed) < STEPS // 2 and committed[-1]["step"] == STEPS
    root = f"{storage}/{name}/checkpoints"
    assert mf.list_committed(root)[-1] == STEPS
    mf.verify(root, STEPS)
    metrics = [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
