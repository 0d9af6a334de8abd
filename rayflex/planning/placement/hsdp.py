"""HSDP placement: candidates for meshes whose dp ranks are ``dp_replicate`` replicas of
``dp_shard``-rank FSDP shard groups, priced by ``evaluate``.

With HSDP a stage's cost depends on which dp indices share a node (a shard group is a run
of ``dp_shard`` consecutive indices, a replicate group the indices equal mod ``dp_shard``),
not only on per-node counts, so the count-based exact machinery no longer applies. The
candidates:

* the plain unit search's plan on the per-stage floor table (``TierCosts.fsdp``);
* **shard-local**: the coarse problem of ``pp x dp_replicate`` units of ``dp_shard`` tp
  groups each (one shard group, kept on one node), the replicate groups priced as its FSDP
  groups; and **replica-local**, ``pp x dp_shard`` units of ``dp_replicate`` tp groups (one
  replicate group each), the shard groups priced as its FSDP groups. Each is the plain
  search of a smaller mesh, so whichever tier is worth keeping local gets the exact
  machinery's placement;
* the canonical dp-major and pipeline-major orders;
* each of those with its dp indices renumbered (lanes sorted by node and grouped row- or
  column-major): renumbering every stage alike keeps every pipeline lane, so it moves only
  the shard and replicate groups;
* on small meshes, the best one refined by moving units to free slots and swapping them
  while that lowers the cost.

Planning stays correct (every candidate is priced by the ground truth) and reports what is
proven: optimal only when the cost meets the lower bound.
"""

from __future__ import annotations

import time
from typing import List, Sequence, Tuple

from rayflex.mesh.plan import MeshPlan
from rayflex.planning.cost_model import (NodeTree, TierCosts, canonical_unit_orders, improves, price,
                                         unit_levels)
from rayflex.planning.placement.unit_search import search_units
from rayflex.planning.topology import GPU_DOMAIN_LABEL, RACK_LABEL, LinkTier, NodeInfo

Candidate = Tuple[List[int], str]  # unit -> node, how it was found


def hsdp_candidates(nodes, tree: NodeTree, costs: TierCosts, mesh: MeshPlan, base: Candidate,
                    deadline: float, level_plans: int = 16) -> List[Candidate]:
    """Unit -> node layouts worth pricing for an HSDP mesh (module docstring)."""
    out = [base]
    out += [(order, f"{name} order") for name, order in zip(("dp-major", "pipeline-major"),
                                                            canonical_unit_orders(tree, mesh.units))]
    out += _coarse(nodes, costs, mesh, deadline, level_plans)
    renumbered = []
    for units, method in out:
        for major in ("row", "column"):
            renumbered.append((renumber(tree, mesh, units, major), f"{method}, dp indices renumbered {major}-major"))
    return out + renumbered


def _coarse(nodes, costs: TierCosts, mesh: MeshPlan, deadline: float, level_plans: int) -> List[Candidate]:
    """The shard-local and replica-local plans (module docstring), with the coarse units kept
    on one node, one rack or one zone (a group that cannot sit on a node may fit a rack)."""
    pp, dp, shard, reps = mesh.pp, mesh.dp, mesh.dp_shard, mesh.dp_replicate
    levels = range(len(LinkTier))
    out = []
    for shard_local in (True, False):
        if shard_local:  # a coarse unit is a shard group; the coarse dp groups are replicate groups
            name, group, count = "shard groups", shard, reps
            table = [[costs.replica[s][lv] + costs.shard[s][0] for lv in levels] for s in range(pp)]
        else:  # a coarse unit is a replicate group; the coarse dp groups are shard groups
            name, group, count = "replicate groups", reps, shard
            table = [[costs.shard[s][lv] + costs.replica[s][0] for lv in levels] for s in range(pp)]
        for where in ("node", "rack", "zone"):
            homes = _homes(nodes, mesh.tp, where)
            tree = NodeTree([home for home, _ in homes], unit=group * mesh.tp)
            if sum(tree.cap) < pp * count:
                continue
            found = search_units(tree, TierCosts.from_tables(table, costs.p2p), MeshPlan(pp, count),
                                 deadline=deadline, level_plans=level_plans)
            # deal each coarse unit `group` unit slots of its home, node by node
            pools = [[i for i in members for _ in range(nodes[i].slots // mesh.tp)] for _, members in homes]
            units = [0] * (pp * dp)
            for s in range(pp):
                for c in range(count):
                    pool = pools[found.node_of_unit[s * count + c]]
                    for j in range(group):  # coarse unit c holds dp indices c*shard+j (shard-local) or j*shard+c
                        units[s * dp + (c * shard + j if shard_local else j * shard + c)] = pool.pop(0)
            out.append((units, f"{name} {where}-local ({found.method})"))
    return out


def _homes(nodes, tp: int, where: str) -> List[Tuple[NodeInfo, List[int]]]:
    """The places a coarse unit may live, as pseudo-nodes holding their member nodes' whole
    tp groups: every node, every rack (a node without a rack is its own) or every zone."""
    if where == "node":
        return [(nd, [i]) for i, nd in enumerate(nodes)]
    places: dict = {}
    for i, nd in enumerate(nodes):
        key = (nd.domain_key() or ("solo", nd.node_id)) if where == "rack" else nd.zone
        places.setdefault(key, []).append(i)
    out = []
    for members in places.values():
        first = nodes[members[0]]
        labels = dict(first.labels) if where == "rack" or len(members) == 1 else \
            {k: v for k, v in first.labels.items() if k not in (RACK_LABEL, GPU_DOMAIN_LABEL)}
        units = sum(nodes[i].slots // tp for i in members)
        out.append((NodeInfo(node_id=f"{first.node_id}+{len(members) - 1}", slots=units * tp, labels=labels),
                    members))
    return out


def renumber(tree: NodeTree, mesh: MeshPlan, units: Sequence[int], major: str) -> List[int]:
    """The same placement with its dp indices renumbered: lanes (one dp index through every
    stage) sorted by their nodes in the tree's order, then dealt row-major (consecutive
    lanes form a shard group) or column-major (consecutive lanes form a replicate group)."""
    pp, dp, shard, reps = mesh.pp, mesh.dp, mesh.dp_shard, mesh.dp_replicate
    rank = {node: i for i, node in enumerate(tree.order)}
    lanes = sorted(range(dp), key=lambda d: tuple(rank[units[s * dp + d]] for s in range(pp)))
    if major == "row":
        order = lanes
    else:
        order = [0] * dp
        for k, lane in enumerate(lanes):  # the k-th lane goes to replica k % reps, shard index k // reps
            order[(k % reps) * shard + k // reps] = lane
    return [units[s * dp + order[d]] for s in range(pp) for d in range(dp)]


def refine(tree: NodeTree, costs: TierCosts, mesh: MeshPlan, units: List[int], deadline: float,
           max_units: int = 48) -> Tuple[List[int], bool]:
    """Local search on small meshes, within the deadline: move a unit to a node with a free
    unit slot, or swap two units on different nodes, while that lowers the cost; returns the
    layout and whether it changed."""
    n = len(units)
    if n > max_units:
        return units, False
    units = list(units)
    free = list(tree.cap)
    for i in units:
        free[i] -= 1

    def cost() -> float:
        return price(costs, unit_levels(tree, mesh, units)).total

    best, changed, improved = cost(), False, True
    while improved and time.monotonic() < deadline:
        improved = False
        for a in range(n):
            for node in range(tree.n):  # moves
                if free[node] > 0 and node != units[a]:
                    old = units[a]
                    units[a] = node
                    total = cost()
                    if improves(total, best):
                        best, improved, changed = total, True, True
                        free[node] -= 1
                        free[old] += 1
                    else:
                        units[a] = old
            for b in range(a + 1, n):  # swaps
                if units[a] == units[b]:
                    continue
                units[a], units[b] = units[b], units[a]
                total = cost()
                if improves(total, best):
                    best, improved, changed = total, True, True
                else:
                    units[a], units[b] = units[b], units[a]
            if time.monotonic() > deadline:
                break
    return units, changed
