"""Parallelizing a rank's model: device mesh, FSDP2 sharding, pipeline schedules, grad norm.

The mesh itself (ranks, stages, batch arithmetic) is :class:`rayflex.mesh.plan.MeshPlan`.
"""

from __future__ import annotations

import torch
from torch import nn

from rayflex.mesh.plan import MeshPlan
from rayflex.models.spec import ModelSpec, Stage, build_stage


def build_device_mesh(plan: MeshPlan, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (plan.pp, plan.dp), mesh_dim_names=("pp", "dp"))


def shard_stage(stage: Stage, dp_mesh, *, pipelined: bool) -> Stage:
    """``fully_shard`` each block, then the stage as root (torchtitan's recipe).

    With a pipeline the parameters stay gathered between forward and backward
    (``reshard_after_forward=False``): each microbatch would otherwise all-gather twice.
    """
    from torch.distributed.fsdp import fully_shard

    for i in stage.indices:
        fully_shard(stage.blocks[str(i)], mesh=dp_mesh, reshard_after_forward=not pipelined)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=not pipelined)
    return stage


def build_local_stages(spec: ModelSpec, plan: MeshPlan, rank: int, device: torch.device) -> list[tuple[int, Stage]]:
    """Build only this rank's stage(s): (stage index, module) with global block keys."""
    pp_index, _ = plan.coords(rank)
    return [(s, build_stage(spec, list(plan.stage_blocks[s]), device)) for s in plan.local_stages(pp_index)]


def build_schedule(plan: MeshPlan, stages: list[tuple[int, nn.Module]], pp_group, device: torch.device,
                   loss_fn):
    """A torch.distributed.pipelining schedule over this rank's stage(s)."""
    from torch.distributed import pipelining as pl

    pipe_stages = [pl.PipelineStage(mod, stage_index=s, num_stages=plan.num_stages, device=device,
                                    group=pp_group) for s, mod in stages]
    if plan.schedule == "gpipe":
        return pl.ScheduleGPipe(pipe_stages[0], n_microbatches=plan.microbatches, loss_fn=loss_fn)
    if plan.schedule == "1f1b":
        return pl.Schedule1F1B(pipe_stages[0], n_microbatches=plan.microbatches, loss_fn=loss_fn)
    return pl.ScheduleInterleaved1F1B(pipe_stages, n_microbatches=plan.microbatches, loss_fn=loss_fn)


def global_grad_norm(params: list[nn.Parameter], group=None) -> torch.Tensor:
    """L2 norm of all gradients of the whole model, across pp stages and FSDP shards.

    Each rank owns a disjoint shard of each parameter of its own stage(s), so the sum of
    local squared norms, all-reduced over the world, is the global squared norm.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        sq += g.detach().double().pow(2).sum().cpu()
    if dist.is_initialized():
        dist.all_reduce(sq, group=group)
    return sq.sqrt()


def clip_grads_(params: list[nn.Parameter], max_norm: float, group=None) -> float:
    norm = global_grad_norm(params, group)
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return float(norm)
