"""MeshPlan: the layout of one run attempt (pp x dp, stage split, batch arithmetic).

Torch-free: the controller plans meshes without importing torch. Rank layout (the
placement planner relies on it): ``rank = pp_index * dp + dp_index``, the row-major order
of a DeviceMesh with dims ``("pp", "dp")``. A dp group is the dp ranks of one stage; a
pipeline is the ranks sharing a dp index.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from rayflex.errors import ConfigError
from rayflex.mesh.stage_split import balanced_split

if TYPE_CHECKING:
    from rayflex.config import DataConfig, ParallelConfig
    from rayflex.models.spec import ModelSpec


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


def plan_mesh(spec: ModelSpec, parallel: ParallelConfig, data: DataConfig, world_size: int,
              *, block_costs: list[float] | None = None) -> MeshPlan:
    """Derive the mesh, stage split and microbatch arithmetic for ``world_size`` ranks.

    The global batch stays fixed whatever the world size; what changes is how many samples
    each dp rank takes and how they are cut into microbatches.
    """
    if parallel.is_auto:  # a TypeError further down otherwise
        raise ConfigError("ParallelConfig.pp", "pp='auto' must be resolved to a mesh for a world size first",
                          "pass rayflex.planning.capacity.auto.resolve_parallel(spec, world_size).parallel "
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
