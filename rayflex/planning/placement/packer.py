"""Packs a level plan onto nodes: per-stage node counts that honour its levels.

The level plans come from the relaxation (``placement_bound``), cheapest first; when the
first one packs, the plan meets the lower bound and is optimal. The packer is a heuristic
(runs of node-tied stages as chunks, best-fit homes, first fit in rack order, bounded
backtracking); when it fails the planner tries further level plans, looser ones and, on
small clusters, the exact search (``placement_exact``).
"""

from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

from rayflex.mesh.plan import MeshPlan
from rayflex.planning.cost_model import NodeTree


def realize(tree: NodeTree, mesh: MeshPlan, rows: Sequence[int], bnds: Sequence[int],
           robust: bool = False, budget: int = 4000,
           deadline: float = math.inf) -> Optional[List[Dict[int, int]]]:
    """Per-stage node counts honouring the level plan, or None if the packer finds none.

    Stages tied at node level (boundary level 0) form a run placed as dp chunks of
    run-length ranks, one chunk per pipeline, each on one node. A run's home is a level-r
    subtree inside the subtree it is tied to (the previous run's); homes are tried nearest
    the previous run first, then best fit, and chunks go first fit (previous run's nodes,
    then rack order; or smallest free space first). The packer backtracks over these
    choices within ``budget`` placements and the ``deadline``. ``robust`` also lets a run
    escalate to a slower level instead of failing, so a plan of untied stages always realises.
    """
    pp, dp = mesh.pp, mesh.dp
    rem = list(tree.cap)
    runs: List[List[int]] = [[0]]
    for s in range(1, pp):
        (runs[-1].append(s) if bnds[s - 1] == 0 else runs.append([s]))
    chosen: List[Dict[int, int]] = []
    tries = [budget]

    def go(g: int, prev: Optional[Dict[int, int]]) -> bool:
        if g == len(runs):
            return True
        run = runs[g]
        k, r = len(run), rows[run[0]]
        t = bnds[run[0] - 1] if run[0] > 0 else 3
        levels = [(r, t)] + ([(lv, 3) for lv in range(r + 1, 4)] if robust else [])
        # look ahead: stages tied to this run at level t_next need room in the same units
        t_next = bnds[run[-1]] if run[-1] < pp - 1 else 3
        chain, h = k, g + 1
        while h < len(runs) and bnds[runs[h][0] - 1] <= t_next < 3:
            chain, h = chain + len(runs[h]), h + 1
        ahead = (t_next, chain) if chain > k else None
        for lv, tie in levels:
            for placed in _run_options(tree, rem, dp, k, lv, tie, prev, ahead):
                tries[0] -= 1
                if tries[0] < 0 or (not robust and time.monotonic() > deadline):
                    return False
                for i, ch in placed.items():
                    rem[i] -= ch * k
                chosen.append(placed)
                if go(g + 1, placed):
                    return True
                chosen.pop()
                for i, ch in placed.items():
                    rem[i] += ch * k
        return False

    if not go(0, None):
        return None
    counts: List[Dict[int, int]] = [dict() for _ in range(pp)]
    for run, placed in zip(runs, chosen):
        for s in run:
            counts[s] = dict(placed)
    return counts


def _run_options(tree: NodeTree, rem: List[int], dp: int, k: int, r: int, t: int,
                 prev: Optional[Dict[int, int]], ahead: Optional[Tuple[int, int]] = None):
    """Placements (node -> chunks of k ranks) for one run, most promising first.

    ``ahead = (level, chain)``: the following runs are tied to this one at ``level`` and the
    tied chain holds ``chain`` ranks per pipeline, so fills that leave each such unit room
    for the whole chain come first.
    """
    keys = tree.keys
    if prev is None or t >= 3:
        homes = tree.subtrees(r)
    else:
        anchor_level = max(r, t)
        anchors = {keys[anchor_level][i] for i in prev}
        if len(anchors) != 1:
            return
        anchor = anchors.pop()
        homes = {h: ns for h, ns in tree.subtrees(r).items() if keys[anchor_level][ns[0]] == anchor}
    # finer tie than the home: each level-t unit must take as many chunks as prev put there
    need: Optional[Dict[int, int]] = None
    if prev is not None and t < r:
        need = {}
        for i, ch in prev.items():
            need[keys[t][i]] = need.get(keys[t][i], 0) + ch
    ranked = []
    for ns in homes.values():
        fits = sum(rem[i] // k for i in ns)
        if fits < dp:
            continue
        if need is not None:
            per_unit: Dict[int, int] = {}
            for i in ns:
                per_unit[keys[t][i]] = per_unit.get(keys[t][i], 0) + rem[i] // k
            if any(per_unit.get(u, 0) < c for u, c in need.items()):
                continue
        near = sum(prev.get(i, 0) for i in ns) if prev else 0
        ranked.append(((-near, fits, ns[0]), ns))
    ranked.sort(key=lambda x: x[0])
    targets = need if need is not None else {None: dp}
    free: Dict[Tuple[int, int], int] = {}
    for ns in homes.values():
        for i in ns:
            for lv in (1, 2):
                free[lv, keys[lv][i]] = free.get((lv, keys[lv][i]), 0) + rem[i]
    orders = (
        lambda i: (0 if prev and i in prev else 1),  # near the previous run, rack order
        lambda i: (0 if prev and i in prev else 1, rem[i] // k, rem[i]),  # tightest node first
        lambda i: (free[2, keys[2][i]], free[1, keys[1][i]], rem[i]),  # smallest fragments first
    )
    limits = [None]
    if ahead is not None:
        room: Dict[int, int] = {}
        for i in range(tree.n):
            room[keys[ahead[0]][i]] = room.get(keys[ahead[0]][i], 0) + rem[i]
        limits.insert(0, {u: v // ahead[1] for u, v in room.items()})
    for _, ns in ranked:
        seen = []
        for limit in limits:
            for order_key in orders:
                placed = _fill(keys, rem, k, t, targets, sorted(ns, key=order_key), limit,
                               ahead[0] if ahead else 0)
                if placed is not None and placed not in seen:
                    seen.append(placed)
                    yield placed


def _fill(keys, rem: List[int], k: int, t: int, targets: Dict, ordered: List[int],
          limit: Optional[Dict[int, int]], limit_level: int) -> Optional[Dict[int, int]]:
    """First-fit chunks into ``ordered`` nodes, per tie unit (``targets``) and unit limit."""
    placed: Dict[int, int] = {}
    used: Dict[int, int] = {}
    for u, c in targets.items():
        left = c
        for i in ordered:
            if u is not None and keys[t][i] != u:
                continue
            take = min(rem[i] // k, left)
            if limit is not None:
                lu = keys[limit_level][i]
                take = min(take, limit.get(lu, 0) - used.get(lu, 0))
                used[lu] = used.get(lu, 0) + max(take, 0)
            if take > 0:
                placed[i] = take
                left -= take
                if not left:
                    break
        if left:
            return None
    return placed

