"""A plan's explanation: where each FSDP group and stage boundary landed, why, and at what
modeled cost against naive placement and the lower bound; plus the short forms of node ids
and rank lists that ``Plan.format`` and placement errors share.
"""

from __future__ import annotations

import itertools
from typing import Dict, Sequence

from rayflex.planning.cost_model import CommProfile, CostBreakdown, MeshShape, NodeTree
from rayflex.planning.placement.bound import Relaxation
from rayflex.planning.topology import LinkTier


_LEVEL_WORD = ("node", "rack", "zone", "cluster")


def short_id(node_id: str) -> str:
    """A node id short enough for a line of text (Ray's are 56 hex digits)."""
    return node_id if len(node_id) <= 12 else node_id[:8] + "~"


def rank_ranges(ranks: Sequence[int]) -> str:
    """Ascending ranks as compact ranges: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
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


def _where(tree: NodeTree, members: Dict[int, int], level: int) -> str:
    nodes = sorted(members, key=lambda i: (-members[i], i))
    shown = ", ".join(f"{short_id(tree.nodes[i].node_id)} x{members[i]}" for i in nodes[:4])
    more = f", +{len(nodes) - 4} more" if len(nodes) > 4 else ""
    first = tree.nodes[nodes[0]]
    zone = f"zone {first.zone}" if first.zone else "the unnamed zone"
    racks = {tree.dom[i] for i in nodes}
    home = {0: f"node {short_id(first.node_id)}",
            1: f"rack {first.rack} ({zone})",
            2: f"{zone}, {len(racks)} racks" if len(racks) > 1 else zone,
            3: f"{len({tree.zone[i] for i in nodes})} zones"}[level]
    return f"{len(nodes)} node(s) [{shown}{more}] in {home}"


def explain(tree: NodeTree, mesh: MeshShape, profile: CommProfile, nor: Sequence[int], ev: CostBreakdown,
            naive_s: float, lower_bound: float, optimal: bool, method: str, relax: Relaxation) -> str:
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

