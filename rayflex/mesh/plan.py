"""MeshPlan: the one description of a mesh (pp x dp x tp, HSDP, stage split, batch arithmetic).

Config validation, the placement planners, the capacity model, the controller and the
workers all speak it: the planners read its degrees and rank order, the capacity search
prices candidate MeshPlans, ``plan_mesh`` makes the one a run attempt trains on, and the
workers build their DeviceMesh from its ``shape``. Its validity rules are
:mod:`rayflex.mesh.rules`; the user's request is ``ParallelConfig``.

Torch-free: the controller plans meshes without importing torch. Rank layout (the
placement planner relies on it): the row-major order of a DeviceMesh with dims
:data:`MESH_DIMS` = ``("pp", "dp_replicate", "dp_shard", "tp")``, so tp is innermost (a tp
group is consecutive ranks: one node), then the FSDP shard group, then its replicas, then
the pipeline stage::

    rank = ((pp_index * dp_replicate + replica) * dp_shard + shard) * tp + tp_index

``dp_index = replica * dp_shard + shard`` numbers the data-parallel ranks (which samples a
rank reads: the tp ranks of one dp index read the same ones). With tp = dp_replicate = 1
this is ``rank = pp_index * dp + dp_index``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, asdict, dataclass, field
from typing import TYPE_CHECKING, Optional

from rayflex.errors import ConfigError
from rayflex.mesh.rules import check_tp, split_batch
from rayflex.mesh.stage_split import balanced_split

if TYPE_CHECKING:
    from rayflex.config import CommConfig, DataConfig, MemoryConfig, ParallelConfig, PrecisionConfig
    from rayflex.models.spec import ModelSpec


# The mesh dimensions, outermost first; every DeviceMesh and placement rule uses these names.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
# What a pp == 1 mesh's schedule field holds when nothing pipelines.
NO_PIPELINE = "none"


def mesh_position(shape: tuple[int, int, int, int], rank: int) -> tuple[int, int, int, int]:
    """(pp index, replica, shard, tp index) of ``rank`` in a mesh of ``shape`` (sizes of
    :data:`MESH_DIMS`): the one statement of the rank order."""
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
    """A mesh: its degrees and rank order, and (once cut for a batch and a model) its stage
    split and batch arithmetic.

    ``MeshPlan(pp, dp, tp, dp_replicate)`` is a mesh of degrees alone, what the placement
    planners place; ``plan_mesh`` and the capacity search fill in the rest. ``dp`` is
    ``dp_replicate x dp_shard``: FSDP shards over ``dp_shard`` ranks and replicates over
    ``dp_replicate`` (HSDP; 1 is plain FSDP).
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    dp_replicate: int = 1
    _: KW_ONLY
    schedule: str = "1f1b"  # NO_PIPELINE | gpipe | 1f1b | interleaved
    stages_per_rank: int = 1
    # Blocks (global indices) of each pipeline stage, stage 0 first (empty: not cut yet).
    stage_blocks: tuple[tuple[int, ...], ...] = ()
    # Per-rank samples per step (global_batch / dp) and how they are cut up (0: not cut yet).
    per_rank_batch: int = 0
    microbatches: int = 1  # pipeline microbatches per step (1 when pp == 1)
    micro_batch: int = 0  # samples per forward pass
    # Gradient-accumulation passes per step (pp == 1 only; a pipeline accumulates itself).
    accum_steps: int = 1
    balance: str = "params"
    stage_costs: tuple[float, ...] = field(default=())
    # The capacity planner's activation checkpointing (MemoryConfig(activation_checkpointing=
    # "auto")); None: the spec's MemoryConfig decides.
    activation_checkpointing: Optional[str] = None
    ac_every: int = 2
    # The capacity planner's way across the replicate tier (CommConfig(replicate="auto")):
    # (field, value) pairs of CommConfig, and "reduce_dtype" of PrecisionConfig; (): the spec's.
    replicate_choice: tuple = ()

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "dp_replicate"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"MeshPlan.{name}", f"must be an integer >= 1, got {v!r}",
                                  "use pp=1 for no pipeline, dp=1 for no data parallelism, tp=1 for no "
                                  "tensor parallelism and dp_replicate=1 for plain FSDP")
        if self.dp % self.dp_replicate:
            raise ConfigError("MeshPlan.dp_replicate", f"dp_replicate={self.dp_replicate} does not divide "
                              f"dp={self.dp}", "use a divisor of dp (dp_shard = dp / dp_replicate)")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def dp_shard(self) -> int:
        """Ranks a stage's state is sharded over (dp without HSDP)."""
        return self.dp // self.dp_replicate

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Sizes of :data:`MESH_DIMS`."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def units(self) -> "MeshPlan":
        """The pp x dp mesh of tp groups the planner places (one unit = ``tp`` slots of a node)."""
        return MeshPlan(self.pp, self.dp)

    def mesh_coords(self, rank: int) -> MeshCoords:
        p, r, s, t = mesh_position(self.shape, rank)
        return MeshCoords(pp=p, dp_replicate=r, dp_shard=s, tp=t, dp=r * self.dp_shard + s)

    def rank_of(self, pp: int, dp: int, tp: int = 0) -> int:
        """The global rank at (pp index, dp index, tp index)."""
        return mesh_rank(self.shape, pp, dp, tp)

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp_index, dp_index) of a global rank."""
        p, r, s, _ = mesh_position(self.shape, rank)
        return p, r * self.dp_shard + s

    def memory_config(self, memory: MemoryConfig) -> MemoryConfig:
        """``memory`` (the spec's) with this mesh's activation-checkpointing choice, if it
        carries one: what the workers apply and the planners price."""
        if self.activation_checkpointing is None:
            return memory
        return dataclasses.replace(memory, activation_checkpointing=self.activation_checkpointing,
                                   ac_every=self.ac_every)

    def comm_config(self, comm: CommConfig) -> CommConfig:
        """``comm`` (the spec's) with this mesh's replicate-tier choice, if it carries one."""
        fields = {k: v for k, v in self.replicate_choice if k != "reduce_dtype"}
        return dataclasses.replace(comm, **fields) if fields else comm

    def precision_config(self, precision: PrecisionConfig) -> PrecisionConfig:
        """``precision`` (the spec's) with the reduce dtype the replicate-tier choice asks for."""
        dtype = dict(self.replicate_choice).get("reduce_dtype")
        return precision if dtype is None else dataclasses.replace(precision, reduce_dtype=dtype)

    def describe(self) -> str:
        """``pp=2 x dp=4`` / ``pp=2 x dp=4 (2x2 hsdp) x tp=8``: the layout in a few characters."""
        dp = f"dp={self.dp}" + (f" ({self.dp_replicate}x{self.dp_shard} hsdp)" if self.dp_replicate > 1 else "")
        return " x ".join([f"pp={self.pp}", dp] + ([f"tp={self.tp}"] if self.tp > 1 else []))

    def local_stages(self, pp_index: int) -> list[int]:
        """Stage indices a pp rank holds: looped layout for the interleaved schedule."""
        return [pp_index + k * self.pp for k in range(self.stages_per_rank)]

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, **asdict(self)}


def plan_mesh(spec: ModelSpec, parallel: ParallelConfig, data: DataConfig, world_size: int,
              *, block_costs: list[float] | None = None, memory: Optional[MemoryConfig] = None,
              replicate_choice: tuple = ()) -> MeshPlan:
    """Derive the mesh, stage split and microbatch arithmetic for ``world_size`` ranks.

    Tensor parallelism needs a model that says how its blocks split: ConfigError unless
    ``spec`` has a TP plan that divides evenly over ``parallel.tp`` ranks. ``memory``: the
    capacity planner's resolved MemoryConfig (``ResolvedParallel.memory``), recorded as the
    mesh's activation-checkpointing choice (None: the spec's MemoryConfig applies as is).
    ``replicate_choice``: the planner's way across the replicate tier
    (``ResolvedParallel.replicate_choice``), recorded likewise.

    The global batch stays fixed whatever the world size; what changes is how many samples
    each dp rank takes and how they are cut into microbatches (``rayflex.mesh.rules``,
    which raises ConfigError for a mesh the rules reject).
    """
    if parallel.is_auto:  # a TypeError further down otherwise
        raise ConfigError("ParallelConfig.pp", "pp='auto' must be resolved to a mesh for a world size first",
                          "pass rayflex.planning.capacity.auto.resolve_parallel(spec, world_size).parallel "
                          "(and its .data)")
    check_tp(spec.metadata, parallel.tp, model=spec.name)
    split = split_batch(world_size, data.global_batch, micro_batch=data.micro_batch, num_blocks=spec.num_blocks,
                        **parallel.mesh_request())
    dp = world_size // (parallel.pp * parallel.tp)
    if parallel.balance == "uniform":
        costs = [1.0] * spec.num_blocks
    elif block_costs is not None:
        costs = list(block_costs)
    else:
        costs = [float(c) for c in spec.param_counts()]
    stages = balanced_split(costs, parallel.num_stages)
    stage_costs = tuple(sum(costs[i] for i in blocks) for blocks in stages)
    return MeshPlan(parallel.pp, dp, parallel.tp, dp // (parallel.dp_shard or dp), schedule=parallel.schedule,
                    stages_per_rank=parallel.stages_per_rank,
                    stage_blocks=tuple(tuple(b) for b in stages), per_rank_batch=split.per_rank_batch,
                    microbatches=split.microbatches, micro_batch=split.micro_batch, accum_steps=split.accum_steps,
                    balance=parallel.balance, stage_costs=stage_costs,
                    activation_checkpointing=memory.activation_checkpointing if memory is not None else None,
                    ac_every=memory.ac_every if memory is not None else 2,
                    replicate_choice=tuple(replicate_choice))
