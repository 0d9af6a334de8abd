"""Where each rank goes: the Planner (rank -> node and slot, minimising modeled
communication). Making Ray honour a plan is ``rayflex.group.reservation.RunPlacement``'s.

This module is the facade; its public names are the placement API. The pieces:

* ``cost_model``: the request type ``CommProfile`` (the mesh is ``rayflex.mesh.plan.MeshPlan``) and
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

Tensor parallelism: every search runs on pp x dp *units* of ``tp`` slots (``NodeTree(...,
unit=tp)``), so a tp group never leaves its node and every guarantee above holds for tp > 1
unchanged (``cost_model``: the unit reduction). HSDP (``dp_replicate > 1``): the bound uses a
per-stage floor and candidates are priced by ``evaluate``; the exact search is skipped (its
states are per-node counts, which do not determine HSDP's cost), so a plan is called optimal
only when it meets the bound, and the explanation says which.
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from rayflex.errors import PlacementError
from rayflex.mesh.plan import MeshPlan
from rayflex.planning.cost_model import (
    CommProfile,
    NodeTree,
    TierCosts,
    evaluate,
    expand_units,
    improves,
    meets,
    modeled_comm,
    modeled_comm_seconds,
)
from rayflex.planning.placement.bound import Relaxation
from rayflex.planning.placement.exact import brute_force_assignment, brute_force_units
from rayflex.planning.placement.explain import explain, rank_ranges, short_id
from rayflex.planning.placement.hsdp import hsdp_candidates, refine
from rayflex.planning.placement.unit_search import search_units
from rayflex.planning.topology import MARKET_LABEL, Bandwidths, NodeInfo, Topology

__all__ = [
    "CommProfile",
    "Plan",
    "Planner",
    "brute_force_plan",
    "modeled_comm",
    "modeled_comm_seconds",
    "naive_plan",
    "ranks_by_node",
]


def _eligible_nodes(topology: Topology, mesh: MeshPlan, require_labels: Optional[Mapping[str, str]],
                    market_type: Optional[str], check_tp: bool = True) -> List[NodeInfo]:
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
    where = f" matching {', '.join(filters)}" if filters else ""
    shape = f"pp={mesh.pp} x dp={mesh.dp}" + (f" x tp={mesh.tp}" if mesh.tp > 1 else "")
    if have < mesh.world_size:
        raise PlacementError(
            f"need {mesh.world_size} worker slots ({shape}) but only {have} are "
            f"usable on {len(nodes)} node(s){where}; not counted: {len(dead)} dead node(s), "
            f"{len(draining)} draining node(s) with {sum(n.slots for n in draining)} slots. "
            f"Lower pp x dp{' x tp' if mesh.tp > 1 else ''} or add nodes")
    if mesh.tp > 1 and check_tp:  # naive placement splits tp groups as Ray's order falls
        _check_tp_fits(nodes, mesh, shape, where)
    return nodes


def _check_tp_fits(nodes: Sequence[NodeInfo], mesh: MeshPlan, shape: str, where: str) -> None:
    """A tp group (tp consecutive ranks) all-reduces activations twice per block each way, so
    it never leaves a node: refuse a tp no node can hold, and a mesh whose tp groups the
    nodes cannot hold whole (slots left over on nodes that tp does not divide)."""
    biggest = max(n.slots for n in nodes)
    if mesh.tp > biggest:
        raise PlacementError(
            f"tp={mesh.tp} needs {mesh.tp} slots on one node (a tensor-parallel group never spans nodes), "
            f"but the largest usable node{where} has {biggest} slots. Fix: use a tp dividing the node "
            f"size (at most {biggest}), or nodes with at least {mesh.tp} workers each")
    groups = sum(n.slots // mesh.tp for n in nodes)
    if groups < mesh.pp * mesh.dp:
        sizes = sorted({n.slots for n in nodes})
        raise PlacementError(
            f"need {mesh.pp * mesh.dp} tensor-parallel groups of tp={mesh.tp} slots on one node each "
            f"({shape}), but the usable nodes{where} (of {sizes} slots) hold only {groups} whole groups. "
            f"Fix: use a tp dividing the node size, fewer ranks, or more nodes")


def ranks_by_node(rank_to_node: Sequence[str] | Mapping[int, str]) -> Dict[str, List[int]]:
    """Node id -> its ranks, ascending, nodes in order of their first rank: the one inversion
    of a rank -> node map (a plan's list, or the ranks a group knows)."""
    pairs = rank_to_node.items() if isinstance(rank_to_node, Mapping) else enumerate(rank_to_node)
    out: Dict[str, List[int]] = {}
    for rank, node in sorted(pairs):
        out.setdefault(node, []).append(rank)
    return out


@dataclass(frozen=True)
class Plan:
    """Where every rank runs, what that costs in modeled communication, and why."""

    mesh: MeshPlan
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
    replica_s: Tuple[float, ...] = ()  # HSDP all-reduce per stage
    tp_s: float = 0.0  # TP all-reduces (the slowest stage's)
    profile: Optional[CommProfile] = None  # what the plan was priced for (planning.traffic counts its bytes)

    def node_ranks(self) -> Dict[str, List[int]]:
        """Node id -> its ranks in slot order, nodes in order of their first rank."""
        return ranks_by_node(self.rank_to_node)

    def to_dict(self) -> dict:
        return {"pp": self.mesh.pp, "dp": self.mesh.dp, "tp": self.mesh.tp,
                "dp_replicate": self.mesh.dp_replicate, "rank_to_node": list(self.rank_to_node),
                "rank_to_slot": list(self.rank_to_slot), "modeled_comm_s": self.modeled_comm_s,
                "naive_comm_s": self.naive_comm_s, "lower_bound_s": self.lower_bound_s,
                "optimal": self.optimal, "method": self.method, "fsdp_s": list(self.fsdp_s),
                "p2p_s": list(self.p2p_s), "replica_s": list(self.replica_s), "tp_s": self.tp_s,
                "explanation": self.explanation}

    def format(self, ranks: bool = False) -> str:
        """The explanation; with ``ranks`` also one line per node listing its ranks."""
        if not ranks:
            return self.explanation
        lines = [self.explanation, "ranks per node:"]
        lines += [f"  {short_id(n)}: {rank_ranges(rs)}" for n, rs in self.node_ranks().items()]
        return "\n".join(lines)


def _make_plan(tree: NodeTree, costs: TierCosts, mesh: MeshPlan, profile: CommProfile,
               node_of_rank: Sequence[int], naive_s: float, lower_bound: float, optimal: bool,
               method: str) -> Plan:
    ev = evaluate(tree, costs, mesh, node_of_rank)
    slots_used: Dict[int, int] = {}
    slots = []
    for i in node_of_rank:
        slots.append(slots_used.get(i, 0))
        slots_used[i] = slots[-1] + 1
    text = explain(tree, costs, mesh, profile, node_of_rank, ev, naive_s, lower_bound, optimal, method)
    return Plan(mesh, tuple(tree.nodes[i].node_id for i in node_of_rank), tuple(slots), ev.total,
                naive_s, text, lower_bound, optimal, method, ev.fsdp_s, ev.p2p_s, ev.replica_s, ev.tp_total,
                profile)


def _setup(nodes: Sequence[NodeInfo], mesh: MeshPlan, profile: CommProfile,
           bw: Bandwidths) -> Tuple[NodeTree, TierCosts, Relaxation, float]:
    """The unit tree (nodes hold whole tp groups), the cost table, its relaxation and the
    lower bound on any plan that keeps tp groups whole."""
    tree, costs = NodeTree(nodes, unit=mesh.tp), TierCosts(mesh, profile, bw)
    if mesh.dp_replicate > 1:
        costs.set_group_floors(tree.fit_level(mesh.dp_shard), tree.fit_level(mesh.dp_replicate))
    relax = Relaxation(tree, costs, mesh.units)
    if sum(tree.cap) < mesh.pp * mesh.dp:  # naive_plan only: no whole-group plan exists to bound
        return tree, costs, relax, 0.0
    return tree, costs, relax, relax.solve() + costs.tp_floor


def _naive(tree: NodeTree, costs: TierCosts, mesh: MeshPlan) -> Tuple[List[int], float, bool]:
    """Ray Train's placement (ranks fill nodes slot by slot in listed order), its cost, and
    whether it keeps every tp group on one node (a plan the planner may return)."""
    node_of_rank = [i for i, nd in enumerate(tree.nodes) for _ in range(nd.slots)][:mesh.world_size]
    ev = evaluate(tree, costs, mesh, node_of_rank)
    return node_of_rank, ev.total, not any(ev.tp_levels)


def naive_plan(topology: Topology, mesh: MeshPlan, profile: CommProfile, *,
               bandwidths: Optional[Bandwidths] = None, require_labels: Optional[Mapping[str, str]] = None,
               market_type: Optional[str] = None) -> Plan:
    """What Ray Train does: one PACK placement group, ranks filling nodes in node order.

    Ray itself lists nodes in no fixed order (the same cluster listed its two racks'
    nodes interleaved one day and grouped the next), so the order here is the nodes'
    addresses (a described topology's nodes keep their listed order): reproducible, and on
    a cluster whose nodes take addresses as they join, the join order, which interleaves
    racks and zones. The ranks follow it slot by slot, so FSDP groups and stage boundaries
    land wherever that order puts them.
    """
    nodes = sorted(_eligible_nodes(topology, mesh, require_labels, market_type, check_tp=False), key=_address)
    tree, costs, _, lb = _setup(nodes, mesh, profile, bandwidths or topology.bandwidths)
    nor, total, _ = _naive(tree, costs, mesh)
    return _make_plan(tree, costs, mesh, profile, nor, total, lb, meets(total, lb),
                      "naive: one PACK group, ranks in node order")


def _address(node: NodeInfo) -> bytes:
    """A node's address as a sort key (empty, so listed order is kept, when it has none)."""
    try:
        return ipaddress.ip_address(node.ip).packed
    except ValueError:
        return b""


def shuffled_plan(topology: Topology, mesh: MeshPlan, profile: CommProfile, seed: int, *,
                  bandwidths: Optional[Bandwidths] = None,
                  require_labels: Optional[Mapping[str, str]] = None) -> Plan:
    """The mesh's pp x dp units on the nodes' unit slots in a seeded random order (every tp
    group on one node): a placement that knows nothing of the links, to measure the planner
    against."""
    import random

    nodes = _eligible_nodes(topology, mesh, require_labels, None)
    tree, costs, _, lb = _setup(nodes, mesh, profile, bandwidths or topology.bandwidths)
    slots = [i for i in range(len(tree.nodes)) for _ in range(tree.cap[i])]
    random.Random(seed).shuffle(slots)
    nor = expand_units(slots[:mesh.pp * mesh.dp], mesh.tp)
    _, naive_s, _ = _naive(tree, costs, mesh)
    total = evaluate(tree, costs, mesh, nor).total
    return _make_plan(tree, costs, mesh, profile, nor, naive_s, lb, meets(total, lb), f"shuffled (seed {seed})")


def brute_force_plan(topology: Topology, mesh: MeshPlan, profile: CommProfile, *,
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
    tree, costs, _, _ = _setup(nodes, mesh, profile, bandwidths or topology.bandwidths)
    if mesh.dp_replicate > 1:  # HSDP's cost is not a function of per-node counts: every assignment
        optimum, units = brute_force_units(tree, costs, mesh)
    else:
        unit_cost, units = brute_force_assignment(tree, costs, mesh.units)
        optimum = unit_cost + costs.tp_floor
    _, naive_s, _ = _naive(tree, costs, mesh)
    return _make_plan(tree, costs, mesh, profile, expand_units(units, mesh.tp), naive_s, optimum, True,
                      "brute force (exhaustive)")


class Planner:
    """Chooses rank -> (node, slot) for a pp x dp x tp mesh by the cost model (``cost_model``);
    each tp group on one node, the pp x dp units placed as below.

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

    def plan(self, mesh: MeshPlan, profile: CommProfile, *,
             require_labels: Optional[Mapping[str, str]] = None,
             market_type: Optional[str] = None) -> Plan:
        nodes = _eligible_nodes(self.topology, mesh, require_labels, market_type)
        tree, costs, relax, lower_bound = _setup(nodes, mesh, profile, self.bandwidths)
        deadline = time.monotonic() + self.time_budget_s
        naive_nor, naive_s, naive_whole = _naive(tree, costs, mesh)
        # the pp x dp units under the plain table (exact without HSDP, its floor with it); the
        # exact search's budget is its own, as its own phase
        found = search_units(tree, costs.unit_view(), mesh.units, deadline=deadline, level_plans=self.level_plans,
                             exact_states=self.exact_search_states,
                             exact_max_units=self.exact_search_max_slots // mesh.tp,
                             exact_budget_s=self.time_budget_s, relax=relax)
        lower_bound = max(lower_bound, found.bound + costs.tp_floor)
        candidates = [(found.node_of_unit, found.method)]
        if mesh.dp_replicate > 1:
            candidates = hsdp_candidates(nodes, tree, costs, mesh, candidates[0], deadline)
        best: Optional[Tuple[float, List[int], str]] = None
        for units, method in candidates:
            nor = expand_units(units, mesh.tp)
            total = evaluate(tree, costs, mesh, nor).total
            if best is None or improves(total, best[0]):
                best = (total, nor, method)
        if mesh.dp_replicate > 1 and not meets(best[0], lower_bound):
            units, changed = refine(tree, costs, mesh, best[1][::mesh.tp], deadline + self.time_budget_s)
            if changed:
                nor = expand_units(units, mesh.tp)
                best = (evaluate(tree, costs, mesh, nor).total, nor, best[2] + ", refined by unit swaps")
        if naive_whole and improves(naive_s, best[0]):
            best = (naive_s, naive_nor, "naive order (no better packing found)")
        optimal = meets(best[0], lower_bound)
        method = best[2] + (" (optimal)" if optimal else "")
        return _make_plan(tree, costs, mesh, profile, best[1], naive_s, lower_bound, optimal, method)
