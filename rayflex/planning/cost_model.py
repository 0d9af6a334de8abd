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
from rayflex.planning.topology import Bandwidths, LinkTier, NodeInfo, Topology

REL_TOL = 1e-9  # relative tolerance when comparing modeled costs


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
class NodeTree:
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


class TierCosts:
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
class CostBreakdown:
    """One assignment's modeled seconds per stage and boundary, and the tree levels that set them."""

    total: float
    fsdp_s: Tuple[float, ...]
    p2p_s: Tuple[float, ...]
    row_levels: Tuple[int, ...]
    boundary_levels: Tuple[int, ...]


def evaluate(tree: NodeTree, costs: TierCosts, mesh: MeshShape, node_of_rank: Sequence[int]) -> CostBreakdown:
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
    return CostBreakdown(sum(fsdp) + sum(p2p), fsdp, p2p, tuple(rows), tuple(bnds))


def ranks_from_counts(tree: NodeTree, rows: Sequence[Mapping[int, int]], dp: int) -> List[int]:
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


def modeled_comm_seconds(topology: Topology, mesh: MeshShape, profile: CommProfile,
                         rank_to_node: Sequence[str], bandwidths: Optional[Bandwidths] = None) -> float:
    """Modeled communication seconds per step of any rank -> node id assignment."""
    if len(rank_to_node) != mesh.world_size:
        raise ValueError(f"rank_to_node has {len(rank_to_node)} entries for world size {mesh.world_size}")
    used = set(rank_to_node)
    tree = NodeTree([n for n in topology.nodes if n.node_id in used])
    index = {nd.node_id: i for i, nd in enumerate(tree.nodes)}
    missing = used - set(index)
    if missing:
        raise ValueError(f"rank_to_node names nodes not in the topology: {sorted(missing)[:5]}")
    costs = TierCosts(mesh, profile, bandwidths or topology.bandwidths)
    return evaluate(tree, costs, mesh, [index[n] for n in rank_to_node]).total

