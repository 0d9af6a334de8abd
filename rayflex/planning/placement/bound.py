"""The planner's lower bound and level plans: a dynamic program over stages in a relaxation.

Each stage gets a tree level for its FSDP group (its row level), each boundary the level at
which consecutive stages are "tied", i.e. hold equal counts per subtree; capacity is checked
per tied run. Because the cost model depends only on per-node counts (see ``cost_model``),
every real plan is a path of this DP with the same cost, so its minimum is a lower bound:
a plan that reaches it is optimal. The DP's paths, cheapest first, are the level plans the
packer (``placement_packer``) tries to realise.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Dict, List, Optional, Tuple

from rayflex.mesh.plan import MeshPlan
from rayflex.planning.cost_model import NodeTree, TierCosts


class Relaxation:
    """Lower bound and level plans. State after stage s: (row level r, run lengths L0, L1, L2,
    stages so far whose group fits a node / rack / zone).

    A run at level l is a maximal stretch of stages whose boundaries are tied at level <= l;
    its stages hold equal counts in every level-l subtree and share their level-max(r, l)
    subtree, so that subtree must hold run-length chunks for all dp pipelines. Every real
    plan maps to a path of this DP with the same cost, hence the DP minimum is a lower bound.
    """

    def __init__(self, tree: NodeTree, costs: TierCosts, mesh: MeshPlan):
        self.tree, self.costs, self.mesh = tree, costs, mesh
        self._units: Dict[Tuple[int, int], List[List[int]]] = {}
        self._ok: Dict[Tuple[int, int, int], bool] = {}

    def capok(self, unit_level: int, home_level: int, k: int) -> bool:
        """Some level-home subtree fits dp chunks of k ranks kept within level-unit subtrees."""
        key = (unit_level, home_level, k)
        if key not in self._ok:
            units = self._units.get((unit_level, home_level))
            if units is None:
                t = self.tree
                caps: Dict[int, Dict[int, int]] = {}
                for i in range(t.n):
                    h, u = t.keys[home_level][i], t.keys[unit_level][i]
                    caps.setdefault(h, {})
                    caps[h][u] = caps[h].get(u, 0) + t.cap[i]
                units = self._units[(unit_level, home_level)] = [list(v.values()) for v in caps.values()]
            self._ok[key] = any(sum(c // k for c in us) >= self.mesh.dp for us in units)
        return self._ok[key]

    def _moves(self, state: tuple) -> List[Tuple[int, int, tuple]]:
        """Feasible (row level, boundary level, next state) from ``state``."""
        moves = self._move_cache.get(state)
        if moves is None:
            moves = []
            r0, runs, used = state[0], state[1:4], state[4:]
            for r in self.rows_ok:
                new_used = self._count(used, r)
                if new_used is None:
                    continue
                for b in range(4):
                    new_runs = []
                    for lv in range(3):
                        if lv < b:
                            new_runs.append(1)
                        elif max(r, lv) == max(r0, lv) and self.capok(lv, max(r, lv), runs[lv] + 1):
                            new_runs.append(runs[lv] + 1)
                        else:
                            break
                    else:
                        moves.append((r, b, (r, *new_runs, *new_used)))
            self._move_cache[state] = moves
        return moves

    def _count(self, used: tuple, r: int) -> Optional[tuple]:
        out = []
        for lv in range(3):
            if self._row_caps[lv] is None:
                out.append(0)
            elif used[lv] + (r <= lv) > self._row_caps[lv]:
                return None
            else:
                out.append(used[lv] + (r <= lv))
        return tuple(out)

    def _useful(self, r: int, b: int) -> bool:
        return r in self._useful_r and b in self._useful_b

    def solve(self) -> float:
        """The lower bound; also prepares ``plans()``."""
        pp, f, c = self.mesh.pp, self.costs.fsdp, self.costs.p2p
        self._move_cache: Dict[tuple, list] = {}
        self.rows_ok = [r for r in range(4) if self.capok(0, r, 1)]
        # a level that costs the same as the next looser one for every stage (dp=1, equal
        # bandwidths) is never needed: moving all its stages up one level keeps the cost and
        # every constraint of the relaxation, and is easier to pack
        self._useful_r = {r for r in self.rows_ok if r == 3 or any(f[s][r] < f[s][r + 1] for s in range(pp))}
        self._useful_b = {b for b in range(4) if b == 3 or c[b] < c[b + 1]}
        # stages whose group sits in one level-l subtree are at most sum(floor(cap / dp)) over
        # those subtrees; counted only where that can bind (pp stages never exceed it otherwise)
        self._row_caps = []
        for lv in range(3):
            room = sum(sum(self.tree.cap[i] for i in ns) // self.mesh.dp
                       for ns in self.tree.subtrees(lv).values())
            self._row_caps.append(room if room < pp else None)
        layers = [{(r, 1, 1, 1, *self._count((0, 0, 0), r)) for r in self._useful_r
                   if self._count((0, 0, 0), r) is not None}]
        for s in range(1, pp):
            layers.append({nxt for st in layers[-1] for r, b, nxt in self._moves(st) if self._useful(r, b)})
        # to_go[s][state]: cheapest completion of stages s+1.. from state at stage s
        self.to_go: List[Dict[tuple, float]] = [dict() for _ in range(pp)]
        self.to_go[pp - 1] = {st: 0.0 for st in layers[pp - 1]}
        for s in range(pp - 2, -1, -1):
            nxt = self.to_go[s + 1]
            for st in layers[s]:
                vals = [f[s + 1][r] + c[b] + nxt[n] for r, b, n in self._moves(st)
                        if n in nxt and self._useful(r, b)]
                if vals:
                    self.to_go[s][st] = min(vals)
        self.bound = min(f[0][st[0]] + v for st, v in self.to_go[0].items())
        return self.bound

    def plans(self):
        """Level plans (relaxed cost, row levels, boundary levels) in increasing relaxed cost.

        A* over stages with the exact completion values as heuristic, so complete plans come
        out in order; among equal estimates, looser levels first (easier to pack).
        """
        f, c, pp = self.costs.fsdp, self.costs.p2p, self.mesh.pp
        heap, tick = [], itertools.count()
        for st, v in self.to_go[0].items():
            heapq.heappush(heap, (f[0][st[0]] + v, -st[0], next(tick), 0, f[0][st[0]], st, (st[0],), ()))
        while heap:
            est, loose, _, s, g, st, rows, bnds = heapq.heappop(heap)
            if s == pp - 1:
                yield est, list(rows), list(bnds)
                continue
            nxt = self.to_go[s + 1]
            for r, b, n in self._moves(st):
                if n in nxt and self._useful(r, b):
                    g2 = g + f[s + 1][r] + c[b]
                    heapq.heappush(heap, (g2 + nxt[n], loose - r - b, next(tick), s + 1, g2, n,
                                          rows + (r,), bnds + (b,)))

