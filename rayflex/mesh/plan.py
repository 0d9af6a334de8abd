"""MeshPlan: the layout of one run attempt (pp x dp x tp, stage split, batch arithmetic).

Torch-free: the controller plans meshes without importing torch. Rank layout (the
placement planner relies on it): the row-major order of a DeviceMesh with dims
:data:`MESH_DIMS` = ``("pp", "dp_replicate", "dp_shard", "tp")``, so tp is innermost (a tp
group is consecutive ranks: one node), then the FSDP shard group, then its replicas, then
the pipeline stage::

    rank = ((pp_index * dp_replicate + replica) * dp_shard + shard) * tp + tp_index

``dp_index = replica * dp_shard + shard`` numbers the data-parallel ranks (which samples a
rank reads: the tp ranks of one dp index read the same ones). With tp = dp_replicate = 1
this is the old ``rank = pp_index * dp + dp_index``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Optional

from rayflex.errors import ConfigError
from rayflex.mesh.rules import check_tp, split_batch
from rayflex.mesh.stage_split import balanced_split

if TYPE_CHECKING:
    from rayflex.config import DataConfig, MemoryConfig, ParallelConfig
    from rayflex.models.spec import ModelSpec


# The mesh dimensions, outermost first; every DeviceMesh and placement rule uses these names.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def mesh_position(shape: tuple[int, int, int, int], rank: int) -> tuple[int, int, int, int]:
    """(pp index, replica, shard, tp index) of ``rank`` in a mesh of ``shape`` (sizes of
    :data:`MESH_DIMS`): the one statement of the rank order, for the workers and the planners."""
    _, _, dp_shard, tp = shape
    rest, t = divmod(rank, tp)
    rest, s = divmod(rest, dp_shard)
    p, r = divmod(rest, shape[1])
    return p, r, s, t


def mesh_rank(shape: tuple[int, int, int, int], pp_index: int, dp_index: int, tp_index: int = 0) -> int:
    """The rank at (pp index, dp index = replica * dp_shard + shard, tp index): the inverse of
    :func:`mesh_position`."""
    _, dp_replicate, dp_shard, tp = shape
    return (pp_index * dp_replicate * dp_shard + dp_index) * tp + tp_index


@dataclass(frozen=True)
class MeshCoords:
    """Where a rank sits in the mesh."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    dp: int  # replica * dp_shard + shard: the data-parallel index


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
    # Tensor-parallel ranks per stage, and the FSDP replicas (dp = dp_replicate x dp_shard).
    tp: int = 1
    dp_replicate: int = 1
    # The capacity planner's activation checkpointing (MemoryConfig(activation_checkpointing=
    # "auto")); None: the spec's MemoryConfig decides.
    activation_checkpointing: Optional[str] = None
    ac_every: int = 2

    def __post_init__(self) -> None:
        if self.pp * self.dp * self.tp != self.world_size or self.dp % self.dp_replicate:
            raise ValueError(f"inconsistent mesh: pp {self.pp} x dp {self.dp} x tp {self.tp} for "
                             f"{self.world_size} ranks, dp_replicate {self.dp_replicate}")

    @property
    def num_stages(self) -> int:
        return len(self.stage_blocks)

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Sizes of :data:`MESH_DIMS`."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def mesh_coords(self, rank: int) -> MeshCoords:
        p, r, s, t = mesh_position(self.shape, rank)
        return MeshCoords(pp=p, dp_replicate=r, dp_shard=s, tp=t, dp=r * self.dp_shard + s)

    def rank_of(self, pp: int, dp: int, tp: int = 0) -> int:
        """The global rank at (pp index, dp index, tp index)."""
        return mesh_rank(self.shape, pp, dp, tp)

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp_index, dp_index) of a global rank."""
        c = self.mesh_coords(rank)
        return c.pp, c.dp

    def memory_config(self, memory: MemoryConfig) -> MemoryConfig:
        """``memory`` (the spec's) with this mesh's activation-checkpointing choice, if it
        carries one: what the workers apply and the planners price."""
        if self.activation_checkpointing is None:
            return memory
        return dataclasses.replace(memory, activation_checkpointing=self.activation_checkpointing,
                                   ac_every=self.ac_every)

    def describe(self) -> str:
        """``pp2 x dp3`` / ``pp2 x dp2(2x1) x tp2``: the layout in a few characters."""
        dp = f"dp{self.dp}" if self.dp_replicate == 1 else f"dp{self.dp}({self.dp_replicate}x{self.dp_shard} hsdp)"
        return " x ".join([f"pp{self.pp}", dp] + ([f"tp{self.tp}"] if self.tp > 1 else []))

    def local_stages(self, pp_index: int) -> list[int]:
        """Stage indices a pp rank holds: looped layout for the interleaved schedule."""
        return [pp_index + k * self.pp for k in range(self.stages_per_rank)]

    def to_dict(self) -> dict:
        return asdict(self)


def plan_mesh(spec: ModelSpec, parallel: ParallelConfig, data: DataConfig, world_size: int,
              *, block_costs: list[float] | None = None, memory: Optional[MemoryConfig] = None) -> MeshPlan:
    """Derive the mesh, stage split and microbatch arithmetic for ``world_size`` ranks.

    Tensor parallelism needs a model that says how its blocks split: ConfigError unless
    ``spec`` has a TP plan that divides evenly over ``parallel.tp`` ranks. ``memory``: the
    capacity planner's resolved MemoryConfig (``ResolvedParallel.memory``), recorded as the
    mesh's activation-checkpointing choice (None: the spec's MemoryConfig applies as is).

    The global batch stays fixed whatever the world size; what changes is how many samples
    each dp rank takes and how they are cut into microbatches (``rayflex.mesh.rules``,
    which raises ConfigError for a mesh the rules reject).
    """
    if parallel.is_auto:  # a TypeError further down otherwise
        raise ConfigError("ParallelConfig.pp", "pp='auto' must be resolved to a mesh for a world size first",
                          "pass rayflex.planning.capacity.auto.resolve_parallel(spec, world_size).parallel "
                          "(and its .data)")
    check_tp(spec.metadata, parallel.tp, model=spec.name)
    split = split_batch(world_size, parallel.mesh_layout, data.global_batch, micro_batch=data.micro_batch,
                        num_blocks=spec.num_blocks)
    if parallel.balance == "uniform":
        costs = [1.0] * spec.num_blocks
    elif block_costs is not None:
        costs = list(block_costs)
    else:
        costs = [float(c) for c in spec.param_counts()]
    stages = balanced_split(costs, parallel.num_stages)
    stage_costs = tuple(sum(costs[i] for i in blocks) for blocks in stages)
    return MeshPlan(world_size=world_size, pp=split.pp, dp=split.dp, tp=split.tp,
                    dp_replicate=split.dp_replicate, schedule=parallel.schedule,
                    stages_per_rank=parallel.stages_per_rank,
                    stage_blocks=tuple(tuple(b) for b in stages), per_rank_batch=split.per_rank_batch,
                    microbatches=split.microbatches, micro_batch=split.micro_batch, accum_steps=split.accum_steps,
                    balance=parallel.balance, stage_costs=stage_costs,
                    activation_checkpointing=memory.activation_checkpointing if memory is not None else None,
                    ac_every=memory.ac_every if memory is not None else 2)
