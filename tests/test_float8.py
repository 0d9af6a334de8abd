"""``PrecisionConfig(float8=True)``: the wiring on CPU and every refusal.

Float8 matmuls need a GPU of compute capability 8.9+, so CPU tests check what decides the
GPU run: which linears become torchao's ``Float8Linear`` (every block's eligible ones, not
the output head, not dims indivisible by 16), that the swap happens before ``fully_shard``,
the config's round trip, and the clear errors — the driver's before any actor on CPU
workers or tensor parallelism or without torchao, a worker's at setup on an older GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import rayflex as rf
from rayflex.errors import ConfigError
from rayflex.models import gpt
from rayflex.models.spec import ModelSpec, build_stage

# `make venv` installs torchao beside the venv, not in it (Makefile: FLOAT8_TEST_DEPS): in
# the venv, transformers would import it with every HF model in every test's workers.
_BESIDE = Path(__file__).resolve().parents[1] / ".cache" / "float8-test"
if importlib.util.find_spec("torchao") is None and _BESIDE.is_dir():
    sys.path.append(str(_BESIDE))
pytest.importorskip("torchao.float8", reason="float8 training needs torchao: `make venv` installs it into "
                    ".cache/float8-test (or pip install torchao)")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from rayflex.worker import float8  # noqa: E402
from rayflex.worker.parallelize import shard_stage  # noqa: E402

TINY = dict(vocab_size=128, seq_len=16, d_model=32, n_layers=2, n_heads=2)
FLOAT8 = rf.PrecisionConfig(param_dtype="bf16", reduce_dtype="fp32", float8=True)


def _spec(*, use_gpu=True, tp=1, precision=FLOAT8):
    return rf.TrainSpec(model=gpt(**TINY), data=rf.DataConfig(uri="file:///nowhere", seq_len=16, global_batch=4),
                        run=rf.RunConfig(name="f8", storage="file:///tmp/rayflex-f8", steps=2),
                        scaling=rf.ScalingConfig(num_workers=2 if tp > 1 else 1, use_gpu=use_gpu),
                        parallel=rf.ParallelConfig(tp=tp), precision=precision,
                        checkpoint=rf.CheckpointConfig(resume=False))


def _record_fully_shard(monkeypatch) -> list[tuple[str, list[str]]]:
    """Replace FSDP2's ``fully_shard`` by a recorder of what each call received: the
    module's kind and the kinds of its linears at that moment (no process group needed)."""
    calls: list[tuple[str, list[str]]] = []

    def record(module, **_):
        calls.append((type(module).__name__,
                      [type(m).__name__ for m in module.modules() if isinstance(m, nn.Linear)]))
        return module

    import torch.distributed.fsdp as fsdp

    monkeypatch.setattr(fsdp, "fully_shard", record)
    return calls


# ----------------------------------------------------------------- which linears, and when
def test_every_blocks_linears_are_float8_except_the_head(monkeypatch):
    spec = gpt(**TINY)
    calls = _record_fully_shard(monkeypatch)
    stage = build_stage(spec, list(range(spec.num_blocks)), "meta")
    shard_stage(stage, None, pipelined=False, precision=FLOAT8, spec=spec)

    converted = sorted(n for n, m in stage.named_modules() if isinstance(m, Float8Linear))
    layers = [f"blocks.{i}.{name}" for i in (1, 2) for name in ("fc", "out", "proj", "qkv")]
    assert converted == layers
    assert type(stage.blocks["3"].lm) is nn.Linear  # the output head keeps full precision
    # fully_shard saw each transformer block already converted (the head block last, untouched).
    block_calls = calls[:spec.num_blocks]
    assert [kinds for _, kinds in block_calls] == [[], ["Float8Linear"] * 4, ["Float8Linear"] * 4, ["Linear"]]


def test_linears_with_a_dim_not_divisible_by_16_stay(monkeypatch):
    _record_fully_shard(monkeypatch)

    def build(i):
        return nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 40), nn.Linear(40, 32)) if i == 0 else nn.Linear(32, 8)

    spec = ModelSpec(name="odd", num_blocks=2, build_block=build, loss_fn=lambda o, t: o.mean(), vocab_size=8)
    stage = build_stage(spec, [0, 1], "meta")
    assert float8.convert_stage(stage, spec) == ["blocks.0.0"]  # 48->40 and 40->32 stay; block 1 is the head


def test_converted_weights_keep_their_names_so_checkpoints_load_either_way():
    spec = gpt(**TINY)
    plain = build_stage(spec, list(range(spec.num_blocks)))
    converted = build_stage(spec, list(range(spec.num_blocks)))
    float8.convert_stage(converted, spec)
    assert converted.state_dict().keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        assert torch.equal(converted.state_dict()[key], value)


# ----------------------------------------------------------------- the config
def test_precision_config_round_trip_and_override():
    assert FLOAT8.float8 is True and rf.PrecisionConfig().float8 is False
    assert rf.PrecisionConfig(**dataclasses.asdict(FLOAT8)) == FLOAT8
    spec = _spec(precision=rf.PrecisionConfig(param_dtype="bf16"))
    assert spec.with_overrides({"precision.float8": "True"}).precision.float8 is True
    with pytest.raises(ConfigError, match=r"PrecisionConfig\.float8: must be True or False"):
        rf.PrecisionConfig(float8="yes")


def test_cpu_workers_are_refused_before_any_actor():
    with pytest.raises(ConfigError) as err:
        _spec(use_gpu=False)
    assert err.value.field == "PrecisionConfig.float8"
    assert "use_gpu=False" in err.value.problem and "use_gpu=True" in err.value.fix
    with pytest.raises(ConfigError, match="float8 training needs GPUs"):
        rf.Trainer(model=gpt(**TINY), data=rf.DataConfig(uri="file:///nowhere", seq_len=16, global_batch=4),
                   run=rf.RunConfig(name="f8", storage="file:///tmp/rayflex-f8", steps=2), precision=FLOAT8)


def test_tensor_parallelism_is_refused():
    with pytest.raises(ConfigError, match=r"tensor parallelism \(tp=2\) is not supported"):
        _spec(tp=2)


def test_missing_torchao_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install torchao"):
        _spec()
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what an absent package looks like to import
    with pytest.raises(ConfigError, match="pip install torchao"):
        float8.torchao_float8()


# ----------------------------------------------------------------- a worker's refusal
def test_worker_refuses_a_cpu_and_a_gpu_older_than_8_9(monkeypatch):
    with pytest.raises(ConfigError, match="this rank trains on cpu"):
        float8.check_device(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match="A100-SXM4-80GB has compute capability 8.0"):
        float8.check_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    float8.check_device(torch.device("cuda", 0))  # an H100 passes


def test_worker_setup_refuses_before_joining_any_group(tmp_path):
    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.train_worker import TrainWorker

    spec = _spec(use_gpu=False, precision=rf.PrecisionConfig())
    # A spec the driver could not judge (e.g. built by another tool): the rank still refuses.
    object.__setattr__(spec, "precision", FLOAT8)
    worker = TrainWorker(0, spec, plan_mesh(spec.model, spec.parallel, spec.data, 1))
    with pytest.raises(ConfigError, match="this rank trains on cpu"):
        worker.setup("127.0.0.1", 1)  # port 1: nothing is ever contacted
    assert getattr(worker, "groups", None) is None
