"""Checkpoints through Ray workers: committed atomically, resumed at another world size
and pipeline split with the same losses and the same samples as a run that never stopped;
on local disk and on a real S3 endpoint (moto on loopback)."""

import json

import numpy as np
import pytest

import rayflex as rf
from rayflex.data.dataset import TokenDataset
from rayflex.testing.reference import single_process_losses
from rayflex.checkpoint import manifest as mf

from conftest import small_gpt

pytestmark = pytest.mark.cluster
STEPS, GB = 8, 12


def _trainer(dataset_uri, storage, name, *, workers, pp=1, max_failures=3, upload="auto"):
    return rf.Trainer(model=small_gpt(n_layers=2),
                      data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=GB, log_samples=True),
                      run=rf.RunConfig(name=name, storage=storage, steps=STEPS,
                                       optimizer=rf.OptimizerConfig(lr=1e-2, warmup_steps=2)),
                      scaling=rf.ScalingConfig(num_workers=workers),
                      parallel=rf.ParallelConfig(pp=pp),
                      checkpoint=rf.CheckpointConfig(every_steps=2, keep=2, upload=upload),
                      elastic=rf.ElasticConfig(max_failures=max_failures))


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _crash_at_step_4(dataset_uri, storage, name, monkeypatch, *, workers, pp=1, upload="auto"):
    """A run that commits step 2, then dies at step 4 (rank 1 raises)."""
    monkeypatch.setenv("RAYFLEX_FAIL_AT", "1:4")
    with pytest.raises(rf.WorkerError):
        # No retries: the run stops at the first failure, as a job without a failure budget would.
        _trainer(dataset_uri, storage, name, workers=workers, pp=pp, max_failures=0,
                 upload=upload).submit().wait(timeout_s=180)
    monkeypatch.delenv("RAYFLEX_FAIL_AT")


def _assert_resumed_like_uninterrupted(trainer, run_dir, resumed_from):
    """Losses and samples after the restore equal those of a run that never stopped."""
    result = _lines(run_dir / "events.jsonl")
    loaded = [e for e in result if e["kind"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["step"] == resumed_from
    metrics = {m["step"]: m for m in _lines(run_dir / "metrics.jsonl")}
    assert sorted(metrics) == list(range(1, STEPS + 1))
    reference = single_process_losses(trainer.spec, STEPS)
    for step in range(resumed_from + 1, STEPS + 1):
        assert metrics[step]["loss"] == pytest.approx(reference[step - 1], rel=1e-5), step
    sampler = TokenDataset(trainer.spec.data.uri).sampler(trainer.spec.data)
    samples = {s["step"]: s["indices"] for s in _lines(run_dir / "samples.jsonl")}
    for step in range(1, STEPS + 1):
        np.testing.assert_array_equal(samples[step], sampler.indices(step - 1, 0, 1))


def test_save_pp2_dp2_resume_at_pp1_dp3(two_node_cluster, dataset_uri, tmp_path, monkeypatch):
    """Resharded on load across a change of every mesh dimension: the pipeline split
    goes away and dp goes from 2 to 3 (uneven shards). A pure dp change (4 -> 3 -> 4, and
    4 -> 2 -> 4) is what the elastic tests restore from. The resumed run uploads from an
    uploader process per rank (CheckpointConfig(upload="process")) once it is up: the two
    paths write the same format."""
    storage = f"file://{tmp_path}/runs"
    root = f"{storage}/pp2/checkpoints"
    _crash_at_step_4(dataset_uri, storage, "pp2", monkeypatch, workers=4, pp=2)
    assert mf.list_committed(root) == [2], "only the step before the crash is committed"
    m = mf.read_manifest(root, 2)
    assert m.mesh == {"pp": 2, "dp": 2, "tp": 1, "dp_replicate": 1}
    trainer = _trainer(dataset_uri, storage, "pp2", workers=3, pp=1, upload="process")
    assert trainer.fit(progress=False).steps_completed == STEPS
    saved = [e for e in _lines(tmp_path / "runs" / "pp2" / "events.jsonl") if e["kind"] == "checkpoint_committed"]
    assert saved[-1]["step"] == STEPS and saved[-1]["upload"] == "process", saved
    _assert_resumed_like_uninterrupted(trainer, tmp_path / "runs" / "pp2", resumed_from=2)
    assert mf.verify(root, STEPS).world_size == 3
    # Steps 1-2 are the pp=2 x dp=2 run's: they too are the single process's losses.
    metrics = {m["step"]: m for m in _lines(tmp_path / "runs" / "pp2" / "metrics.jsonl")}
    reference = single_process_losses(trainer.spec, 2)
    assert [metrics[s]["loss"] for s in (1, 2)] == pytest.approx(reference, rel=1e-5)
    assert metrics[1]["world_size"] == 4


