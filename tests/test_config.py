"""Bad input fails on the driver, before Ray or any actor starts, naming field and fix."""

import pytest

import rayflex as rf
from rayflex.config import apply_override

from conftest import small_gpt


def _trainer(dataset_uri, storage="file:///tmp/rayflex-test", **over):
    """``storage``: only a test that submits touches it (the others fail in validation)."""
    kw = dict(model=small_gpt(), data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=8),
              run=rf.RunConfig(name="t", storage=storage, steps=3),
              scaling=rf.ScalingConfig(num_workers=4))
    kw.update(over)
    return rf.Trainer(**kw)


@pytest.mark.parametrize("make, field, fix_hint", [
    (lambda: rf.RunConfig(name="r", steps=-1), "RunConfig.steps", "integer >= 1"),
    (lambda: rf.RunConfig(name="bad name!"), "RunConfig.name", "letters"),
    (lambda: rf.RunConfig(name="r", storage="ftp://host/x"), "RunConfig.storage", "s3://"),
    (lambda: rf.DataConfig(uri="hdfs://nn/x"), "DataConfig.uri", "file://"),
    (lambda: rf.ScalingConfig(num_workers=4, min_workers=5, max_workers=3), "ScalingConfig.min_workers",
     "min_workers <= max_workers"),
    (lambda: rf.ScalingConfig(num_workers=0), "ScalingConfig.num_workers", "integer >= 1"),
    (lambda: rf.ParallelConfig(schedule="zigzag"), "ParallelConfig.schedule", "gpipe"),
    (lambda: rf.ParallelConfig(pp=4, microbatches=2), "ParallelConfig.microbatches", ">= 4"),
    (lambda: rf.ParallelConfig(schedule="interleaved", stages_per_rank=1), "ParallelConfig.stages_per_rank",
     "stages_per_rank=2"),
    (lambda: rf.CheckpointConfig(every_steps=-5), "CheckpointConfig.every_steps", "0 (off)"),
    (lambda: rf.CheckpointConfig(every_steps="often"), "CheckpointConfig.every_steps", '"auto"'),
    (lambda: rf.CheckpointConfig(every_steps="auto", mtbf_prior_s=0), "CheckpointConfig.mtbf_prior_s", "3600"),
    (lambda: rf.OptimizerConfig(lr=0), "OptimizerConfig.lr", "3e-4"),
    (lambda: rf.OptimizerConfig(implementation="apex"), "OptimizerConfig.implementation", "fused, foreach"),
    (lambda: rf.ParallelConfig(tp=0), "ParallelConfig.tp", "1: no tensor parallelism"),
    (lambda: rf.ParallelConfig(layout="manual"), "ParallelConfig.layout", "'auto'"),
    (lambda: rf.ParallelConfig(layout="auto", tp=2), "ParallelConfig.layout", "leave pp, tp and dp_shard"),
])
def test_invalid_single_config_names_field_and_fix(make, field, fix_hint):
    with pytest.raises(rf.ConfigError) as info:
        make()
    assert info.value.field == field
    assert fix_hint in str(info.value)
    assert "Fix:" in str(info.value)


def test_cross_config_errors_raise_before_ray_starts(dataset_uri):
    import ray

    assert not ray.is_initialized()
    with pytest.raises(rf.ConfigError, match=r"global_batch=10 is not divisible by the data-parallel size 4"):
        _trainer(dataset_uri, data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=10))
    with pytest.raises(rf.ConfigError, match=r"num_workers=3 is not divisible by ParallelConfig.pp=2"):
        _trainer(dataset_uri, scaling=rf.ScalingConfig(num_workers=3), parallel=rf.ParallelConfig(pp=2))
    with pytest.raises(rf.ConfigError, match=r"pipeline stages for a model of only 4 blocks"):
        _trainer(dataset_uri, parallel=rf.ParallelConfig(pp=8, microbatches=8),
                 scaling=rf.ScalingConfig(num_workers=8))
    with pytest.raises(rf.ConfigError, match=r"micro_batch=3 does not divide the per-rank batch 2"):
        _trainer(dataset_uri, data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=8, micro_batch=3))
    with pytest.raises(rf.ConfigError, match=r"steps=0 only saves the initial weights.*checkpoints are off"):
        _trainer(dataset_uri, run=rf.RunConfig(name="t", steps=0), checkpoint=rf.CheckpointConfig(resume=False))
    # 3-D layouts: tp and the model's sizes, HSDP shard groups, the planner's own choices
    with pytest.raises(rf.ConfigError, match=r"num_workers=6 is not divisible by pp x tp = 1 x 4"):
        _trainer(dataset_uri, scaling=rf.ScalingConfig(num_workers=6), parallel=rf.ParallelConfig(tp=4))
    with pytest.raises(rf.ConfigError, match=r"tp=4 does not divide the attention heads \(2\).*one of \[2\]"):
        _trainer(dataset_uri, parallel=rf.ParallelConfig(tp=4))
    with pytest.raises(rf.ConfigError, match=r"dp_shard=3 does not divide the data-parallel size 4"):
        _trainer(dataset_uri, parallel=rf.ParallelConfig(dp_shard=3))
    with pytest.raises(rf.ConfigError, match=r"'auto' is chosen by the capacity planner.*layout='auto'"):
        _trainer(dataset_uri, memory=rf.MemoryConfig(activation_checkpointing="auto"))
    assert not ray.is_initialized(), "a config error must not start Ray"


def test_missing_dataset_and_bad_storage_fail_before_actors(tmp_path, dataset_uri):
    import ray

    storage = f"file://{tmp_path}/runs"
    t = _trainer(f"file://{tmp_path}/nothing-here", storage)
    with pytest.raises(rf.ConfigError, match=r"DataConfig.uri: no Parquet shards"):
        t.submit()
    t = _trainer(dataset_uri, storage, data=rf.DataConfig(uri=dataset_uri, seq_len=64, global_batch=8))
    with pytest.raises(rf.ConfigError, match=r"seq_len=64 needs rows of 65 tokens"):
        t.submit()
    assert not ray.is_initialized()


def test_overrides_parse_and_revalidate(dataset_uri):
    t = _trainer(dataset_uri)
    t2 = t.with_overrides({"parallel.pp": "2", "run.steps": "7", "run.optimizer.lr": "1e-3"})
    assert (t2.spec.parallel.pp, t2.spec.run.steps, t2.spec.run.optimizer.lr) == (2, 7, 1e-3)
    with pytest.raises(rf.ConfigError, match="no such field"):
        t.with_overrides({"parallel.ppp": "2"})
    with pytest.raises(rf.ConfigError, match="not divisible"):
        t.with_overrides({"parallel.pp": "3"})
    assert apply_override(rf.ParallelConfig(), "schedule", "gpipe").schedule == "gpipe"
