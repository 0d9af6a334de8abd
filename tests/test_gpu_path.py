"""The GPU path's process groups, proven on CPU: no host tensor goes to a device-only group.

On GPU the default group is NCCL, which serves CUDA tensors only; the step's host scalars
(the control all-reduce, the grad norm) must go to the gloo control group. Here the GPU
layout is built exactly as the worker builds it, with gloo registered for CUDA only
standing in for NCCL (``cuda:gloo``): it refuses a CPU tensor just as NCCL does. The
worker's own per-step code then runs on it under a :class:`CollectiveAudit`. The CPU
layout is checked end to end: a 2-rank worker run under the audit trains what the
single-process reference trains.
"""

from __future__ import annotations

import math

import pytest

from rayflex.worker.process_groups import process_group_layout

from conftest import SEQ_LEN, small_gpt
from spawn_ranks import run_ranks

TIMEOUT_S = 60
CLIP = 0.5


def _spec(data_uri: str, storage: str, *, steps: int = 3, every: int = 0, clip=CLIP):
    import rayflex as rf

    return rf.TrainSpec(model=small_gpt(), data=rf.DataConfig(uri=data_uri, seq_len=SEQ_LEN, global_batch=4),
                        run=rf.RunConfig(name="gpu-path", storage=storage, steps=steps,
                                         optimizer=rf.OptimizerConfig(lr=1e-2, grad_clip=clip)),
                        scaling=rf.ScalingConfig(num_workers=2),
                        checkpoint=rf.CheckpointConfig(every_steps=every, resume=False))


def _run_ranks(target, world: int, *args) -> dict:
    return run_ranks(target, world, *args, timeout_s=TIMEOUT_S)


# ----------------------------------------------------------------- the layout itself
def test_the_gpu_layout_has_a_host_control_group_and_the_cpu_layout_needs_none():
    cpu = process_group_layout("cpu")
    assert (cpu.default_backend, cpu.control_backend, cpu.checkpoint_backend) == ("gloo", None, "gloo")
    assert cpu.default_serves_host and cpu.default_is_gloo

    gpu = process_group_layout("cuda")
    assert (gpu.default_backend, gpu.control_backend, gpu.checkpoint_backend) == ("nccl", "gloo", "gloo")
    assert not gpu.default_serves_host and not gpu.default_is_gloo

    stand_in = process_group_layout("cuda", device_backend="gloo")
    assert stand_in.default_backend == "cuda:gloo"  # gloo for CUDA tensors only, as NCCL
    assert (stand_in.control_backend, stand_in.checkpoint_backend) == (gpu.control_backend, gpu.checkpoint_backend)
    assert not stand_in.default_serves_host

    with pytest.raises(ValueError, match="no collective backend"):
        process_group_layout("xpu")
    with pytest.raises(ValueError, match="cpu uses the gloo backend"):
        process_group_layout("cpu", device_backend="nccl")


# ----------------------------------------------------------------- the GPU layout, gloo standing in
def _gpu_layout_step(rank: int, world: int, port: int, data_uri: str, storage: str) -> dict:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.process_groups import CollectiveAudit, CollectiveDeviceError, open_process_groups
    from rayflex.worker.train_worker import TrainWorker

    spec = _spec(data_uri, storage)
    worker = TrainWorker(rank, spec, plan_mesh(spec.model, spec.parallel, spec.data, world))
    layout = process_group_layout("cuda", device_backend="gloo")
    worker.groups = open_process_groups(layout, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                        world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    worker.groups.register_sockets(rank, world)
    out: dict = {"gloo_connections": len(worker.groups.sockets.connections())}

    # The stand-in refuses a host tensor on the default group exactly as NCCL does...
    try:
        dist.all_reduce(torch.ones(1))
        out["raw_refusal"] = None
    except RuntimeError as e:
        out["raw_refusal"] = str(e)
    # ... and the audit names the call before torch gets to it.
    with CollectiveAudit() as audit:
        try:
            dist.all_reduce(torch.ones(1))
            out["audit_refusal"] = None
        except CollectiveDeviceError as e:
            out["audit_refusal"] = str(e)
    assert not audit.calls

    # Rank r holds gradient shards of value r + 1 (3 and 5 elements): the squared global
    # norm over the two ranks is 8 * 1 + 8 * 4 = 40.
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(5))]
    for p in params:
        p.grad = torch.full_like(p, float(rank + 1))
    worker.params = params
    if rank == 0:
        worker.request_stop("test")
    else:
        worker.request_checkpoint("test")
    with CollectiveAudit() as audit:
        norm = worker._clip_grads()
        agreed = worker._agree(loss_sum=float(rank + 1))
    out.update(norm=norm, clipped_grads=[p.grad.tolist() for p in params], loss=agreed.loss, stop=agreed.stop,
               checkpoint=agreed.checkpoint, calls=[(c.op, c.backend, c.devices) for c in audit.calls],
               on_control=[c.group is worker.groups.host for c in audit.calls])
    dist.destroy_process_group()
    return out


@pytest.mark.multiproc
def test_the_step_sends_no_host_tensor_to_the_device_group(dataset_uri, tmp_path):
    got = _run_ranks(_gpu_layout_step, 2, dataset_uri, f"file://{tmp_path}/runs")
    for rank, out in got.items():
        assert "No backend type associated with device type cpu" in out["raw_refusal"], out
        assert "all_reduce was handed a cpu tensor" in out["audit_refusal"], out
        # The control and checkpoint groups are gloo: their connections are the abort's.
        assert out["gloo_connections"] >= 2, out
        expected = math.sqrt(40.0)
        assert out["norm"] == pytest.approx(expected, rel=1e-12)
        scale = CLIP / (expected + 1e-6)
        assert out["clipped_grads"] == [pytest.approx([(rank + 1) * scale] * n, rel=1e-6) for n in (3, 5)]
        # Loss: (1 + 2) / dp; rank 0 asked to stop, rank 1 to checkpoint: both agree on both.
        assert (out["loss"], out["stop"], out["checkpoint"]) == (1.5, True, True)
        # Exactly the grad-norm and control reduces, both host tensors on the control group.
        assert [op for op, _, _ in out["calls"]] == ["all_reduce", "all_reduce"], out["calls"]
        assert all(devices == ("cpu",) and backend.startswith("cpu:gloo") for _, backend, devices in out["calls"])
        assert all(out["on_control"]), out


# ----------------------------------------------------------------- the CPU layout, end to end
def _cpu_worker_run(rank: int, world: int, port: int, data_uri: str, storage: str) -> dict:
    from rayflex.constants import set_node_ip
    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.process_groups import CollectiveAudit
    from rayflex.worker.train_worker import TrainWorker

    set_node_ip("127.0.0.1")
    spec = _spec(data_uri, storage, steps=3, every=2)
    worker = TrainWorker(rank, spec, plan_mesh(spec.model, spec.parallel, spec.data, world))
    with CollectiveAudit() as audit:  # raises in the worker on the first misplaced tensor
        worker.setup("127.0.0.1", port, restore=False)
        worker.start(3)
        finished = worker.join(TIMEOUT_S - 10)
        status = worker.poll()
        worker.release(10, 0)
    return {"finished": finished, "state": str(status.state), "step": status.step, "error": status.error,
            "losses": [r.loss for r in status.records],
            "committed": sorted(c["step"] for c in status.checkpoints if c.get("committed")),
            "ops": sorted({c.op for c in audit.calls}),
            "devices": sorted({d for c in audit.calls for d in c.devices})}


@pytest.mark.multiproc
@pytest.mark.slow  # the CPU path's losses are also checked by tests/test_core_cluster.py
def test_the_cpu_path_is_unchanged_and_passes_the_audit(dataset_uri, tmp_path):
    from rayflex.testing.reference import single_process_losses

    storage = f"file://{tmp_path}/runs"
    got = _run_ranks(_cpu_worker_run, 2, dataset_uri, storage)
    reference = single_process_losses(_spec(dataset_uri, storage), 3)
    for rank, out in got.items():
        assert out["finished"] and out["error"] is None, out
        assert out["step"] == 3 and out["committed"] == [2, 3], out
        assert out["losses"] == pytest.approx(reference, rel=1e-5), (rank, out["losses"], reference)
        # FSDP's all-gathers and reduce-scatters (their names vary with the torch version),
        # the control reduce and DCP's object collectives all passed the audit.
        ops = out["ops"]
        assert "all_reduce" in ops and "broadcast" in ops, ops
        assert any(op.startswith("all_gather") for op in ops) and any(op.startswith("reduce_scatter") for op in ops), ops
        assert out["devices"] == ["cpu"]
