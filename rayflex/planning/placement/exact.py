"""Exact placement by memoised search, for small clusters: the planner's last resort and the
reference the tests and the benchmark check it against.

``exact_counts`` searches per-stage node counts (all the cost model depends on) and is what
``Planner`` runs when no level plan packs at the lower bound. ``brute_force_assignment``
searches rank -> node assignments directly, sharing only the cost table and the symmetry
key with the planner, so that agreeing with it means something. ``brute_force_units`` is
the reference for HSDP, whose cost is not a function of per-node counts: it tries every
unit -> node assignment and prices each with ``evaluate``.
"""

from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

from rayflex.mesh.plan import MeshPlan
from rayflex.planning.cost_model import NodeTree, TierCosts, evaluate, expand_units, improves, meets
from rayflex.planning.topology import tier_between


class _SearchBudgetExceeded(Exception):
    pass


def _nonincreasing(m: int, top: int, total: int):
    """Non-increasing tuples of length m, values in [0, top], sum <= total."""
    if m == 0:
        yield ()
        return
    for x in range(min(top, total), -1, -1):
        for rest in _nonincreasing(m - 1, x, total - x):
            yield (x,) + rest


def _canon(tree_zone, tree_dom, s: int, per_node: Sequence[tuple]) -> tuple:
    """State key invariant under relabelling nodes, racks and zones (tree automorphisms)."""
    zones: Dict[int, Dict[int, list]] = {}
    for i, v in enumerate(per_node):
        zones.setdefault(tree_zone[i], {}).setdefault(tree_dom[i], []).append(v)
    return (s, tuple(sorted(tuple(sorted(tuple(sorted(d)) for d in z.values())) for z in zones.values())))


def exact_counts(tree: NodeTree, costs: TierCosts, mesh: MeshPlan, max_states: int,
                 deadline: float = math.inf) -> Optional[Tuple[float, List[Dict[int, int]]]]:
    """Optimal per-stage node counts by memoised search; None past ``max_states`` or deadline.

    Nodes with the same rack, zone, free slots and previous-stage count are interchangeable,
    so a stage's counts are enumerated as non-increasing tuples per such class.
    """
    pp, dp, n = mesh.pp, mesh.dp, tree.n
    memo: Dict[tuple, float] = {}

    def options(rem, prev):
        groups: Dict[tuple, List[int]] = {}
        for i in range(n):
            if rem[i] > 0:
                groups.setdefault((tree.zone[i], tree.dom[i], rem[i], prev[i]), []).append(i)
        glist = list(groups.values())
        suffix = [0] * (len(glist) + 1)
        for gi in range(len(glist) - 1, -1, -1):
            suffix[gi] = suffix[gi + 1] + len(glist[gi]) * rem[glist[gi][0]]
        acc: Dict[int, int] = {}

        def rec(gi, left):
            if left == 0:
                yield dict(acc)
                return
            if suffix[gi] < left:
                return
            g = glist[gi]
            for seq in _nonincreasing(len(g), rem[g[0]], left):
                for i, x in zip(g, seq):
                    if x:
                        acc[i] = x
                yield from rec(gi + 1, left - sum(seq))
                for i, x in zip(g, seq):
                    acc.pop(i, None)

        return rec(0, dp)

    def step(s, rem, prev, c):
        cost = costs.fsdp[s][tree.span_level(c)]
        if s:
            cost += costs.p2p[tree.tie_level({i: x for i, x in enumerate(prev) if x}, c)]
        new_rem, new_prev = list(rem), [0] * n
        for i, x in c.items():
            new_rem[i] -= x
            new_prev[i] = x
        return cost, tuple(new_rem), tuple(new_prev)

    def f(s, rem, prev):
        if s == pp:
            return 0.0
        key = _canon(tree.zone, tree.dom, s, list(zip(rem, prev)))
        if key in memo:
            return memo[key]
        if len(memo) >= max_states or time.monotonic() > deadline:
            raise _SearchBudgetExceeded
        best = math.inf
        for c in options(rem, prev):
            cost, nrem, nprev = step(s, rem, prev, c)
            if cost >= best:
                continue
            cost += f(s + 1, nrem, nprev)
            best = min(best, cost)
        memo[key] = best
        return best

    rem, prev = tuple(tree.cap), tuple([0] * n)
    try:
        total = f(0, rem, prev)
        rows = []
        for s in range(pp):
            target = f(s, rem, prev)
            for c in options(rem, prev):
                cost, nrem, nprev = step(s, rem, prev, c)
                if meets(cost + f(s + 1, nrem, nprev), target):
                    rows.append(c)
                    rem, prev = nrem, nprev
                    break
    except _SearchBudgetExceeded:
        return None
    return total, rows


def brute_force_assignment(tree: NodeTree, costs: TierCosts, mesh: MeshPlan) -> Tuple[float, List[int]]:
    """The optimal cost and a rank -> node index assignment achieving it, by exhaustive search.

    Independent of the planner's count reduction: it enumerates, stage by stage, which node
    every pipeline's next rank goes to, and prices links pair by pair (``tier_between``, not
    the tree). It merges states only by exact symmetries: pipelines on the same node so far
    are interchangeable for the future (so their next nodes are chosen as a multiset), and
    states equal up to relabelling nodes, racks and zones have the same optimal future.
    Exponential: ``brute_force_plan`` admits only tiny topologies.
    """
    nodes = tree.nodes
    n, pp, dp = len(nodes), mesh.pp, mesh.dp
    lvl = [[int(tier_between(a, b)) for b in nodes] for a in nodes]
    memo: Dict[tuple, float] = {}

    def multisets(rem, m, start):
        if m == 0:
            yield []
            return
        for j in range(start, n):
            for c in range(min(rem[j], m), 0, -1):
                rem[j] -= c
                for tail in multisets(rem, m - c, j + 1):
                    yield [(j, c)] + tail
                rem[j] += c

    def pairings(groups, rem):
        if not groups:
            yield []
            return
        p, m = groups[0]
        for ms in multisets(rem, m, 0):  # rem stays reduced by ms while ms is out
            for tail in pairings(groups[1:], rem):
                yield [(p, ms)] + tail

    def options(s, rem, prev):
        groups = [(None, dp)] if s == 0 else [(p, m) for p, m in enumerate(prev) if m]
        for choice in pairings(groups, list(rem)):
            used = sorted({j for _, ms in choice for j, _ in ms})
            cost = costs.fsdp[s][max(lvl[a][b] for a in used for b in used)]
            if s:
                cost += costs.p2p[max(lvl[p][j] for p, ms in choice for j, _ in ms)]
            count = [0] * n
            for _, ms in choice:
                for j, c in ms:
                    count[j] += c
            yield cost, choice, tuple(r - c for r, c in zip(rem, count)), tuple(count)

    def f(s, rem, prev):
        if s == pp:
            return 0.0
        key = _canon(tree.zone, tree.dom, s, list(zip(rem, prev)))
        if key not in memo:
            best = math.inf
            for cost, _, nrem, nprev in options(s, rem, prev):
                if cost < best:
                    best = min(best, cost + f(s + 1, nrem, nprev))
            memo[key] = best
        return memo[key]

    rem, prev = tuple(tree.cap), tuple([0] * n)
    cols: List[int] = []
    out: List[int] = []
    for s in range(pp):
        target = f(s, rem, prev)
        for cost, choice, nrem, nprev in options(s, rem, prev):
            if meets(cost + f(s + 1, nrem, nprev), target):
                break
        if s == 0:
            cols = [j for _, ms in choice for j, c in ms for _ in range(c)]
        else:
            queues = {p: [j for j, c in ms for _ in range(c)] for p, ms in choice}
            cols = [queues[p].pop(0) for p in cols]
        out.extend(cols)
        rem, prev = nrem, nprev
    return f(0, tuple(tree.cap), tuple([0] * n)), out


def brute_force_units(tree: NodeTree, costs: TierCosts, mesh: MeshPlan,
                      max_leaves: int = 200_000) -> Tuple[float, List[int]]:
    """The optimal cost and a unit -> node assignment achieving it, trying every assignment of
    the mesh's pp x dp units (tp groups) to nodes and pricing the expanded ranks with
    ``evaluate``. The only merge: a node not used yet is interchangeable with any other unused
    node of its rack with as many free units (relabelling them is a tree automorphism).
    Exponential: for tiny meshes (ValueError past ``max_leaves`` assignments)."""
    units = mesh.pp * mesh.dp
    rem = list(tree.cap)
    used = [False] * tree.n
    chosen: List[int] = []
    best: List = [math.inf, None]
    leaves = [0]

    def go(u: int) -> None:
        if u == units:
            leaves[0] += 1
            if leaves[0] > max_leaves:
                raise ValueError(f"brute force past {max_leaves} assignments: use a smaller mesh")
            total = evaluate(tree, costs, mesh, expand_units(chosen, mesh.tp)).total
            if improves(total, best[0]):
                best[0], best[1] = total, list(chosen)
            return
        fresh_seen = set()
        for i in range(tree.n):
            if rem[i] == 0:
                continue
            if not used[i]:
                key = (tree.zone[i], tree.dom[i], rem[i])
                if key in fresh_seen:
                    continue
                fresh_seen.add(key)
            was = used[i]
            rem[i] -= 1
            used[i] = True
            chosen.append(i)
            go(u + 1)
            chosen.pop()
            used[i] = was
            rem[i] += 1

    go(0)
    if best[1] is None:
        raise ValueError(f"no assignment of {units} units to {sum(tree.cap)} unit slots")
    return best[0], best[1]
