"""Where each rank goes: the Planner (rank -> node and slot, minimising modeled
communication). Making Ray honour a plan is ``rayflex.group.reservation.RunPlacement``'s.

This module is the facade; its public names are the placement API. The pieces:

* ``cost_model``: the rank layout, the request types (``MeshShape``, ``CommProfile``) and
  the communication cost model every plan is priced by (``modeled_comm_seconds``).
* ``placement_bound``: a dynamic program over stages in a relaxation (each stage gets a tree
  level for its FSDP group; each boundary the level at which consecutive stages are "tied",
  i.e. hold equal counts per subtree; capacity is checked per tied run) gives a lower bound
  and level plans, cheapest first.
* ``placement_packer``: a hierarchical packer realises a level plan (runs of node-tied
  stages as chunks, best-fit homes, first fit in rack order).
* ``placement_exact``: exact memoised search over per-node counts, and the brute force
  reference.
* ``placement_explain``: the plan's explanation.

Planning: reaching the bound proves optimality. Otherwise small instances get the exact
search, and large ones keep the best realised candidate, with the gap to the bound stated in
the plan's explanation.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from rayflex.errors import PlacementError
from rayflex.planning.cost_model import (
    REL_TOL,
    CommProfile,
    MeshShape,
    NodeTree,
    TierCosts,
    evaluate,
    improves,
    meets,
    modeled_comm_seconds,
    ranks_from_counts,
)
from rayflex.planning.placement.bound import Relaxation
from rayflex.planning.placement.exact import brute_force_assignment, exact_counts
from rayflex.planning.placement.explain import explain, rank_ranges, short_id
from rayflex.planning.placement.packer import realize
from rayflex.planning.topology import MARKET_LABEL, Bandwidths, NodeInfo, Topology

__all__ = [
    "CommProfile",
    "MeshShape",
    "Plan",
    "Planner",
    "brute_force_plan",
    "modeled_comm_seconds",
    "naive_plan",
]


def _eligible_nodes(topology: Topology, mesh: MeshShape, require_labels: Optional[Mapping[str, str]],
                    market_type: Optional[str]) -> List[NodeInfo]:
    """Usable nodes matching the filters; PlacementError naming what is missing otherwise."""
    dead = [n for n in topology.nodes if not n.alive]
    draining = [n for n in topology.nodes if n.alive and n.draining]
    nodes = [n for n in topology.nodes if n.usable and n.slots > 0]
    filters = []
    for key, value in (require_labels or {}).items():
        kept = [n for n in nodes if n.labels.get(key) == value]
        if not kept:
            seen = sorted({n.labels[key] for n in nodes if key in n.labels})
            raise PlacementError(
                f"no usable node has label {key}={value!r}: 0 of {len(nodes)} usable nodes match "
                f"(values of {key!r} present: {seen or 'none'}); label the nodes or drop the requirement")
        nodes = kept
        filters.append(f"{key}={value}")
    if market_type is not None:
        kept = [n for n in nodes if n.market_type == market_type]
        if not kept:
            seen = sorted({n.market_type or "unlabelled" for n in nodes})
            raise PlacementError(
                f"no usable {market_type} nodes: 0 of {len(nodes)} usable nodes carry "
                f"{MARKET_LABEL}={market_type} (market types present: {seen}); add {market_type} "
                f"nodes or drop market_type")
        nodes = kept
        filters.append(f"{MARKET_LABEL}={market_type}")
    have = sum(n.slots for n in nodes)
    if have < mesh.world_size:
        where = f" matching {', '.join(filters)}" if filters else ""
        raise PlacementError(
            f"need {mesh.world_size} worker slots (pp={mesh.pp} x dp={mesh.dp}) but only {have} are "
            f"usable on {len(nodes)} node(s){where}; not counted: {len(dead)} dead node(s), "
            f"{len(draining)} draining node(s) with {sum(n.slots for n in draining)} slots. "
            f"Lower pp x dp or add nodes")
    return nodes


@dataclass(frozen=True)
class Plan:
    """Where every rank runs, what that costs in modeled communication, and why."""

    mesh: MeshShape
    rank_to_node: Tuple[str, ...]
    rank_to_slot: Tuple[int, ...]
    modeled_comm_s: float
    naive_comm_s: float
    explanation: str
    lower_bound_s: float = 0.0
    optimal: bool = False
    method: str = ""
    fsdp_s: Tuple[float, ...] = ()
    p2p_s: Tuple[float, ...] = ()

    def node_ranks(self) -> Dict[str, List[int]]:
        """Node id -> its ranks in slot order, nodes in order of their first rank."""
        out: Dict[str, List[int]] = {}
        for rank, node in enumerate(self.rank_to_node):
            out.setdefault(node, []).append(rank)
        return out

    def to_dict(self) -> dict:
        return {"pp": self.mesh.pp, "dp": self.mesh.dp, "rank_to_node": list(self.rank_to_node),
                "rank_to_slot": list(self.rank_to_slot), "modeled_comm_s": self.modeled_comm_s,
                "naive_comm_s": self.naive_comm_s, "lower_bound_s": self.lower_bound_s,
                "optimal": self.optimal, "method": self.method, "fsdp_s": list(self.fsdp_s),
                "p2p_s": list(self.p2p_s), "explanation": self.explanation}

    def format(self, ranks: bool = False) -> str:
        """The explanation; with ``ranks`` also one line per node listing its ranks."""
        if not ranks:
            return self.explanation
        lines = [self.explanation, "ranks per node:"]
        lines += [f"  {short_id(n)}: {rank_ranges(rs)}" for n, rs in self.node_ranks().items()]
        return "\n".join(lines)


def _make_plan(tree: NodeTree, costs: TierCosts, mesh: MeshShape, profile: CommProfile,
               node_of_rank: Sequence[int], naive_s: float, lower_bound: float, optimal: bool,
               method: str, relax: Optional[Relaxation] = None) -> Plan:
    ev = evaluate(tree, costs, mesh, node_of_rank)
    slots_used: Dict[int, int] = {}
    slots = []
    for i in node_of_rank:
        slots.append(slots_used.get(i, 0))
        slots_used[i] = slots[-1] + 1
    text = explain(tree, mesh, profile, node_of_rank, ev, naive_s, lower_bound, optimal, method,
                   relax or Relaxation(tree, costs, mesh))
    return Plan(mesh, tuple(tree.nodes[i].node_id for i in node_of_rank), tuple(slots), ev.total,
                naive_s, text, lower_bound, optimal, method, ev.fsdp_s, ev.p2p_s)


def _naive(tree: NodeTree, costs: TierCosts, mesh: MeshShape) -> Tuple[List[int], float]:
    """Ray Train's placement (ranks fill nodes slot by slot in listed order) and its cost."""
    node_of_rank = [i for i in range(tree.n) for _ in range(tree.cap[i])][:mesh.world_size]
    return node_of_rank, evaluate(tree, costs, mesh, node_of_rank).total


def naive_plan(topology: Topology, mesh: MeshShape, profile: CommProfile, *,
               bandwidths: Optional[Bandwidths] = None, require_labels: Optional[Mapping[str, str]] = None,
               market_type: Optional[str] = None) -> Plan:
    """What Ray Train does: one PACK placement group, ranks filling nodes in listed order.

    Ray lists nodes in join order, which on a real cluster interleaves racks and zones; the
    ranks follow it slot by slot, so FSDP groups and stage boundaries land wherever that
    order happens to put them.
    """
    nodes = _eligible_nodes(topology, mesh, require_labels, market_type)
    tree, costs = NodeTree(nodes), TierCosts(mesh, profile, bandwidths or topology.bandwidths)
    nor, total = _naive(tree, costs, mesh)
    lb = Relaxation(tree, costs, mesh).solve()
    return _make_plan(tree, costs, mesh, profile, nor, total, lb, meets(total, lb),
                      "naive: one PACK group, ranks in node order")


def brute_force_plan(topology: Topology, mesh: MeshShape, profile: CommProfile, *,
                     bandwidths: Optional[Bandwidths] = None,
                     require_labels: Optional[Mapping[str, str]] = None,
                     market_type: Optional[str] = None, max_slots: int = 12) -> Plan:
    """The optimum by exhaustive search over rank -> node assignments (tiny topologies only).

    The reference the planner is tested and benchmarked against; see
    ``placement_exact.brute_force_assignment`` for why it is independent of the planner.
    """
    nodes = _eligible_nodes(topology, mesh, require_labels, market_type)
    if sum(n.slots for n in nodes) > max_slots:
        raise ValueError(f"brute force is for <= {max_slots} slots, got {sum(n.slots for n in nodes)}")
    tree, costs = NodeTree(nodes), TierCosts(mesh, profile, bandwidths or topology.bandwidths)
    optimum, out = brute_force_assignment(tree, costs, mesh)
    _, naive_s = _naive(tree, costs, mesh)
    return _make_plan(tree, costs, mesh, profile, out, naive_s, optimum, True, "brute force (exhaustive)")


class Planner:
    """Chooses rank -> (node, slot) for a pp x dp mesh by the cost model (``cost_model``).

    When the first level plan packs, the plan meets the lower bound and planning stops
    (uniform clusters, including 16,384 slots, take well under a second). Otherwise it tries
    up to ``level_plans`` level plans, then, on clusters of at most ``exact_search_max_slots``
    eligible slots, an exact search of at most ``exact_search_states`` states (0 disables it).
    ``time_budget_s`` caps each of those two phases; past it the plan is the best found, and
    its explanation gives the gap to the lower bound.
    """

    def __init__(self, topology: Topology, bandwidths: Optional[Bandwidths] = None,
                 exact_search_states: int = 20_000, exact_search_max_slots: int = 64,
                 level_plans: int = 64, time_budget_s: float = 1.0):
        self.topology = topology
        self.level_plans = level_plans
        self.exact_search_max_slots = exact_search_max_slots
        self.time_budget_s = time_budget_s
        self.bandwidths = bandwidths or topology.bandwidths
        self.exact_search_states = exact_search_states

    def plan(self, mesh: MeshShape, profile: CommProfile, *,
             require_labels: Optional[Mapping[str, str]] = None,
             market_type: Optional[str] = None) -> Plan:
        nodes = _eligible_nodes(self.topology, mesh, require_labels, market_type)
        tree, costs = NodeTree(nodes), TierCosts(mesh, profile, self.bandwidths)
        deadline = time.monotonic() + self.time_budget_s
        relax = Relaxation(tree, costs, mesh)
        lower_bound = relax.solve()
        naive_nor, naive_s = _naive(tree, costs, mesh)
        best: Optional[Tuple[float, List[int], str]] = None

        def consider(counts, method) -> float:
            """Keep the counts' plan if it beats the best; returns its cost (inf for none)."""
            nonlocal best
            if counts is None:
                return math.inf
            nor = ranks_from_counts(tree, counts, mesh.dp)
            total = evaluate(tree, costs, mesh, nor).total
            if best is None or improves(total, best[0]):
                best = (total, nor, method)
            return total

        # level plans cheapest first; stop once the next one cannot beat what is realised
        first = None
        for tried, (relaxed, rows, bnds) in enumerate(relax.plans()):
            first = first or (rows, bnds)
            if (tried >= self.level_plans or (best is not None and relaxed >= best[0] * (1 - REL_TOL))
                    or (tried and time.monotonic() > deadline)):
                break
            consider(realize(tree, mesh, rows, bnds, deadline=deadline), "hierarchical")
        if best is None or not meets(best[0], lower_bound):
            consider(realize(tree, mesh, *first, robust=True), "hierarchical (levels relaxed)")
            alone = [relax.rows_ok[0]] * mesh.pp
            consider(realize(tree, mesh, alone, [3] * (mesh.pp - 1), robust=True),
                     "hierarchical (stages packed one by one)")
            if improves(naive_s, best[0]):
                best = (naive_s, naive_nor, "naive order (no better packing found)")
        optimal = meets(best[0], lower_bound)
        if (not optimal and self.exact_search_states > 0
                and sum(tree.cap) <= self.exact_search_max_slots):
            found = exact_counts(tree, costs, mesh, self.exact_search_states,
                                 time.monotonic() + self.time_budget_s)
            if found is not None:
                total = consider(found[1], "exact search")
                optimal, lower_bound = True, max(lower_bound, min(total, best[0]))
        method = best[2] + (" (optimal)" if optimal else "")
        return _make_plan(tree, costs, mesh, profile, best[1], naive_s, lower_bound, optimal, method, relax)

