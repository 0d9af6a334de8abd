"""Which nodes hold the replicas of a node's checkpoint shards: the policy.

A replica is only worth its memory if the failure that takes the shard leaves it: so never
the same node, and another rack (failure domain) whenever the run has one. Among the nodes
of the preferred distance the least loaded one is taken (ties in ring order over the sorted
node ids), so every node carries about as many replicas as it sends. Another rack in the same zone is
preferred to another zone: it survives a rack loss at datacenter-network cost, where a
cross-zone copy pays the region backbone for every save (used when it is the only other
failure domain there is).
"""

from __future__ import annotations

from rayflex.planning.topology import LinkTier, Topology

# Best first: another rack in this zone, then another zone, then this rack's other nodes.
PREFERENCE = (LinkTier.SAME_ZONE, LinkTier.CROSS_ZONE, LinkTier.SAME_DOMAIN)


def choose_peers(topology: Topology, nodes: list[str], copies: int) -> dict[str, list[str]]:
    """For each of ``nodes`` (the run's nodes, all in ``topology``), the ``copies`` nodes
    its shards are replicated to (fewer when the run has fewer other nodes)."""
    ring = sorted(set(nodes))
    load = {n: 0 for n in ring}  # replicas each node has been given so far
    out: dict[str, list[str]] = {}
    for i, node in enumerate(ring):
        others = ring[i + 1:] + ring[:i]  # ring order from this node: ties go round
        chosen: list[str] = []
        for tier in PREFERENCE:
            candidates = [o for o in others if topology.tier(node, o) == tier]
            while candidates and len(chosen) < copies:
                pick = min(candidates, key=lambda o: load[o])  # the least loaded (first in ring order)
                candidates.remove(pick)
                chosen.append(pick)
                load[pick] += 1
        out[node] = chosen
    return out
