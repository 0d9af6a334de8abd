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
from rayflex.mesh.rules import split_batch
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
    each dp rank takes and how they are cut into microbatches (``rayflex.mesh.rules``,
    which raises ConfigError for a mesh the rules reject).
    """
    if parallel.is_auto:  # a TypeError further down otherwise
        raise ConfigError("ParallelConfig.pp", "pp='auto' must be resolved to a mesh for a world size first",
                          "pass rayflex.planning.capacity.auto.resolve_parallel(spec, world_size).parallel "
                          "(and its .data)")
    split = split_batch(world_size, parallel.pipeline, data.global_batch, micro_batch=data.micro_batch,
                        num_blocks=spec.num_blocks)
    if parallel.balance == "uniform":
        costs = [1.0] * spec.num_blocks
    elif block_costs is not None:
        costs = list(block_costs)
    else:
        costs = [float(c) for c in spec.param_counts()]
    stages = balanced_split(costs, parallel.num_stages)
    stage_costs = tuple(sum(costs[i] for i in blocks) for blocks in stages)
    return MeshPlan(world_size=world_size, pp=split.pp, dp=split.dp, schedule=parallel.schedule,
                    stages_per_rank=parallel.stages_per_rank,
                    stage_blocks=tuple(tuple(b) for b in stages), per_rank_batch=split.per_rank_batch,
                    microbatches=split.microbatches, micro_batch=split.micro_batch, accum_steps=split.accum_steps,
                    balance=parallel.balance, stage_costs=stage_costs)
