"""The planner's search over pp x dp units (tp groups) on a tree of unit capacities, with a
plain-FSDP cost table: level plans from the relaxation, cheapest first, realised by the
packer; looser fallbacks; on small clusters the exact search.

Its result is optimal for the table it is given whenever it meets the returned bound; the
bound is the relaxation's, raised to the exact optimum when the exact search ran. The
planner runs it on the real table (no HSDP: exact up to the tp constant) and, with HSDP, on
the per-stage floor table (a bound) and on the coarse shard-/replica-group problems
(``placement_hsdp``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import List, Optional

from rayflex.mesh.plan import MeshPlan
from rayflex.planning.cost_model import REL_TOL, NodeTree, TierCosts, evaluate, improves, meets, \
    ranks_from_counts
from rayflex.planning.placement.bound import Relaxation
from rayflex.planning.placement.exact import exact_counts
from rayflex.planning.placement.packer import realize


@dataclass(frozen=True)
class UnitPlan:
    cost: float  # under the table searched
    node_of_unit: List[int]
    method: str
    bound: float  # lower bound on the table's optimum

    @property
    def optimal(self) -> bool:
        return meets(self.cost, self.bound)


def search_units(tree: NodeTree, costs: TierCosts, mesh: MeshPlan, *, deadline: float, level_plans: int = 64,
                 exact_states: int = 0, exact_max_units: int = 64, exact_budget_s: float = 1.0,
                 relax: Optional[Relaxation] = None) -> UnitPlan:
    """The best unit -> node assignment found for ``mesh`` (tp = 1, no HSDP) under ``costs``.

    ``relax``: a solved relaxation of the same tree and table (the planner's), else one is
    built here. The exact search runs when no candidate meets the bound, on at most
    ``exact_max_units`` units and ``exact_states`` states (0: never).
    """
    if relax is None:
        relax = Relaxation(tree, costs, mesh)
        relax.solve()
    best: Optional[tuple] = None

    def consider(counts, method) -> float:
        """Keep the counts' plan if it beats the best; returns its cost (inf for none)."""
        nonlocal best
        if counts is None:
            return math.inf
        units = ranks_from_counts(tree, counts, mesh.dp)
        total = evaluate(tree, costs, mesh, units).total
        if best is None or improves(total, best[0]):
            best = (total, units, method)
        return total

    # level plans cheapest first; stop once the next one cannot beat what is realised
    first = None
    for tried, (relaxed, rows, bnds) in enumerate(relax.plans()):
        first = first or (rows, bnds)
        if (tried >= level_plans or (best is not None and relaxed >= best[0] * (1 - REL_TOL))
                or (tried and time.monotonic() > deadline)):
            break
        consider(realize(tree, mesh, rows, bnds, deadline=deadline), "hierarchical")
    bound = relax.bound
    if best is None or not meets(best[0], bound):
        consider(realize(tree, mesh, *first, robust=True), "hierarchical (levels relaxed)")
        alone = [relax.rows_ok[0]] * mesh.pp
        consider(realize(tree, mesh, alone, [3] * (mesh.pp - 1), robust=True),
                 "hierarchical (stages packed one by one)")
    if not meets(best[0], bound) and exact_states > 0 and sum(tree.cap) <= exact_max_units:
        found = exact_counts(tree, costs, mesh, exact_states, time.monotonic() + exact_budget_s)
        if found is not None:
            total = consider(found[1], "exact search")
            bound = max(bound, min(total, best[0]))
    return UnitPlan(best[0], best[1], best[2], bound)
