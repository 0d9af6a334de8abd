"""``ParallelConfig(layout="auto")``: turn the capacity planner's choice into concrete configs.

The controller calls :func:`resolve_parallel` on every placement (launch and each elastic
restart), then ``plan_mesh`` on the result; ``Trainer.plan()`` and the driver's preflight
call it too. A spec with an integer ``pp`` passes through untouched, without importing the
planner.

Elastic rule for tensor parallelism: **tp is fixed by the node shape, not by the world
size.** The launch size (``ScalingConfig.num_workers``) picks the tp; every other size keeps
it as long as some mesh with that tp fits, and only the pipeline depth, dp and the shard
groups change. A restart therefore never re-splits every block (a tp change reshards every
parameter, and a node-local tp group is the right one whatever the number of nodes). Only
when no mesh with the launch tp fits does the planner search every tp, and the explanation
says so. The launch tp is found by planning the launch size on the same cluster; a caller
whose cluster can no longer hold the launch size (a live topology after losing nodes)
passes ``launch_tp`` (the controller: its launch mesh's tp), without which that size is
planned freely.

Activation checkpointing: ``MemoryConfig(activation_checkpointing="auto")`` lets the planner
pick the mode per world size with the rest of the layout (the fastest that fits);
``ResolvedParallel.memory`` is the spec's MemoryConfig with the pick, what ``plan_mesh(...,
memory=)`` records and the workers apply. Any other mode is the spec's, used as is.

The replicate tier: ``CommConfig(replicate="auto")`` takes the planner's advice
(``replicate_tier.advise``) for the **launch** mesh, and every other size keeps it (the
caller passes ``launch_replicate``, the launch mesh's, as with tp): a restart changes the
number of replicas, never how they meet, so a DiLoCo run's checkpoints always hold what its
next attempt reads. ``ResolvedParallel.replicate_choice`` is what ``plan_mesh(...,
replicate_choice=)`` records and the workers apply.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from rayflex.config import DataConfig, MemoryConfig, ParallelConfig, TrainSpec
from rayflex.errors import ConfigError, PlacementError

if TYPE_CHECKING:
    from rayflex.planning.capacity.search import ParallelChoice
    from rayflex.planning.topology import Topology


@dataclass(frozen=True)
class ResolvedParallel:
    """Concrete configs for one world size; ``explanation`` is the planner's reasoning
    ("" and ``choice`` None when the spec's pp was an integer). ``memory``: the spec's
    MemoryConfig, with the planner's activation checkpointing when it said "auto" (never
    "auto" here); the spec's own object otherwise."""

    parallel: ParallelConfig
    data: DataConfig
    explanation: str
    choice: Optional["ParallelChoice"]
    memory: MemoryConfig
    replicate_choice: tuple = ()  # CommConfig(replicate="auto")'s pick, as MeshPlan.replicate_choice


# (model id, global batch, seq_len, world size, cluster key) -> (model, choice). The model
# is kept in the value so that its id cannot be reused by another object while cached.
_CACHE: "OrderedDict[tuple, tuple[Any, ParallelChoice]]" = OrderedDict()
_CACHE_SIZE = 64


def resolve_parallel(spec: TrainSpec, world_size: int, topology: Optional["Topology"] = None, *,
                     launch_tp: Optional[int] = None, launch_replicate: Optional[tuple] = None) -> ResolvedParallel:
    """The ParallelConfig and DataConfig to run ``spec`` at ``world_size`` ranks.

    With ``layout="auto"`` the cluster is ``spec.parallel.cluster`` (a description file) if
    set, else ``topology`` (its nodes, with this host's CPUs as devices), else one host with
    ``world_size`` CPU slots. ``launch_tp``: the tp the run launched with (module docstring:
    kept while it fits); None finds it by planning the launch size. ``launch_replicate``: the
    launch mesh's ``replicate_choice`` (module docstring), likewise. Raises CapacityError
    (with the numbers) when no mesh fits.
    """
    if not spec.parallel.is_auto:
        return ResolvedParallel(spec.parallel, spec.data, "", None, spec.memory)
    cluster, key = _cluster(spec.parallel.cluster, topology, world_size)
    auto_comm = spec.comm.replicate == "auto"
    launch = None
    if launch_tp is None or (auto_comm and launch_replicate is None):
        launch = _launch_choice(spec, world_size, topology)
    keep = launch_tp if launch_tp is not None else (launch.mesh.tp if launch is not None else None)
    choice = _best(spec, world_size, cluster, key, keep)
    mesh = choice.mesh
    pipelined = mesh.pp > 1
    parallel = ParallelConfig(pp=mesh.pp, schedule=mesh.schedule if pipelined else "1f1b",
                              microbatches=mesh.microbatches if pipelined else None,
                              stages_per_rank=mesh.stages_per_rank, balance=spec.parallel.balance,
                              cluster=spec.parallel.cluster, tp=mesh.tp,
                              dp_shard=mesh.dp_shard if mesh.dp_replicate > 1 else None)
    data = spec.data if pipelined else dataclasses.replace(spec.data, micro_batch=mesh.micro_batch)
    memory = spec.memory
    if memory.activation_checkpointing == "auto":
        memory = dataclasses.replace(memory, activation_checkpointing=choice.activation_checkpointing,
                                     ac_every=choice.ac_every)
    explanation, replicate = choice.explanation, ()
    if auto_comm:
        replicate, why = (launch_replicate, "the launch mesh's choice.") if launch_replicate is not None \
            else replicate_choice(launch or choice)
        explanation += f"\nReplicate tier (auto, kept at every world size): {why}"
    return ResolvedParallel(parallel, data, explanation, choice, memory, tuple(replicate))


def replicate_choice(choice: "ParallelChoice") -> tuple[tuple, str]:
    """``CommConfig(replicate="auto")`` on ``choice``'s mesh: (MeshPlan.replicate_choice, why)."""
    from rayflex.planning.capacity.replicate_tier import advise, describe

    c = choice.candidate
    if c is None or c.comm is None or c.layout.dp_replicate < 2:
        return (("replicate", "allreduce"),), f"the fp32 all-reduce: the mesh at {choice.mesh.world_size} ranks " \
                                              "has no replicas."
    advice = advise(c.compute_s, sum(c.comm.replica_s))
    pairs = (("replicate", advice.comm.get("replicate", "allreduce")),) + tuple(
        (k, v) for k, v in advice.comm.items() if k != "replicate") + tuple(advice.precision.items())
    return pairs, f"{advice.config()}, for the mesh at {choice.mesh.world_size} ranks. " + describe(advice)


def _launch_choice(spec: TrainSpec, world_size: int, topology: Optional["Topology"]) -> Optional["ParallelChoice"]:
    """The planner's choice at the launch size on this cluster; None at the launch size
    itself, or when the cluster cannot plan the launch size any more."""
    launch = spec.scaling.num_workers
    if world_size == launch:
        return None
    cluster, key = _cluster(spec.parallel.cluster, topology, launch)
    try:
        return _best(spec, launch, cluster, key, None)
    except PlacementError:  # CapacityError: the launch size does not fit what is left
        return None


def _cluster(path: Optional[str], topology: Optional["Topology"], world_size: int) -> tuple[Any, tuple]:
    """What to hand ``best_parallel_config`` as the cluster, and a cache key for it."""
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError("ParallelConfig.cluster", f"no such file {path!r}",
                              "give a cluster-description YAML (see docs/capacity.md), or None for the live cluster")
        # mtime in the key: an edited description is re-read.
        return path, ("file", path, os.stat(path).st_mtime_ns)
    if topology is not None:
        return topology, ("topology", json.dumps(topology.usable().to_dict(), sort_keys=True))
    from rayflex.planning.topology import Topology

    local = Topology.from_dict({"nodes": [{"id": "local", "slots": world_size}]})
    return local, ("local", world_size)


def _best(spec: TrainSpec, world_size: int, cluster: Any, cluster_key: tuple,
          keep_tp: Optional[int]) -> "ParallelChoice":
    """The planner's choice at ``world_size``, keeping ``keep_tp`` if a mesh with it fits."""
    from rayflex.planning.capacity.memory import CapacityError

    if keep_tp is not None:
        try:
            choice = _search(spec, world_size, cluster, cluster_key, keep_tp)
        except CapacityError as e:
            why = str(e)
        else:
            note = (f"Elastic rule: tp={keep_tp} is the launch mesh's (tp is fixed by the node shape) and a mesh "
                    f"with it fits at {world_size} ranks, so only pp, dp and the shard groups were re-planned.")
            return dataclasses.replace(choice, explanation=f"{choice.explanation}\n{note}")
        choice = _search(spec, world_size, cluster, cluster_key, None)
        note = (f"Elastic rule: the launch mesh's tp={keep_tp} fits no mesh at {world_size} ranks "
                f"({why.split('. Fix:')[0]}), so every tp was searched.")
        return dataclasses.replace(choice, explanation=f"{choice.explanation}\n{note}")
    return _search(spec, world_size, cluster, cluster_key, None)


def _search(spec: TrainSpec, world_size: int, cluster: Any, cluster_key: tuple,
            tp: Optional[int]) -> "ParallelChoice":
    from rayflex.constants import knob
    from rayflex.planning.capacity.failures import for_run
    from rayflex.planning.capacity.search import best_parallel_config

    # Cached because a non-GPT model is described by running its blocks once on CPU, and
    # elastic runs re-plan the same few sizes again and again.
    key = (id(spec.model), spec.data.global_batch, spec.data.seq_len, world_size, cluster_key, spec.precision,
           spec.memory, spec.comm, tp, spec.elastic.failures_per_hour, spec.checkpoint.every_steps)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is spec.model:
        _CACHE.move_to_end(key)
        return hit[1]
    choice = best_parallel_config(spec.model, cluster, world_size, spec.data.global_batch, spec.data.seq_len,
                                  precision_config=spec.precision, memory_config=spec.memory,
                                  comm_config=spec.comm, tp=None if tp is None else [tp],
                                  failures=for_run(spec.elastic.failures_per_hour, spec.checkpoint.every_steps,
                                                   save_cost_s=knob("CHECKPOINT_COST_PRIOR_S")))
    _CACHE[key] = (spec.model, choice)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return choice
