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


def _ruled_fields():
    import dataclasses

    from rayflex import config
    from rayflex.field_rules import RULE

    for cls in (config.ScalingConfig, config.ParallelConfig, config.DataConfig, config.CheckpointConfig,
                config.ElasticConfig, config.OptimizerConfig, config.PrecisionConfig, config.MemoryConfig,
                config.RunConfig):
        for f in dataclasses.fields(cls):
            if RULE in f.metadata:
                yield pytest.param(cls, f.name, id=f"{cls.__name__}.{f.name}")


@pytest.mark.parametrize("cls, name", list(_ruled_fields()))
def test_every_declared_field_rule_refuses_a_wrong_value_naming_the_field_and_the_fix(cls, name):
    """A value of no type any field takes is refused by that field's rule, with its name
    and a fix — so every declared rule is really checked on construction."""
    required = {"uri": "file:///tmp/d"} if cls is rf.DataConfig else {"name": "r"} if cls is rf.RunConfig else {}
    with pytest.raises(rf.ConfigError) as info:
        cls(**{**required, name: object()})
    assert str(info.value).startswith(f"{cls.__name__}.{name}: "), str(info.value)
    assert "Fix: " in str(info.value)


@pytest.mark.parametrize("make, field, problem", [
    (lambda: rf.ScalingConfig(use_gpu="yes"), "ScalingConfig.use_gpu", "must be True or False, got 'yes'"),
    (lambda: rf.OptimizerConfig(betas=(0.9, 1.0)), "OptimizerConfig.betas", "two numbers in [0, 1)"),
    (lambda: rf.OptimizerConfig(lr=float("nan")), "OptimizerConfig.lr", "must be a number > 0, got nan"),
    (lambda: rf.ElasticConfig(resource_wait_s=True), "ElasticConfig.resource_wait_s", "got True"),
    (lambda: rf.CheckpointConfig(every_steps=2.5), "CheckpointConfig.every_steps", "integer >= 0, got 2.5"),
    (lambda: rf.ScalingConfig(min_workers=0), "ScalingConfig.min_workers", "positive integer, got 0"),
])
def test_values_of_the_right_type_but_out_of_range_are_refused(make, field, problem):
    with pytest.raises(rf.ConfigError) as info:
        make()
    assert str(info.value).startswith(f"{field}: ") and problem in str(info.value), str(info.value)
