"""The bytes a placed mesh sends over each link tier per step: the cost model's collectives
counted in bytes instead of seconds, which is what a link can be measured carrying
(``rayflex.testing.linkbed`` reads them from tc's counters).

Each collective is the ring the cost model prices (``planning.cost_model``): in a group of
``n`` ranks in rank order, every rank sends its share to the next, so a hop's bytes go over
the tier between those two ranks' nodes. Per stage and step: ``n_coll - 1`` all-gathers and
one reduce-scatter of the stage's parameters over each FSDP shard group, ``(n-1)/n`` of
them per rank each; with HSDP an all-reduce (``2(n-1)/n``) of the shard over each replicate
group; with tp the stage's all-reduce bytes over each tp group; and across each stage
boundary, per lane, the activations forward and their gradients back.

``CollectiveBytes`` says how many times the ring's bytes a backend actually moves. Measured
on the link bed (``benchmarks/results/linkbed_calibrate.json``): gloo's reduce-scatter is an
all-reduce underneath and moves twice the ring's bytes; its all-gather, all-reduce and
send/recv move what the ring says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rayflex.mesh.plan import MeshPlan
from rayflex.planning.cost_model import CommProfile
from rayflex.planning.topology import LinkTier, Topology


@dataclass(frozen=True)
class CollectiveBytes:
    """Bytes a backend moves per collective, in multiples of the ring's."""

    all_gather: float = 1.0
    reduce_scatter: float = 1.0
    all_reduce: float = 1.0
    p2p: float = 1.0


RING = CollectiveBytes()
GLOO = CollectiveBytes(reduce_scatter=2.0)


def link_bytes(topology: Topology, mesh: MeshPlan, profile: CommProfile, rank_to_node: Sequence[str],
               collectives: CollectiveBytes = RING) -> dict[str, float]:
    """Bytes per step over each link tier (``LinkTier`` names, lower case; every tier
    listed) when rank ``r`` runs on node ``rank_to_node[r]``."""
    out = {t.name.lower(): 0.0 for t in LinkTier}

    def ring(ranks: Sequence[int], per_rank: float) -> None:
        n = len(ranks)
        if n < 2 or per_rank <= 0:
            return
        for i, r in enumerate(ranks):
            nxt = ranks[(i + 1) % n]
            out[topology.tier(rank_to_node[r], rank_to_node[nxt]).name.lower()] += per_rank

    pp, dp, tp, reps, shard = mesh.pp, mesh.dp, mesh.tp, mesh.dp_replicate, mesh.dp_shard
    for s in range(pp):
        params = profile.stage_param_bytes[s]
        for t in range(tp):
            units = [mesh.rank_of(s, d, t) for d in range(dp)]
            frac = (shard - 1) / shard
            gathers = (profile.fsdp_collectives - 1) * collectives.all_gather + collectives.reduce_scatter
            for r in range(reps):
                ring(units[r * shard:(r + 1) * shard], gathers * frac * params)
            if reps > 1:
                for i in range(shard):
                    ring(units[i::shard], collectives.all_reduce * 2 * (reps - 1) / reps * params / shard)
        if tp > 1 and profile.tp_allreduce_bytes:
            for d in range(dp):
                ring([mesh.rank_of(s, d, t) for t in range(tp)],
                     collectives.all_reduce * 2 * (tp - 1) / tp * profile.tp_allreduce_bytes[s])
    crossing = profile.activation_bytes * profile.microbatches * collectives.p2p
    for s in range(pp - 1):
        for d in range(dp):
            for t in range(tp):
                a, b = rank_to_node[mesh.rank_of(s, d, t)], rank_to_node[mesh.rank_of(s + 1, d, t)]
                out[topology.tier(a, b).name.lower()] += 2 * crossing  # forward and backward
    return out

