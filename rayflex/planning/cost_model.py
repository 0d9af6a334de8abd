"""The communication cost model the placement planner minimises, and the types it prices.

Rank layout (fixed; the workers build their DeviceMesh this way, ``rayflex.mesh.plan``):
dims ``("pp", "dp_replicate", "dp_shard", "tp")`` row-major, so

    rank = ((stage * dp_replicate + replica) * dp_shard + shard) * tp + tp_index
         = (stage * dp + dp_index) * tp + tp_index,   dp_index = replica * dp_shard + shard

A tp group is ``tp`` consecutive ranks (one *unit*); unit ``stage * dp + dp_index`` is the
old pp x dp rank. The dp group of stage s is its dp units; an FSDP shard group is the
``dp_shard`` units of one replica (consecutive dp indices), an HSDP replicate group the
``dp_replicate`` units with the same shard index. With tp = dp_replicate = 1 this is the
old ``rank = stage * dp + dp_index``.

Cost model (seconds of communication per training step, per rank, no overlap, no contention):

* FSDP, stage s: ``n_coll * (S-1)/S * P_s / bw(tier of the shard group)`` where ``P_s`` is the
  parameter bytes one rank of the stage holds (its tp shard), ``S = dp_shard`` (= dp without
  HSDP), ``n_coll`` is 2 (all-gather once, reduce-scatter once; the default when pipelining,
  ``reshard_after_forward=False``) or 3 (all-gather again in backward), the ring term
  ``(S-1)/S * P_s`` is what each rank sends per collective, and a group's tier is that of its
  worst pair (a ring through the group crosses its slowest link).
* HSDP, stage s (``R = dp_replicate > 1``): the gradient shard is all-reduced across the
  replicas, ``2 * (R-1)/R * P_s / S / bw(tier of the replicate group)``.
* Tensor parallelism, stage s: ``2 * (tp-1)/tp * X_s / bw(tier of the tp group)``, ``X_s``
  the bytes of every TP all-reduce a rank of the stage issues per step (ring all-reduce).
  Placement keeps every tp group on one node, so this is an NVLink constant; it is priced
  anyway so that a placement that splits a tp group (Ray's PACK order on nodes whose slot
  count tp does not divide) pays for it.
* Pipeline, boundary s -> s+1: ``2 * A * M / bw(tier)`` for each pipeline lane (activations
  forward and their gradients backward, ``A`` bytes per microbatch, ``M`` microbatches per
  step). Every tp rank of a unit sends its own copy to the same tp rank of the next stage,
  each over its own NIC, so a lane is (dp index, tp index) and costs what a pp x dp lane did.
* Aggregation: ``sum over stages of FSDP (+ HSDP) time + sum over boundaries of the slowest
  lane's time at that boundary + the slowest stage's TP time``. Stages are charged in
  sequence (their collectives sit at different points of the schedule and share nothing); a
  boundary is charged at its slowest lane because every stage advances in lock step with its
  FSDP group, so the dp ranks of stage s+1 wait for the slowest activation crossing into
  any of them. TP all-reduces sit inside each stage's compute, which the stages run
  concurrently, so only the slowest stage's count (like compute in the capacity model).
  (This is an upper bound on "slowest pipeline's sum"; it never rewards hiding slow links by
  stacking them on one pipeline.)

Why planning stays exact with tp > 1: a tp group never leaves a node, so the planner places
pp x dp *units* of ``tp`` slots on a tree whose node capacities are ``slots // tp``; every
tp group is then on one node (its cost a constant) and every other term is the pp x dp cost
of the unit assignment. Without HSDP that cost depends only on how many units of each stage
every node holds: the tier of a group is fixed by its support, and the worst link of a
boundary is the smallest tree level at which two consecutive stages have equal per-subtree
counts (a hierarchical matching, ``ranks_from_counts``, then achieves it). That is what
makes exact planning and a tight lower bound tractable. With HSDP the cost also depends on
which dp indices share a node (shard and replicate groups are fixed sets of dp indices), so
the planner's bound uses a per-stage floor (``TierCosts.set_group_floors``) and its plans
are priced by ``evaluate``; a plan that meets the bound is still proven optimal.

The planner's modules compute on a ``NodeTree`` (nodes as integer ids with their domain and
zone) and a ``TierCosts`` table (seconds per stage and tier); ``evaluate`` prices an explicit
rank -> node assignment and is the ground truth every search result is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from rayflex.errors import ConfigError
from rayflex.mesh.plan import MeshPlan
from rayflex.planning.topology import Bandwidths, LinkTier, NodeInfo, Topology

REL_TOL = 1e-9  # relative tolerance when comparing modeled costs
LEVELS = range(len(LinkTier))


def meets(cost: float, bound: float) -> bool:
    """``cost`` is no more than ``bound`` up to rounding: a plan at its lower bound is optimal."""
    return cost <= bound * (1 + REL_TOL) + 1e-15


def improves(cost: float, best: float) -> bool:
    """``cost`` is lower than ``best`` by more than rounding."""
    return cost < best * (1 - REL_TOL)


# --------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommProfile:
    """Bytes the model moves per step: what the cost model needs and nothing more.

    ``stage_param_bytes``: the parameter bytes one rank of each stage holds (its tp shard).
    ``tp_allreduce_bytes``: per stage, the bytes of every tensor-parallel all-reduce a rank
    of it issues per step (payloads, before the ring factor); empty without tp.
    """

    stage_param_bytes: Tuple[float, ...]
    activation_bytes: float
    microbatches: int = 1
    reshard_after_forward: bool = False
    tp_allreduce_bytes: Tuple[float, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "stage_param_bytes", tuple(float(b) for b in self.stage_param_bytes))
        object.__setattr__(self, "tp_allreduce_bytes", tuple(float(b) for b in self.tp_allreduce_bytes))
        if not self.stage_param_bytes or any(b < 0 for b in self.stage_param_bytes):
            raise ConfigError("CommProfile.stage_param_bytes", "must list one byte count >= 0 per stage",
                              "give the parameter bytes of each pipeline stage")
        if self.tp_allreduce_bytes and (len(self.tp_allreduce_bytes) != len(self.stage_param_bytes)
                                        or any(b < 0 for b in self.tp_allreduce_bytes)):
            raise ConfigError("CommProfile.tp_allreduce_bytes",
                              f"has {len(self.tp_allreduce_bytes)} entries for {len(self.stage_param_bytes)} stages",
                              "give one byte count >= 0 per pipeline stage, or none without tensor parallelism")
        if self.activation_bytes < 0 or self.microbatches < 1:
            raise ConfigError("CommProfile", f"activation_bytes={self.activation_bytes} and "
                              f"microbatches={self.microbatches} must be >= 0 and >= 1",
                              "give bytes per microbatch crossing a stage boundary and microbatches per step")

    @property
    def fsdp_collectives(self) -> int:
        return 3 if self.reshard_after_forward else 2

    @classmethod
    def uniform(cls, pp: int, total_param_bytes: float, activation_bytes: float,
                microbatches: int = 1, reshard_after_forward: bool = False,
                tp_allreduce_bytes: float = 0.0) -> "CommProfile":
        """Parameters (and TP all-reduce bytes, per rank) split evenly over ``pp`` stages."""
        tp = tuple([tp_allreduce_bytes / pp] * pp) if tp_allreduce_bytes else ()
        return cls(tuple([total_param_bytes / pp] * pp), activation_bytes, microbatches,
                   reshard_after_forward, tp)


# --------------------------------------------------------------------------------------
# The topology as a tree of integer ids, and the cost model on it
# --------------------------------------------------------------------------------------
class NodeTree:
    """Eligible nodes as a 4-level tree: node (0) < domain (1) < zone (2) < cluster (3).

    ``unit``: slots per placed unit (``tp``: a tp group never leaves its node), so ``cap``
    counts whole units per node.
    """

    def __init__(self, nodes: Sequence[NodeInfo], unit: int = 1):
        self.nodes = list(nodes)
        self.n = len(self.nodes)
        self.unit = unit
        self.cap = [nd.slots // unit for nd in self.nodes]
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
        """Tree level of the smallest subtree holding all ``nodes`` (worst pair, ultrametric).
        A domain lies in one zone (its key includes the zone), so one domain means level 1."""
        nodes = set(nodes)
        if len(nodes) == 1:
            return 0
        if len({self.dom[i] for i in nodes}) == 1:
            return 1
        return 2 if len({self.zone[i] for i in nodes}) == 1 else 3

    def fit_level(self, units: int) -> int:
        """Smallest level at which some subtree holds ``units`` units (3 when none does:
        the cluster as a whole is the last resort)."""
        for lv in range(3):
            if any(sum(self.cap[i] for i in ns) >= units for ns in self.subtrees(lv).values()):
                return lv
        return 3

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


class TierCosts:
    """Per-tier seconds of each term: ``shard[s][level]`` (stage s's FSDP shard groups),
    ``replica[s][level]`` (its HSDP all-reduce), ``tp[s][level]`` (its TP all-reduces),
    ``p2p[level]`` (one boundary); and ``fsdp[s][level]``, what the planner's relaxation and
    exact search charge a stage whose dp group spans ``level``.

    Without HSDP ``fsdp`` is ``shard`` (the dp group is the shard group). With it, a dp group
    at level L has its shard and replicate groups at levels a, b <= L with max(a, b) = L (a
    pair of its units is joined through one shard and one replicate group, and the tree is
    ultrametric), so ``fsdp[s][L] = min(shard[L] + replica[b0], shard[a0] + replica[L])`` is
    a lower bound on the stage's cost, with a0, b0 the floors ``set_group_floors`` sets.
    """

    def __init__(self, mesh: MeshPlan, profile: CommProfile, bw: Bandwidths):
        if len(profile.stage_param_bytes) != mesh.pp:
            raise ConfigError("CommProfile.stage_param_bytes",
                              f"has {len(profile.stage_param_bytes)} entries for pp={mesh.pp}",
                              "give one parameter byte count per pipeline stage")
        shard, reps, tp = mesh.dp_shard, mesh.dp_replicate, mesh.tp
        ring = profile.fsdp_collectives * (shard - 1) / shard
        rep_ring = 2 * (reps - 1) / reps
        tp_ring = 2 * (tp - 1) / tp
        tp_bytes = profile.tp_allreduce_bytes or (0.0,) * mesh.pp
        self.shard = [[ring * p / bw.of(t) for t in LinkTier] for p in profile.stage_param_bytes]
        self.replica = [[rep_ring * p / shard / bw.of(t) for t in LinkTier] for p in profile.stage_param_bytes]
        self.tp = [[tp_ring * x / bw.of(t) for t in LinkTier] for x in tp_bytes]
        self.p2p = [2.0 * profile.activation_bytes * profile.microbatches / bw.of(t) for t in LinkTier]
        # plain FSDP over the whole dp group: what HSDP is compared against in explanations
        dp_ring = profile.fsdp_collectives * (mesh.dp - 1) / mesh.dp
        self.plain = [[dp_ring * p / bw.of(t) for t in LinkTier] for p in profile.stage_param_bytes]
        self.hsdp = reps > 1
        self.set_group_floors(0, 0)

    def set_group_floors(self, shard_floor: int, replica_floor: int) -> None:
        """The levels below which no shard / replicate group can sit (the smallest subtree
        holding dp_shard / dp_replicate units); tightens ``fsdp`` with HSDP."""
        if not self.hsdp:
            self.fsdp = self.shard
            return
        self.fsdp = [[min(sh[lv] + rp[min(replica_floor, lv)], sh[min(shard_floor, lv)] + rp[lv]) for lv in LEVELS]
                     for sh, rp in zip(self.shard, self.replica)]

    @classmethod
    def from_tables(cls, shard: Sequence[Sequence[float]], p2p: Sequence[float]) -> "TierCosts":
        """A plain-FSDP table (no HSDP, no tp): what the unit searches price a pp x dp
        assignment of units with (``unit_view``, the HSDP planner's coarse problems)."""
        self = cls.__new__(cls)
        self.shard = self.fsdp = self.plain = [list(row) for row in shard]
        zeros = [[0.0] * len(LinkTier) for _ in shard]
        self.replica, self.tp = zeros, zeros
        self.p2p = list(p2p)
        self.hsdp = False
        return self

    def unit_view(self) -> "TierCosts":
        """This table as the unit search sees it: each stage charged ``fsdp`` (exact without
        HSDP, the per-stage floor with it), tp left out (a constant on whole tp groups)."""
        return TierCosts.from_tables(self.fsdp, self.p2p)

    @property
    def tp_floor(self) -> float:
        """TP seconds when every tp group shares a node (what placement guarantees)."""
        return max(row[0] for row in self.tp)


@dataclass(frozen=True)
class CostBreakdown:
    """One assignment's modeled seconds per stage and boundary, and the tree levels that set them.

    ``row_levels``: each stage's worst FSDP shard group; ``replica_levels`` its worst HSDP
    replicate group; ``tp_levels`` its worst tp group.
    """

    total: float
    fsdp_s: Tuple[float, ...]
    p2p_s: Tuple[float, ...]
    row_levels: Tuple[int, ...]
    boundary_levels: Tuple[int, ...]
    replica_s: Tuple[float, ...] = ()
    replica_levels: Tuple[int, ...] = ()
    tp_s: Tuple[float, ...] = ()
    tp_levels: Tuple[int, ...] = ()

    @property
    def tp_total(self) -> float:
        """What TP adds to the step: the slowest stage's all-reduces."""
        return max(self.tp_s, default=0.0)


@dataclass(frozen=True)
class GroupLevels:
    """Where an assignment's groups landed: per stage the tree level of its worst FSDP shard
    group, HSDP replicate group and tp group, and per boundary its worst lane. The cost is a
    function of these alone (``price``), so one placement can be priced for many profiles."""

    rows: Tuple[int, ...]
    replicas: Tuple[int, ...]
    tps: Tuple[int, ...]
    boundaries: Tuple[int, ...]


def group_levels(tree: NodeTree, mesh: MeshPlan, node_of_rank: Sequence[int]) -> GroupLevels:
    """The levels of every group of an explicit rank -> node assignment."""
    pp, dp, tp = mesh.pp, mesh.dp, mesh.tp
    tps = tuple(max(tree.span_level(node_of_rank[u * tp:(u + 1) * tp]) for u in range(s * dp, (s + 1) * dp))
                if tp > 1 else 0 for s in range(pp))
    if not any(tps):  # every tp group on one node: all tp lanes of a unit see the same links
        return _lane_levels(tree, mesh, node_of_rank[::tp], tps)
    # a split tp group (naive placement): each tp index is a lane of its own; the worst counts
    per_stage = dp * tp
    lanes = [_lane_levels(tree, mesh, [i for s in range(pp)
                                       for i in node_of_rank[s * per_stage + t:(s + 1) * per_stage:tp]], tps)
             for t in range(tp)]

    def worst(field: str) -> Tuple[int, ...]:
        return tuple(max(levels) for levels in zip(*(getattr(ln, field) for ln in lanes)))

    return GroupLevels(worst("rows"), worst("replicas"), tps, worst("boundaries"))


def unit_levels(tree: NodeTree, mesh: MeshPlan, node_of_unit: Sequence[int]) -> GroupLevels:
    """The levels of a unit -> node assignment (every tp group on its unit's node)."""
    return _lane_levels(tree, mesh, node_of_unit, (0,) * mesh.pp)


def _lane_levels(tree: NodeTree, mesh: MeshPlan, node_of_unit: Sequence[int], tps: Tuple[int, ...]) -> GroupLevels:
    """Levels of one tp lane: the pp x dp assignment of the ranks with one tp index."""
    pp, dp, shard, reps = mesh.pp, mesh.dp, mesh.dp_shard, mesh.dp_replicate
    rows, replicas = [], []
    for s in range(pp):
        group = node_of_unit[s * dp:(s + 1) * dp]
        if reps == 1:
            rows.append(tree.span_level(group))
            replicas.append(0)
        else:
            rows.append(max(tree.span_level(group[r * shard:(r + 1) * shard]) for r in range(reps)))
            replicas.append(max(tree.span_level(group[i::shard]) for i in range(shard)))
    bnds = tuple(max(tree.level(x, y) for x, y in zip(node_of_unit[s * dp:(s + 1) * dp],
                                                        node_of_unit[(s + 1) * dp:(s + 2) * dp]))
                 for s in range(pp - 1))
    return GroupLevels(tuple(rows), tuple(replicas), tuple(tps), bnds)


def price(costs: TierCosts, levels: GroupLevels) -> CostBreakdown:
    """The modeled seconds of groups at these levels (module docstring's aggregation)."""
    fsdp = tuple(costs.shard[s][lv] for s, lv in enumerate(levels.rows))
    replica = tuple(costs.replica[s][lv] for s, lv in enumerate(levels.replicas))
    tp_s = tuple(costs.tp[s][lv] for s, lv in enumerate(levels.tps))
    p2p = tuple(costs.p2p[lv] for lv in levels.boundaries)
    total = sum(fsdp) + sum(replica) + sum(p2p) + max(tp_s)
    return CostBreakdown(total, fsdp, p2p, levels.rows, levels.boundaries, replica, levels.replicas, tp_s, levels.tps)


def evaluate(tree: NodeTree, costs: TierCosts, mesh: MeshPlan, node_of_rank: Sequence[int]) -> CostBreakdown:
    """The modeled seconds of an explicit rank -> node assignment (the ground truth)."""
    return price(costs, group_levels(tree, mesh, node_of_rank))


def expand_units(node_of_unit: Sequence[int], tp: int) -> List[int]:
    """Rank -> node from unit -> node: unit u holds ranks ``u*tp .. u*tp+tp-1``."""
    return [i for i in node_of_unit for _ in range(tp)] if tp > 1 else list(node_of_unit)


def canonical_unit_orders(tree: NodeTree, mesh: MeshPlan) -> List[List[int]]:
    """Two simple unit -> node layouts on the tree's hierarchical order: dp-major (units in
    rank order fill nodes, so each stage's dp group, and in it each shard group, is packed
    node by node, rack by rack) and pipeline-major (each node holds whole pipelines)."""
    units = mesh.pp * mesh.dp
    slots = [i for i in tree.order for _ in range(tree.cap[i])][:units]
    if len(slots) < units:
        raise ValueError(f"{len(slots)} units of {tree.unit} slots for a mesh of {units}")
    pipe_major = [0] * units
    for k, node in enumerate(slots):  # the k-th unit slot hosts pipeline k // pp at stage k % pp
        d, s = divmod(k, mesh.pp)
        pipe_major[s * mesh.dp + d] = node
    return [slots, pipe_major]


def ranks_from_counts(tree: NodeTree, rows: Sequence[Mapping[int, int]], dp: int) -> List[int]:
    """Turn per-stage node counts into unit -> node, matching pipelines hierarchically.

    Stage s+1's units are matched to stage s's pipelines inside a node first, then a domain,
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


def modeled_comm(topology: Topology, mesh: MeshPlan, profile: CommProfile, rank_to_node: Sequence[str],
                 bandwidths: Optional[Bandwidths] = None) -> CostBreakdown:
    """The modeled communication of any rank -> node id assignment, term by term."""
    if len(rank_to_node) != mesh.world_size:
        raise ValueError(f"rank_to_node has {len(rank_to_node)} entries for world size {mesh.world_size}")
    used = set(rank_to_node)
    tree = NodeTree([n for n in topology.nodes if n.node_id in used])
    index = {nd.node_id: i for i, nd in enumerate(tree.nodes)}
    missing = used - set(index)
    if missing:
        raise ValueError(f"rank_to_node names nodes not in the topology: {sorted(missing)[:5]}")
    costs = TierCosts(mesh, profile, bandwidths or topology.bandwidths)
    return evaluate(tree, costs, mesh, [index[n] for n in rank_to_node])


def modeled_comm_seconds(topology: Topology, mesh: MeshPlan, profile: CommProfile,
                         rank_to_node: Sequence[str], bandwidths: Optional[Bandwidths] = None) -> float:
    """Modeled communication seconds per step of any rank -> node id assignment."""
    return modeled_comm(topology, mesh, profile, rank_to_node, bandwidths).total
