"""Where each rank goes: the Planner (rank -> node and slot, with a cost model) and the
PlacementManager that makes Ray honour the plan.

Rank layout (fixed; the worker relies on it): world = pp * dp, DeviceMesh dims ("pp", "dp")
row-major, so ``rank = stage * dp + dp_index``. The dp group of stage s is ranks
``s*dp .. s*dp+dp-1`` (one FSDP group); pipeline d is ranks ``d, dp+d, 2*dp+d, ...``.

Cost model (seconds of communication per training step, per rank, no overlap, no contention):

* FSDP, stage s: ``n_coll * (dp-1)/dp * P_s / bw(tier of the group)`` where ``P_s`` is the
  stage's parameter bytes, ``n_coll`` is 2 (all-gather once, reduce-scatter once; the default
  when pipelining, ``reshard_after_forward=False``) or 3 (all-gather again in backward), the
  ring term ``(dp-1)/dp * P_s`` is what each rank sends per collective, and the group's tier is
  that of its worst pair (a ring through the group crosses its slowest link).
* Pipeline, boundary s -> s+1: ``2 * A * M / bw(tier)`` for each pipeline (activations forward
  and their gradients backward, ``A`` bytes per microbatch, ``M`` microbatches per step).
* Aggregation: ``sum over stages of FSDP time + sum over boundaries of the slowest pipeline's
  time at that boundary``. Stages are charged in sequence (their collectives sit at different
  points of the schedule and share nothing); a boundary is charged at its slowest pipeline
  because every stage advances in lock step with its FSDP group, so the dp ranks of stage s+1
  wait for the slowest activation crossing into any of them. (This is an upper bound on
  "slowest pipeline's sum"; it never rewards hiding slow links by stacking them on one
  pipeline.) Its key property is that the cost depends only on how many ranks of each stage
  every node holds: the tier of a group is fixed by its support, and the worst link of a
  boundary is the smallest tree level at which two consecutive stages have equal per-subtree
  counts (a hierarchical matching then achieves it). That is what makes exact planning and a
  tight lower bound tractable.

Planning: a dynamic program over stages in a relaxation (each stage gets a tree level for its
FSDP group; each boundary the level at which consecutive stages are "tied", i.e. hold equal
counts per subtree; capacity is checked per tied run) gives a lower bound and a level plan;
a hierarchical packer realises it (runs of node-tied stages as chunks, best-fit homes, first
fit in rack order). Reaching the bound proves optimality. Otherwise small instances get an
exact memoised search over per-node counts, and large ones keep the best realised candidate,
with the gap to the bound stated in the plan's explanation.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from rayflex.errors import ConfigError, PlacementError
from rayflex.platform.topology import (
    MARKET_LABEL,
    NODE_ID_LABEL,
    Bandwidths,
    LinkTier,
    NodeInfo,
    Topology,
    tier_between,
)

_REL = 1e-9  # relative tolerance when comparing modeled costs


# --------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MeshShape:
    """A pp x dp mesh; ``rank = stage * dp + dp_index``."""

    pp: int
    dp: int

    def __post_init__(self):
        for name in ("pp", "dp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"MeshShape.{name}", f"must be an integer >= 1, got {v!r}",
                                  "use pp=1 for no pipeline and dp=1 for no data parallelism")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    def rank(self, stage: int, dp_index: int) -> int:
        return stage * self.dp + dp_index

    def coords(self, rank: int) -> Tuple[int, int]:
        return divmod(rank, self.dp)


@dataclass(frozen=True)
class CommProfile:
    """Bytes the model moves per step: what the cost model needs and nothing more."""

    stage_param_bytes: Tuple[float, ...]
    activation_bytes: float
    microbatches: int = 1
    reshard_after_forward: bool = False

    def __post_init__(self):
        object.__setattr__(self, "stage_param_bytes", tuple(float(b) for b in self.stage_param_bytes))
        if not self.stage_param_bytes or any(b < 0 for b in self.stage_param_bytes):
            raise ConfigError("CommProfile.stage_param_bytes", "must list one byte count >= 0 per stage",
                              "give the parameter bytes of each pipeline stage")
        if self.activation_bytes < 0 or self.microbatches < 1:
            raise ConfigError("CommProfile", f"activation_bytes={self.activation_bytes} and "
                              f"microbatches={self.microbatches} must be >= 0 and >= 1",
                              "give bytes per microbatch crossing a stage boundary and microbatches per step")

    @property
    def fsdp_collectives(self) -> int:
        return 3 if self.reshard_after_forward else 2

    @classmethod
    def uniform(cls, pp: int, total_param_bytes: float, activation_bytes: float,
                microbatches: int = 1, reshard_after_forward: bool = False) -> "CommProfile":
        """Parameters split evenly over ``pp`` stages."""
        return cls(tuple([total_param_bytes / pp] * pp), activation_bytes, microbatches,
                   reshard_after_forward)


# --------------------------------------------------------------------------------------
# The topology as a tree of integer ids, and the cost model on it
# --------------------------------------------------------------------------------------
class _Tree:
    """Eligible nodes as a 4-level tree: node (0) < domain (1) < zone (2) < cluster (3)."""

    def __init__(self, nodes: Sequence[NodeInfo]):
        self.nodes = list(nodes)
        self.n = len(self.nodes)
        self.cap = [nd.slots for nd in self.nodes]
        zones: Dict = {}
        doms: Dict = {}
        self.zone = [zones.setdefault(nd.zone, len(zones)) for nd in self.nodes]
        self.dom = [doms.setdefault(nd.domain_key() or ("solo", nd.node_id), len(doms))
                    for nd in self.nodes]
        self.keys = (list(range(self.n)), self.dom, self.zone, [0] * self.n)
        # hierarchical order: zones, then domains, in order of first appearance
        self.order = sorted(range(self.n), key=lambda i: (self.zone[i], self.dom[i], i))

    def level(self, i: int, j: int) -> int:
        if i == j:
            return 0
        if self.zone[i] != self.zone[j]:
            return 3
        return 1 if self.dom[i] == self.dom[j] else 2

    def subtrees(self, level: int) -> Dict[int, List[int]]:
        """Level-``level`` subtree id -> its node indices in hierarchical order."""
        out: Dict[int, List[int]] = {}
        for i in self.order:
            out.setdefault(self.keys[level][i], []).append(i)
        return out

    def span_level(self, nodes) -> int:
        """Tree level of the smallest subtree holding all ``nodes`` (worst pair, ultrametric)."""
        it = iter(nodes)
        first = next(it)
        worst = 0
        for j in it:
            lv = self.level(first, j)
            if lv > worst:
                worst = lv
                if lv == 3:
                    break
        return worst

    def tie_level(self, a: Mapping[int, int], b: Mapping[int, int]) -> int:
        """Smallest level at which count vectors ``a`` and ``b`` agree on every subtree."""
        for lv in range(3):
            key = self.keys[lv]
            agg: Dict[int, int] = {}
            for i, c in a.items():
                agg[key[i]] = agg.get(key[i], 0) + c
            for i, c in b.items():
                agg[key[i]] = agg.get(key[i], 0) - c
            if not any(agg.values()):
                return lv
        return 3


class _Costs:
    """Per-tier seconds: ``fsdp[s][level]`` for stage s's group and ``p2p[level]`` per boundary."""

    def __init__(self, mesh: MeshShape, profile: CommProfile, bw: Bandwidths):
        if len(profile.stage_param_bytes) != mesh.pp:
            raise ConfigError("CommProfile.stage_param_bytes",
                              f"has {len(profile.stage_param_bytes)} entries for pp={mesh.pp}",
                              "give one parameter byte count per pipeline stage")
        ring = profile.fsdp_collectives * (mesh.dp - 1) / mesh.dp
        self.fsdp = [[ring * p / bw.of(t) for t in LinkTier] for p in profile.stage_param_bytes]
        self.p2p = [2.0 * profile.activation_bytes * profile.microbatches / bw.of(t) for t in LinkTier]


@dataclass(frozen=True)
class _Eval:
    total: float
    fsdp_s: Tuple[float, ...]
    p2p_s: Tuple[float, ...]
    row_levels: Tuple[int, ...]
    boundary_levels: Tuple[int, ...]


def _evaluate(tree: _Tree, costs: _Costs, mesh: MeshShape, node_of_rank: Sequence[int]) -> _Eval:
    """The modeled seconds of an explicit rank -> node assignment (the ground truth)."""
    pp, dp = mesh.pp, mesh.dp
    rows, bnds = [], []
    for s in range(pp):
        rows.append(tree.span_level(set(node_of_rank[s * dp:(s + 1) * dp])))
    for s in range(pp - 1):
        a, b = node_of_rank[s * dp:(s + 1) * dp], node_of_rank[(s + 1) * dp:(s + 2) * dp]
        bnds.append(max(tree.level(x, y) for x, y in zip(a, b)))
    fsdp = tuple(costs.fsdp[s][lv] for s, lv in enumerate(rows))
    p2p = tuple(costs.p2p[lv] for lv in bnds)
    return _Eval(sum(fsdp) + sum(p2p), fsdp, p2p, tuple(rows), tuple(bnds))


def _columns_from_counts(tree: _Tree, rows: Sequence[Mapping[int, int]], dp: int) -> List[int]:
    """Turn per-stage node counts into rank -> node, matching pipelines hierarchically.

    Stage s+1's ranks are matched to stage s's pipelines inside a node first, then a domain,
    a zone, anywhere: on a tree metric this greedy makes the worst link of every boundary
    the smallest level at which the two stages' counts agree.
    """
    cols = [i for i in tree.order for _ in range(rows[0].get(i, 0))]
    out = list(cols)
    for counts in rows[1:]:
        need = {i: c for i, c in counts.items() if c}
        new: List[Optional[int]] = [None] * dp
        for d, p in enumerate(cols):
            if need.get(p, 0) > 0:
                new[d] = p
                need[p] -= 1
        for lv in (1, 2, 3):
            key = tree.keys[lv]
            pool: Dict[int, List[int]] = {}
            for i in tree.order:
                if need.get(i, 0) > 0:
                    pool.setdefault(key[i], []).extend([i] * need[i])
            for lst in pool.values():
                lst.reverse()
            for d in range(dp):
                if new[d] is None:
                    lst = pool.get(key[cols[d]])
                    if lst:
                        new[d] = lst.pop()
                        need[new[d]] -= 1
        cols = new  # type: ignore[assignment]
        out.extend(cols)
    return out


# --------------------------------------------------------------------------------------
# Lower bound: dynamic program over stages in the level relaxation
# --------------------------------------------------------------------------------------
class _Relaxation:
    """Lower bound and level plans. State after stage s: (row level r, run lengths L0, L1, L2,
    stages so far whose group fits a node / rack / zone).

    A run at level l is a maximal stretch of stages whose boundaries are tied at level <= l;
    its stages hold equal counts in every level-l subtree and share their level-max(r, l)
    subtree, so that subtree must hold run-length chunks for all dp pipelines. Every real
    plan maps to a path of this DP with the same cost, hence the DP minimum is a lower bound.
    """

    def __init__(self, tree: _Tree, costs: _Costs, mesh: MeshShape):
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

    def _useful(self, s: int, r: int, b: int) -> bool:
        return r in self._useful_r[s] and b in self._useful_b

    def solve(self) -> float:
        """The lower bound; also prepares ``plans()``."""
        pp, f, c = self.mesh.pp, self.costs.fsdp, self.costs.p2p
        self._move_cache: Dict[tuple, list] = {}
        self.rows_ok = [r for r in range(4) if self.capok(0, r, 1)]
        # a level that costs the same as the next looser one is never needed: the looser one
        # is as cheap and only easier to pack (dp=1 makes every FSDP level free, for example)
        self._useful_r = [{r for r in self.rows_ok if r == 3 or f[s][r] < f[s][r + 1]} for s in range(pp)]
        self._useful_b = {b for b in range(4) if b == 3 or c[b] < c[b + 1]}
        # stages whose group sits in one level-l subtree are at most sum(floor(cap / dp)) over
        # those subtrees; counted only where that can bind (pp stages never exceed it otherwise)
        self._row_caps = []
        for lv in range(3):
            room = sum(sum(self.tree.cap[i] for i in ns) // self.mesh.dp
                       for ns in self.tree.subtrees(lv).values())
            self._row_caps.append(room if room < pp else None)
        layers = [{(r, 1, 1, 1, *self._count((0, 0, 0), r)) for r in self._useful_r[0]
                   if self._count((0, 0, 0), r) is not None}]
        for s in range(1, pp):
            layers.append({nxt for st in layers[-1] for r, b, nxt in self._moves(st) if self._useful(s, r, b)})
        # to_go[s][state]: cheapest completion of stages s+1.. from state at stage s
        self.to_go: List[Dict[tuple, float]] = [dict() for _ in range(pp)]
        self.to_go[pp - 1] = {st: 0.0 for st in layers[pp - 1]}
        for s in range(pp - 2, -1, -1):
            nxt = self.to_go[s + 1]
            for st in layers[s]:
                vals = [f[s + 1][r] + c[b] + nxt[n] for r, b, n in self._moves(st)
                        if n in nxt and self._useful(s + 1, r, b)]
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
                if n in nxt and self._useful(s + 1, r, b):
                    g2 = g + f[s + 1][r] + c[b]
                    heapq.heappush(heap, (g2 + nxt[n], loose - r - b, next(tick), s + 1, g2, n,
                                          rows + (r,), bnds + (b,)))


# --------------------------------------------------------------------------------------
# Realiser: pack a level plan onto nodes
# --------------------------------------------------------------------------------------
def _realize(tree: _Tree, mesh: MeshShape, rows: Sequence[int], bnds: Sequence[int],
             robust: bool = False, budget: int = 4000,
             deadline: float = math.inf) -> Optional[List[Dict[int, int]]]:
    """Per-stage node counts honouring the level plan, or None if the packer finds none.

    Stages tied at node level (boundary level 0) form a run placed as dp chunks of
    run-length ranks, one chunk per pipeline, each on one node. A run's home is a level-r
    subtree inside the subtree it is tied to (the previous run's); homes are tried nearest
    the previous run first, then best fit, and chunks go first fit (previous run's nodes,
    then rack order; or smallest free space first). The packer backtracks over these
    choices within ``budget`` placements and the ``deadline``. ``robust`` also lets a run escalate to a slower
    level instead of failing, so a plan of untied stages always realises.
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


def _run_options(tree: _Tree, rem: List[int], dp: int, k: int, r: int, t: int,
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


# --------------------------------------------------------------------------------------
# Exact search over per-node counts (small instances)
# --------------------------------------------------------------------------------------
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


def _exact_counts(tree: _Tree, costs: _Costs, mesh: MeshShape, max_states: int,
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
                if cost + f(s + 1, nrem, nprev) <= target * (1 + _REL) + 1e-15:
                    rows.append(c)
                    rem, prev = nrem, nprev
                    break
    except _SearchBudgetExceeded:
        return None
    return total, rows


# --------------------------------------------------------------------------------------
# Eligibility, the reference placements (naive, brute force) and the Plan
# --------------------------------------------------------------------------------------
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
        lines += [f"  {_short(n)}: {_ranges(rs)}" for n, rs in self.node_ranks().items()]
        return "\n".join(lines)


def _make_plan(tree: _Tree, costs: _Costs, mesh: MeshShape, profile: CommProfile,
               node_of_rank: Sequence[int], naive_s: float, lower_bound: float, optimal: bool,
               method: str, relax: Optional[_Relaxation] = None) -> Plan:
    ev = _evaluate(tree, costs, mesh, node_of_rank)
    slots_used: Dict[int, int] = {}
    slots = []
    for i in node_of_rank:
        slots.append(slots_used.get(i, 0))
        slots_used[i] = slots[-1] + 1
    text = _explain(tree, mesh, profile, node_of_rank, ev, naive_s, lower_bound, optimal, method,
                    relax or _Relaxation(tree, costs, mesh))
    return Plan(mesh, tuple(tree.nodes[i].node_id for i in node_of_rank), tuple(slots), ev.total,
                naive_s, text, lower_bound, optimal, method, ev.fsdp_s, ev.p2p_s)


def modeled_comm_seconds(topology: Topology, mesh: MeshShape, profile: CommProfile,
                         rank_to_node: Sequence[str], bandwidths: Optional[Bandwidths] = None) -> float:
    """Modeled communication seconds per step of any rank -> node id assignment."""
    if len(rank_to_node) != mesh.world_size:
        raise ValueError(f"rank_to_node has {len(rank_to_node)} entries for world size {mesh.world_size}")
    used = set(rank_to_node)
    tree = _Tree([n for n in topology.nodes if n.node_id in used])
    index = {nd.node_id: i for i, nd in enumerate(tree.nodes)}
    missing = used - set(index)
    if missing:
        raise ValueError(f"rank_to_node names nodes not in the topology: {sorted(missing)[:5]}")
    costs = _Costs(mesh, profile, bandwidths or topology.bandwidths)
    return _evaluate(tree, costs, mesh, [index[n] for n in rank_to_node]).total


def _naive_assignment(tree: _Tree, mesh: MeshShape) -> List[int]:
    return [i for i in range(tree.n) for _ in range(tree.cap[i])][:mesh.world_size]


def naive_plan(topology: Topology, mesh: MeshShape, profile: CommProfile, *,
               bandwidths: Optional[Bandwidths] = None, require_labels: Optional[Mapping[str, str]] = None,
               market_type: Optional[str] = None) -> Plan:
    """What Ray Train does: one PACK placement group, ranks filling nodes in listed order.

    Ray lists nodes in join order, which on a real cluster interleaves racks and zones; the
    ranks follow it slot by slot, so FSDP groups and stage boundaries land wherever that
    order happens to put them.
    """
    nodes = _eligible_nodes(topology, mesh, require_labels, market_type)
    tree, costs = _Tree(nodes), _Costs(mesh, profile, bandwidths or topology.bandwidths)
    nor = _naive_assignment(tree, mesh)
    total = _evaluate(tree, costs, mesh, nor).total
    lb = _Relaxation(tree, costs, mesh).solve()
    return _make_plan(tree, costs, mesh, profile, nor, total, lb, total <= lb * (1 + _REL) + 1e-15,
                      "naive: one PACK group, ranks in node order")


def brute_force_plan(topology: Topology, mesh: MeshShape, profile: CommProfile, *,
                     bandwidths: Optional[Bandwidths] = None, require_labels: Optional[Mapping[str, str]] = None,
                     market_type: Optional[str] = None, max_slots: int = 12) -> Plan:
    """The optimum by exhaustive search over rank -> node assignments (tiny topologies only).

    Independent of the planner's count reduction: it enumerates, stage by stage, which node
    every pipeline's next rank goes to, and prices links pair by pair. It merges states only
    by exact symmetries: pipelines on the same node so far are interchangeable for the future
    (so their next nodes are chosen as a multiset), and states equal up to relabelling
    nodes, racks and zones have the same optimal future.
    """
    nodes = _eligible_nodes(topology, mesh, require_labels, market_type)
    if sum(n.slots for n in nodes) > max_slots:
        raise ValueError(f"brute force is for <= {max_slots} slots, got {sum(n.slots for n in nodes)}")
    tree, costs = _Tree(nodes), _Costs(mesh, profile, bandwidths or topology.bandwidths)
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
            if cost + f(s + 1, nrem, nprev) <= target * (1 + _REL) + 1e-15:
                break
        if s == 0:
            cols = [j for _, ms in choice for j, c in ms for _ in range(c)]
        else:
            queues = {p: [j for j, c in ms for _ in range(c)] for p, ms in choice}
            cols = [queues[p].pop(0) for p in cols]
        out.extend(cols)
        rem, prev = nrem, nprev
    naive = _evaluate(tree, costs, mesh, _naive_assignment(tree, mesh)).total
    return _make_plan(tree, costs, mesh, profile, out, naive, f(0, tuple(tree.cap), tuple([0] * n)),
                      True, "brute force (exhaustive)")


# --------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------
class Planner:
    """Chooses rank -> (node, slot) for a pp x dp mesh by the cost model above.

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
        tree, costs = _Tree(nodes), _Costs(mesh, profile, self.bandwidths)
        deadline = time.monotonic() + self.time_budget_s
        relax = _Relaxation(tree, costs, mesh)
        lower_bound = relax.solve()
        naive_nor = _naive_assignment(tree, mesh)
        naive_s = _evaluate(tree, costs, mesh, naive_nor).total
        meets = lambda total: total <= lower_bound * (1 + _REL) + 1e-15  # noqa: E731
        best: Optional[Tuple[float, List[int], str]] = None

        def consider(counts, method):
            nonlocal best
            if counts is not None:
                nor = _columns_from_counts(tree, counts, mesh.dp)
                total = _evaluate(tree, costs, mesh, nor).total
                if best is None or total < best[0] * (1 - _REL):
                    best = (total, nor, method)

        # level plans cheapest first; stop once the next one cannot beat what is realised
        first = None
        for tried, (relaxed, rows, bnds) in enumerate(relax.plans()):
            first = first or (rows, bnds)
            if (tried >= self.level_plans or (best is not None and relaxed >= best[0] * (1 - _REL))
                    or (tried and time.monotonic() > deadline)):
                break
            consider(_realize(tree, mesh, rows, bnds, deadline=deadline), "hierarchical")
        if best is None or not meets(best[0]):
            consider(_realize(tree, mesh, *first, robust=True), "hierarchical (levels relaxed)")
            alone = [relax.rows_ok[0]] * mesh.pp
            consider(_realize(tree, mesh, alone, [3] * (mesh.pp - 1), robust=True),
                     "hierarchical (stages packed one by one)")
            if naive_s < best[0] * (1 - _REL):
                best = (naive_s, naive_nor, "naive order (no better packing found)")
        optimal = meets(best[0])
        if (not optimal and self.exact_search_states > 0
                and sum(tree.cap) <= self.exact_search_max_slots):
            found = _exact_counts(tree, costs, mesh, self.exact_search_states,
                                  time.monotonic() + self.time_budget_s)
            if found is not None:
                nor = _columns_from_counts(tree, found[1], mesh.dp)
                total = _evaluate(tree, costs, mesh, nor).total
                if total < best[0] * (1 - _REL):
                    best = (total, nor, "exact search")
                optimal, lower_bound = True, max(lower_bound, min(total, best[0]))
        method = best[2] + (" (optimal)" if optimal else "")
        return _make_plan(tree, costs, mesh, profile, best[1], naive_s, lower_bound, optimal, method, relax)


# --------------------------------------------------------------------------------------
# Explanation
# --------------------------------------------------------------------------------------
_LEVEL_WORD = ("node", "rack", "zone", "cluster")


def _short(node_id: str) -> str:
    return node_id if len(node_id) <= 12 else node_id[:8] + "~"


def _ranges(ranks: Sequence[int]) -> str:
    out, start = [], None
    for a, b in itertools.zip_longest(ranks, ranks[1:]):
        start = a if start is None else start
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = None
    return ",".join(out)


def _bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if b < 1000 or unit == "TB":
            return f"{b:.3g} {unit}"
        b /= 1000
    return f"{b} B"


def _where(tree: _Tree, members: Dict[int, int], level: int) -> str:
    nodes = sorted(members, key=lambda i: (-members[i], i))
    shown = ", ".join(f"{_short(tree.nodes[i].node_id)} x{members[i]}" for i in nodes[:4])
    more = f", +{len(nodes) - 4} more" if len(nodes) > 4 else ""
    first = tree.nodes[nodes[0]]
    zone = f"zone {first.zone}" if first.zone else "the unnamed zone"
    racks = {tree.dom[i] for i in nodes}
    home = {0: f"node {_short(first.node_id)}",
            1: f"rack {first.rack} ({zone})",
            2: f"{zone}, {len(racks)} racks" if len(racks) > 1 else zone,
            3: f"{len({tree.zone[i] for i in nodes})} zones"}[level]
    return f"{len(nodes)} node(s) [{shown}{more}] in {home}"


def _explain(tree: _Tree, mesh: MeshShape, profile: CommProfile, nor: Sequence[int], ev: _Eval,
             naive_s: float, lower_bound: float, optimal: bool, method: str, relax: _Relaxation) -> str:
    pp, dp = mesh.pp, mesh.dp
    used = len(set(nor))
    lines = [f"plan: pp={pp} x dp={dp} = {mesh.world_size} ranks on {used} of {tree.n} eligible nodes; "
             f"method: {method}",
             "FSDP groups (one per stage; ring all-gather + reduce-scatter inside the group):"]
    alone = min(r for r in range(4) if relax.capok(0, r, 1))
    largest = {lv: max(sum(tree.cap[i] for i in ns) for ns in tree.subtrees(lv).values()) for lv in range(3)}
    for s in range(pp):
        members: Dict[int, int] = {}
        for i in nor[s * dp:(s + 1) * dp]:
            members[i] = members.get(i, 0) + 1
        lv = ev.row_levels[s]
        if dp == 1:
            why = "a single rank: no FSDP traffic"
        elif lv == alone:
            why = ("the whole group shares one node" if lv == 0 else
                   f"the fastest domain that can hold {dp} ranks (largest {_LEVEL_WORD[lv - 1]} "
                   f"has {largest[lv - 1]} slots)")
        else:
            why = (f"a single {_LEVEL_WORD[alone]} could hold it alone, but that space is worth more to "
                   f"other stages or to pipeline links under the model")
        lines.append(f"  stage {s}: ranks {s * dp}-{(s + 1) * dp - 1} on {_where(tree, members, lv)}: "
                     f"{LinkTier(lv).name}, {_bytes(profile.stage_param_bytes[s])} params, "
                     f"{ev.fsdp_s[s]:.4g} s/step; {why}")
    if pp > 1:
        lines.append(f"stage boundaries ({_bytes(profile.activation_bytes)} x {profile.microbatches} "
                     f"microbatches each way, charged at the slowest pipeline):")
    for s in range(pp - 1):
        tiers: Dict[int, int] = {}
        for d in range(dp):
            t = tree.level(nor[s * dp + d], nor[(s + 1) * dp + d])
            tiers[t] = tiers.get(t, 0) + 1
        mix = ", ".join(f"{LinkTier(t).name} x{c}" for t, c in sorted(tiers.items()))
        lines.append(f"  {s} -> {s + 1}: worst {LinkTier(ev.boundary_levels[s]).name} "
                     f"({mix} of {dp} pipelines), {ev.p2p_s[s]:.4g} s/step")
    ratio = ev.total / naive_s if naive_s > 0 else 1.0
    gap = (ev.total - lower_bound) / lower_bound if lower_bound > 0 else 0.0
    lines.append(f"modeled comm per step: {ev.total:.4g} s (FSDP {sum(ev.fsdp_s):.4g} s + pipeline "
                 f"{sum(ev.p2p_s):.4g} s); naive PACK in node order: {naive_s:.4g} s "
                 f"(this plan = {ratio:.2f}x naive); lower bound {lower_bound:.4g} s "
                 f"({'optimal' if optimal else f'gap {gap:.1%}'})")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Realising a plan on Ray
# --------------------------------------------------------------------------------------
class PlacementManager:
    """Reserves each planned node's bundles in one placement group pinned to that node.

    Pinning uses ``bundle_label_selector=[{"ray.io/node-id": <node id>}]``: Ray labels every
    node with its id, and a label selector is a hard constraint (unlike
    ``_soft_target_node_id``), and it tells nodes apart even when they share an IP, which
    ``node:<ip>`` resources cannot. One group per node means a node that cannot host its
    bundles is named precisely, and the other groups can be released at once.
    """

    def __init__(self, plan: Plan, resources_per_worker: Mapping[str, float], *, name: str = "rayflex"):
        res = {k: float(v) for k, v in resources_per_worker.items() if v}
        if not res or any(v < 0 for v in res.values()):
            raise ConfigError("resources_per_worker", f"needs at least one positive resource, got "
                              f"{dict(resources_per_worker)!r}", "e.g. {'CPU': 1} or {'GPU': 1}")
        self.plan, self.resources, self.name = plan, res, name
        self._node_ranks = plan.node_ranks()
        self._pgs: Dict[str, object] = {}

    def place(self, timeout_s: Optional[float] = None) -> None:
        """Create the groups and wait; on timeout remove them and raise PlacementError."""
        import ray
        from ray.util.placement_group import placement_group

        from rayflex.constants import knob

        timeout = knob("PLACEMENT_TIMEOUT_S") if timeout_s is None else timeout_s
        for node_id, ranks in self._node_ranks.items():
            self._pgs[node_id] = placement_group(
                [dict(self.resources) for _ in ranks], strategy="STRICT_PACK",
                name=f"{self.name}-{node_id[:12]}",
                bundle_label_selector=[{NODE_ID_LABEL: node_id} for _ in ranks])
        refs = {pg.ready(): node_id for node_id, pg in self._pgs.items()}
        _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=max(0.0, timeout))
        if pending:
            missing = [refs[r] for r in pending]
            self.remove()
            detail = "; ".join(f"node {n}: {len(self._node_ranks[n])} bundle(s) for ranks "
                               f"{_ranges(self._node_ranks[n])}" for n in missing)
            raise PlacementError(
                f"could not reserve {self.resources} per worker within {timeout:.0f}s on "
                f"{len(missing)} of {len(refs)} planned node(s): {detail}. The node may be gone, "
                f"draining or short of resources; replan from a fresh Topology.from_ray()")

    def scheduling_strategy(self, rank: int):
        """The strategy that puts rank's actor in its bundle on its planned node."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        node_id = self.plan.rank_to_node[rank]
        if node_id not in self._pgs:
            raise PlacementError(f"rank {rank}: placement for node {node_id} is not reserved; call place() first")
        return PlacementGroupSchedulingStrategy(placement_group=self._pgs[node_id],
                                                placement_group_bundle_index=self.plan.rank_to_slot[rank])

    def remove(self) -> None:
        """Release every group this manager created (idempotent)."""
        if not self._pgs:
            return
        from ray.util.placement_group import remove_placement_group

        pgs, self._pgs = self._pgs, {}
        for pg in pgs.values():
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - a group already gone is what we wanted
                pass
