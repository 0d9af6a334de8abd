"""The pp x dp mesh: stage split, batch arithmetic, FSDP2 sharding, pipeline schedules.

Rank layout (the placement planner relies on it): ``rank = pp_index * dp + dp_index``,
the row-major order of a DeviceMesh with dims ``("pp", "dp")``. A dp group is the dp
ranks of one stage; a pipeline is the ranks sharing a dp index.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, asdict

import torch
from torch import nn

from rayflex.config import DataConfig, ParallelConfig
from rayflex.actors.stage_split import balanced_split  # noqa: F401 - re-exported
from rayflex.errors import ConfigError
from rayflex.models.spec import ModelSpec, Stage, build_stage


@dataclass(frozen=True)
class MeshPlan:
    """Everything a worker needs to know about the layout of one run attempt."""

    world_size: int
    pp: int
    dp: int
    schedule: str
    stages_per_rank: int
    # Blocks (global indices) of each pipeline stage, stage 0 first.
    stage_blocks: tuple[tuple[int, ...], ...]
    # Per-rank samples per step (global_batch / dp) and how they are cut up.
    per_rank_batch: int
    microbatches: int
    micro_batch: int
    # Gradient-accumulation passes per step (pp == 1 only; a pipeline accumulates itself).
    accum_steps: int
    balance: str
    stage_costs: tuple[float, ...] = field(default=())

    @property
    def num_stages(self) -> int:
        return len(self.stage_blocks)

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp_index, dp_index) of a global rank."""
        return divmod(rank, self.dp)

    def local_stages(self, pp_index: int) -> list[int]:
        """Stage indices a pp rank holds: looped layout for the interleaved schedule."""
        return [pp_index + k * self.pp for k in range(self.stages_per_rank)]

    def is_last_stage_rank(self, rank: int) -> bool:
        return (self.num_stages - 1) in self.local_stages(self.coords(rank)[0])

    def to_dict(self) -> dict:
        return asdict(self)


def measured_block_costs(spec: ModelSpec, seq_len: int, micro_batch: int, repeats: int = 3) -> list[float]:
    """Forward seconds of each block on this host for one microbatch (median of repeats)."""
    x: torch.Tensor = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    costs = []
    with torch.no_grad():
        for i in range(spec.num_blocks):
            block = spec.block(i)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                y = block(x)
                times.append(time.perf_counter() - t0)
            costs.append(sorted(times)[len(times) // 2])
            x = y
    return costs


def plan_mesh(spec: ModelSpec, parallel: ParallelConfig, data: DataConfig, world_size: int,
              *, block_costs: list[float] | None = None) -> MeshPlan:
    """Derive the mesh, stage split and microbatch arithmetic for ``world_size`` ranks.

    The global batch stays fixed whatever the world size; what changes is how many samples
    each dp rank takes and how they are cut into microbatches.
    """
    if parallel.is_auto:  # a TypeError further down otherwise
        raise ConfigError("ParallelConfig.pp", "pp='auto' must be resolved to a mesh for a world size first",
                          "pass rayflex.platform.auto_parallel.resolve_parallel(spec, world_size).parallel "
                          "(and its .data)")
    pp = parallel.pp
    if world_size % pp:
        raise ConfigError("ScalingConfig.num_workers",
                          f"world size {world_size} is not divisible by pp={pp}",
                          f"use a multiple of {pp} workers")
    dp = world_size // pp
    if data.global_batch % dp:
        raise ConfigError("DataConfig.global_batch",
                          f"global_batch={data.global_batch} is not divisible by dp={dp}",
                          f"use a multiple of {dp}")
    per_rank = data.global_batch // dp
    num_stages = parallel.num_stages
    if pp == 1:
        micro = data.micro_batch or per_rank
        if per_rank % micro:
            raise ConfigError("DataConfig.micro_batch", f"micro_batch={micro} does not divide the "
                              f"per-rank batch {per_rank} at dp={dp}", f"use a divisor of {per_rank}")
        microbatches, accum = 1, per_rank // micro
    else:
        microbatches = parallel.microbatches or num_stages
        if per_rank % microbatches:
            raise ConfigError("ParallelConfig.microbatches",
                              f"{microbatches} microbatches do not divide the per-rank batch "
                              f"{per_rank} (global_batch {data.global_batch} / dp {dp})",
                              f"use a divisor of {per_rank} that is >= {pp}")
        if microbatches < pp:
            raise ConfigError("ParallelConfig.microbatches",
                              f"{microbatches} microbatches for {pp} stages", f"use at least {pp}")
        micro, accum = per_rank // microbatches, 1
    if parallel.balance == "uniform":
        costs = [1.0] * spec.num_blocks
    elif block_costs is not None:
        costs = list(block_costs)
    else:
        costs = [float(c) for c in spec.param_counts()]
    split = balanced_split(costs, num_stages)
    stage_costs = tuple(sum(costs[i] for i in blocks) for blocks in split)
    return MeshPlan(world_size=world_size, pp=pp, dp=dp, schedule=parallel.schedule,
                    stages_per_rank=parallel.stages_per_rank,
                    stage_blocks=tuple(tuple(b) for b in split), per_rank_batch=per_rank,
                    microbatches=microbatches, micro_batch=micro, accum_steps=accum,
                    balance=parallel.balance, stage_costs=stage_costs)


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
