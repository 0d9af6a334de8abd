"""bf16 mixed precision, activation checkpointing and torch.compile: what a run does with them.

Most tests run one real TrainWorker in this process (a world of one rank on gloo): the
same setup, sharding and step loop as a run, in about a second. The multiproc test runs
two ranks (a pipeline, then FSDP over two shards) through a checkpoint that crosses the
settings.
"""

from __future__ import annotations

import pytest
import torch

import rayflex as rf
from rayflex.mesh.plan import plan_mesh
from rayflex.mesh.plan import MeshPlan
from rayflex.planning.capacity.memory import Precision, Runtime, describe_model, estimate_memory
from rayflex.worker.train_worker import TrainWorker

from conftest import SEQ_LEN, small_gpt

FULL = rf.MemoryConfig(activation_checkpointing="full")
BF16 = rf.PrecisionConfig(param_dtype="bf16", reduce_dtype="fp32")


def make_spec(dataset_uri, storage, *, steps=3, n_layers=2, global_batch=8, precision=None, memory=None,
              checkpoint=None, num_workers=1, parallel=None, lr=3e-3):
    return rf.TrainSpec(model=small_gpt(n_layers), data=rf.DataConfig(uri=dataset_uri, seq_len=SEQ_LEN,
                                                                      global_batch=global_batch),
                        run=rf.RunConfig(name="pm", storage=f"file://{storage}", steps=steps,
                                         optimizer=rf.OptimizerConfig(lr=lr, warmup_steps=2)),
                        scaling=rf.ScalingConfig(num_workers=num_workers), parallel=parallel or rf.ParallelConfig(),
                        checkpoint=checkpoint or rf.CheckpointConfig(resume=False),
                        precision=precision or rf.PrecisionConfig(), memory=memory or rf.MemoryConfig())


class OneRank:
    """A one-rank run in this process; ``records`` are its StepRecords."""

    def __init__(self, spec, end_step=None, inspect=None):
        plan = plan_mesh(spec.model, spec.parallel, spec.data, 1)
        worker = TrainWorker(0, spec, plan)
        try:
            self.setup = worker.setup("127.0.0.1", worker.node_info()["port"])
            worker.start(end_step or spec.run.steps)
            assert worker.join(120), "training did not finish in 120 s"
            status = worker.poll()
            assert status.error is None, status.error
            self.records = status.records
            self.inspected = inspect(worker) if inspect else None
        finally:
            worker.release(timeout_s=10, checkpoint_grace_s=0)

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]


def _state_of(worker):
    """Dtypes of the parameters and optimizer states, and the checkpoint's tensor keys."""
    module = worker.stages[0][1]
    opt_states = [v for o in worker.optimizers for s in o.state.values() for v in s.values()
                  if torch.is_tensor(v) and v.dim() > 0]
    state = worker._stateful().tensor_state()
    return {"param_dtypes": {p.dtype for p in module.parameters()},
            "opt_dtypes": {v.dtype for v in opt_states},
            "model_keys": sorted(state["model"]), "optim_keys": sorted(state["optim"])}


# ------------------------------------------------------------------------------ training
def test_full_checkpointing_reproduces_the_fp32_losses(dataset_uri, tmp_path):
    plain = OneRank(make_spec(dataset_uri, tmp_path)).losses
    for memory in (FULL, rf.MemoryConfig(activation_checkpointing="every_k", ac_every=2)):
        recomputed = OneRank(make_spec(dataset_uri, tmp_path, memory=memory)).losses
        assert recomputed == pytest.approx(plain, abs=1e-6, rel=0), memory


def test_bf16_params_train_like_fp32_with_fp32_master_weights(dataset_uri, tmp_path):
    steps = 20
    fp32 = OneRank(make_spec(dataset_uri, tmp_path, steps=steps, global_batch=16, lr=1e-2))
    bf16 = OneRank(make_spec(dataset_uri, tmp_path, steps=steps, global_batch=16, lr=1e-2, precision=BF16),
                   inspect=_state_of)
    print("fp32", fp32.losses, "\nbf16", bf16.losses)
    assert fp32.losses[-1] < 0.85 * fp32.losses[0]  # it learns, so "close" means something
    assert bf16.losses != fp32.losses  # the forward really ran in bf16
    assert abs(bf16.losses[-1] - fp32.losses[-1]) <= 0.03 * fp32.losses[-1]
    # the optimizer updates fp32 master shards with fp32 states
    assert bf16.inspected["param_dtypes"] == {torch.float32}
    assert bf16.inspected["opt_dtypes"] == {torch.float32}
    # bf16 activations: about half the bytes kept for backward
    assert max(r.activation_peak_bytes for r in bf16.records) < 0.6 * max(r.activation_peak_bytes
                                                                            for r in fp32.records)


@pytest.mark.slow  # dynamo compile time; make test-slow
def test_compiled_blocks_match_eager_losses(dataset_uri, tmp_path):
    eager = OneRank(make_spec(dataset_uri, tmp_path)).losses
    for memory in (rf.MemoryConfig(compile=True, compile_backend="aot_eager"),
                   rf.MemoryConfig(compile=True, compile_backend="aot_eager", activation_checkpointing="full")):
        compiled = OneRank(make_spec(dataset_uri, tmp_path, memory=memory)).losses
        assert compiled == pytest.approx(eager, abs=1e-5, rel=0), memory


# ------------------------------------------------------------------------------ checkpoints
def test_checkpoint_keys_do_not_depend_on_recomputation_or_compile(dataset_uri, tmp_path):
    plain = OneRank(make_spec(dataset_uri, tmp_path, steps=1), inspect=_state_of).inspected
    other = OneRank(make_spec(dataset_uri, tmp_path, steps=1, precision=BF16,
                              memory=rf.MemoryConfig(activation_checkpointing="full", compile=True,
                                                     compile_backend="aot_eager")),
                    inspect=_state_of).inspected
    assert other["model_keys"] == plain["model_keys"]
    assert other["optim_keys"] == plain["optim_keys"]
    assert not [k for k in plain["model_keys"] if "_checkpoint_wrapped_module" in k or "_orig_mod" in k]
    assert "blocks.1.qkv.weight" in plain["model_keys"]


def test_checkpoint_saved_with_recomputation_resumes_without_it(dataset_uri, tmp_path):
    steps = 4
    ckpt = rf.CheckpointConfig(every_steps=2, resume=True, async_save=False, uri=f"file://{tmp_path}/ckpt")
    reference = OneRank(make_spec(dataset_uri, tmp_path / "ref", steps=steps)).losses
    first = OneRank(make_spec(dataset_uri, tmp_path, steps=steps, memory=FULL, checkpoint=ckpt), end_step=2)
    second = OneRank(make_spec(dataset_uri, tmp_path, steps=steps, checkpoint=ckpt))
    assert second.setup["restored"]["step"] == 2
    assert first.losses + second.losses == pytest.approx(reference, abs=1e-6, rel=0)


# ------------------------------------------------------------------------------ memory model
def test_full_checkpointing_cuts_the_measured_activation_peak_as_modeled(dataset_uri, tmp_path):
    def measured_and_modeled(memory, precision):
        spec = make_spec(dataset_uri, tmp_path, n_layers=4, memory=memory, precision=precision)
        measured = max(r.activation_peak_bytes for r in OneRank(spec).records)
        model = describe_model(spec.model, SEQ_LEN).for_run(precision, memory)
        plan = plan_mesh(spec.model, spec.parallel, spec.data, 1)
        modeled = estimate_memory(model, plan, Runtime.cpu()).ranks[0]
        return measured, modeled

    for precision in (rf.PrecisionConfig(), BF16):
        base, base_model = measured_and_modeled(rf.MemoryConfig(), precision)
        full, full_model = measured_and_modeled(FULL, precision)
        assert full <= 0.6 * base, (precision, full, base)
        assert full_model.activations == pytest.approx(full, rel=0.15)
        assert base_model.activations == pytest.approx(base, rel=0.15)
        # the recompute peak: one block's activations again, during its backward
        assert full_model.workspace > base_model.workspace


def test_planner_keeps_todays_numbers_for_the_default_configs():
    model = describe_model(small_gpt(4), SEQ_LEN)
    lay = MeshPlan(2, 1, schedule="1f1b", microbatches=4, micro_batch=2)
    assert Precision.from_config(rf.PrecisionConfig()) == Precision()
    assert Precision.from_config(BF16) == Precision.named("bf16-master")
    bf16_bf16 = Precision.from_config(rf.PrecisionConfig(param_dtype="bf16", reduce_dtype="bf16"))
    assert (bf16_bf16.param_bytes, bf16_bf16.sharded_bytes, bf16_bf16.accum_grad_bytes) == (2, 4, 2)
    default = model.for_run(rf.PrecisionConfig(), rf.MemoryConfig())
    assert estimate_memory(default, lay) == estimate_memory(model, lay)
    every = model.for_run(memory_config=rf.MemoryConfig(activation_checkpointing="every_k", ac_every=2))
    assert [b.recompute for b in every.blocks] == [False, True, False, True, False, True]
    full = model.for_run(memory_config=FULL)
    assert estimate_memory(full, lay).peak_bytes < estimate_memory(every, lay).peak_bytes \
        < estimate_memory(model, lay).peak_bytes


# ------------------------------------------------------------------------------ config
@pytest.mark.parametrize("make, field", [
    (lambda: rf.PrecisionConfig(param_dtype="fp16"), "PrecisionConfig.param_dtype"),
    (lambda: rf.PrecisionConfig(reduce_dtype="float32"), "PrecisionConfig.reduce_dtype"),
    (lambda: rf.MemoryConfig(activation_checkpointing="selective"), "MemoryConfig.activation_checkpointing"),
    (lambda: rf.MemoryConfig(activation_checkpointing="every_k", ac_every=0), "MemoryConfig.ac_every"),
    (lambda: rf.MemoryConfig(compile="yes"), "MemoryConfig.compile"),
    (lambda: rf.MemoryConfig(compile=True, compile_backend=""), "MemoryConfig.compile_backend"),
])
def test_bad_values_fail_with_the_field_and_a_fix(make, field):
    with pytest.raises(rf.ConfigError) as info:
        make()
    assert info.value.field == field
    assert info.value.fix.startswith("use")


def test_configs_reach_the_spec_from_the_trainer_and_overrides(dataset_uri):
    trainer = rf.Trainer(model=small_gpt(), data=rf.DataConfig(uri=dataset_uri, seq_len=SEQ_LEN),
                         run=rf.RunConfig(name="pm"), scaling=rf.ScalingConfig(num_workers=1),
                         precision=BF16, memory=FULL)
    assert (trainer.spec.precision, trainer.spec.memory) == (BF16, FULL)
    default = rf.TrainSpec(model=small_gpt(), data=rf.DataConfig(uri=dataset_uri), run=rf.RunConfig(name="pm"))
    assert (default.precision, default.memory) == (rf.PrecisionConfig(), rf.MemoryConfig())
    spec = default.with_overrides({"precision.param_dtype": "bf16", "memory.activation_checkpointing": "every_k",
                                   "memory.ac_every": "3", "memory.compile": "True",
                                   "memory.compile_backend": "aot_eager"})
    assert spec.precision == BF16
    assert spec.memory == rf.MemoryConfig(activation_checkpointing="every_k", ac_every=3, compile=True,
                                          compile_backend="aot_eager")
    with pytest.raises(rf.ConfigError, match="PrecisionConfig.param_dtype"):
        default.with_overrides({"precision.param_dtype": "fp8"})
    with pytest.raises(rf.ConfigError, match="TrainSpec.memory|Trainer.memory"):
        rf.TrainSpec(model=small_gpt(), data=rf.DataConfig(uri=dataset_uri), run=rf.RunConfig(name="pm"),
                     memory="full")


# ------------------------------------------------------------------------------ two ranks
@pytest.mark.multiproc
@pytest.mark.slow  # two processes across a reconfiguring checkpoint; make test-slow
def test_pipeline_and_fsdp_ranks_train_across_a_checkpoint_that_changes_the_settings(dataset_uri, tmp_path):
    """pp=2 with bf16 + full recomputation saves; FSDP over two shards with bf16 reduction
    and every-other-block recomputation resumes from it (gloo, plain processes)."""
    from rayflex.testing.chaos.local_workers import LocalWorkerPool

    ckpt = rf.CheckpointConfig(every_steps=2, keep=3)
    first = make_spec(dataset_uri, tmp_path, steps=4, n_layers=2, num_workers=2, checkpoint=ckpt, precision=BF16,
                      memory=FULL, parallel=rf.ParallelConfig(pp=2))
    second = make_spec(dataset_uri, tmp_path, steps=4, n_layers=2, num_workers=2, checkpoint=ckpt,
                       precision=rf.PrecisionConfig(param_dtype="bf16", reduce_dtype="bf16"),
                       memory=rf.MemoryConfig(activation_checkpointing="every_k", ac_every=2))
    with LocalWorkerPool(2, timeout_s=120) as pool:
        for spec, end, restored in ((first, 2, 0), (second, 4, 2)):
            got = pool.attempt([0, 1], spec, end)
            assert got["restored_step"] == restored, got
            for r in got["runs"]:
                assert r.get("state") == "done" and r["step"] == end, r
                assert not r["checkpoint_errors"], r["checkpoint_errors"][0][-600:]
