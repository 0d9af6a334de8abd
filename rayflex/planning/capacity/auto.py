"""``ParallelConfig(pp="auto")``: turn the capacity planner's choice into concrete configs.

The controller calls :func:`resolve_parallel` on every placement (launch and each elastic
restart), then ``plan_mesh`` on the result; ``Trainer.plan()`` and the driver's preflight
call it too. A spec with an integer ``pp`` passes through untouched, without importing the
planner.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from rayflex.config import DataConfig, ParallelConfig, TrainSpec
from rayflex.errors import ConfigError

if TYPE_CHECKING:
    from rayflex.planning.capacity.search import ParallelChoice
    from rayflex.planning.topology import Topology


@dataclass(frozen=True)
class ResolvedParallel:
    """Concrete configs for one world size; ``explanation`` is the planner's reasoning
    ("" and ``choice`` None when the spec's pp was an integer)."""

    parallel: ParallelConfig
    data: DataConfig
    explanation: str
    choice: Optional["ParallelChoice"]


# (model id, global batch, seq_len, world size, cluster key) -> (model, choice). The model
# is kept in the value so that its id cannot be reused by another object while cached.
_CACHE: "OrderedDict[tuple, tuple[Any, ParallelChoice]]" = OrderedDict()
_CACHE_SIZE = 64


def resolve_parallel(spec: TrainSpec, world_size: int, topology: Optional["Topology"] = None) -> ResolvedParallel:
    """The ParallelConfig and DataConfig to run ``spec`` at ``world_size`` ranks.

    With ``pp="auto"`` the cluster is ``spec.parallel.cluster`` (a description file) if set,
    else ``topology`` (its nodes, with this host's CPUs as devices), else one host with
    ``world_size`` CPU slots. Raises CapacityError (with the numbers) when no mesh fits.
    """
    if not spec.parallel.is_auto:
        return ResolvedParallel(spec.parallel, spec.data, "", None)
    cluster, key = _cluster(spec.parallel.cluster, topology, world_size)
    choice = _best(spec, world_size, cluster, key)
    parallel = ParallelConfig(pp=choice.pp, schedule=choice.schedule, microbatches=choice.microbatches,
                              stages_per_rank=choice.stages_per_rank, balance=spec.parallel.balance,
                              cluster=spec.parallel.cluster)
    data = spec.data
    if choice.pp == 1 and choice.micro_batch is not None:
        data = dataclasses.replace(spec.data, micro_batch=choice.micro_batch)
    return ResolvedParallel(parallel, data, choice.explanation, choice)


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


def _best(spec: TrainSpec, world_size: int, cluster: Any, cluster_key: tuple) -> "ParallelChoice":
    from rayflex.planning.capacity.search import best_parallel_config

    # Cached because a non-GPT model is described by running its blocks once on CPU, and
    # elastic runs re-plan the same few sizes again and again.
    key = (id(spec.model), spec.data.global_batch, spec.data.seq_len, world_size, cluster_key, spec.precision,
           spec.memory)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is spec.model:
        _CACHE.move_to_end(key)
        return hit[1]
    choice = best_parallel_config(spec.model, cluster, world_size, spec.data.global_batch, spec.data.seq_len,
                                  precision_config=spec.precision, memory_config=spec.memory)
    _CACHE[key] = (spec.model, choice)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return choice
