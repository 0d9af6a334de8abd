"""A plan's explanation: where each tp group, FSDP (and HSDP) group and stage boundary
landed, why, and at what modeled cost against naive placement and the lower bound; plus the
short forms of node ids and rank lists that ``Plan.format`` and placement errors share.
"""

from __future__ import annotations

import itertools
from typing import Dict, Sequence

from rayflex.mesh.plan import MeshPlan
from rayflex.planning.cost_model import CommProfile, CostBreakdown, NodeTree, TierCosts
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


def explain(tree: NodeTree, costs: TierCosts, mesh: MeshPlan, profile: CommProfile, nor: Sequence[int],
            ev: CostBreakdown, naive_s: float, lower_bound: float, optimal: bool, method: str) -> str:
    pp, dp, tp, shard, reps = mesh.pp, mesh.dp, mesh.tp, mesh.dp_shard, mesh.dp_replicate
    per_stage = dp * tp
    used = len(set(nor))
    lines = [f"plan: {mesh.describe()} = {mesh.world_size} ranks on {used} of {tree.n} eligible nodes; "
             f"method: {method}"]
    if tp > 1:
        worst = max(ev.tp_levels)
        split = sum(1 for lv in ev.tp_levels if lv)
        lines.append(f"tensor-parallel groups: {pp * dp} groups of {tp} consecutive ranks, "
                     + (f"each on one node: {LinkTier.SAME_NODE.name}" if not worst else
                        f"{split} stage(s) with a group split across nodes, worst {LinkTier(worst).name}")
                     + f"; {_bytes(max(profile.tp_allreduce_bytes, default=0.0))} all-reduced per rank per step "
                       f"on the busiest stage, {ev.tp_total:.4g} s/step")
    if reps > 1:
        lines.append(f"HSDP groups (per stage: {reps} replicas of {shard}-rank FSDP shard groups; all-gather + "
                     f"reduce-scatter inside a shard group, all-reduce of the 1/{shard} gradient shard across "
                     f"the {reps} replicas):")
    else:
        lines.append("FSDP groups (one per stage" + (" and tp index" if tp > 1 else "")
                     + "; ring all-gather + reduce-scatter inside the group):")
    alone = tree.fit_level(dp)
    largest = {lv: tree.unit * max(sum(tree.cap[i] for i in ns) for ns in tree.subtrees(lv).values())
               for lv in range(3)}
    for s in range(pp):
        members: Dict[int, int] = {}
        for i in nor[s * per_stage:(s + 1) * per_stage]:
            members[i] = members.get(i, 0) + 1
        lv = ev.row_levels[s]
        span = tree.span_level(members)
        head = (f"  stage {s}: ranks {s * per_stage}-{(s + 1) * per_stage - 1} on {_where(tree, members, span)}: ")
        if reps > 1:
            rl = ev.replica_levels[s]
            lines.append(head + f"shard groups {LinkTier(lv).name} ({ev.fsdp_s[s]:.4g} s/step), replicate groups "
                         f"{LinkTier(rl).name} ({ev.replica_s[s]:.4g} s/step), "
                         f"{_bytes(profile.stage_param_bytes[s])} params per rank; "
                         + _hsdp_why(costs, s, lv, rl, span, shard, reps))
            continue
        if dp == 1:
            why = "a single rank: no FSDP traffic"
        elif lv == alone:
            if lv == 0:
                why = "the whole group shares one node"
            else:
                what = f"{dp} ranks" if tp == 1 else f"{dp} tp groups of {tp} ranks"
                room = f"{largest[lv - 1]} slots" + (f" = {largest[lv - 1] // tp} tp groups" if tp > 1 else "")
                why = f"the fastest domain that can hold {what} (largest {_LEVEL_WORD[lv - 1]} has {room})"
        else:
            why = (f"a single {_LEVEL_WORD[alone]} could hold it alone, but that space is worth more to "
                   f"other stages or to pipeline links under the model")
        lines.append(head + f"{LinkTier(lv).name}, {_bytes(profile.stage_param_bytes[s])} params, "
                     f"{ev.fsdp_s[s]:.4g} s/step; {why}")
    if pp > 1:
        lines.append(f"stage boundaries ({_bytes(profile.activation_bytes)} x {profile.microbatches} "
                     f"microbatches each way, charged at the slowest pipeline):")
    for s in range(pp - 1):
        tiers: Dict[int, int] = {}
        for d in range(per_stage):
            t = tree.level(nor[s * per_stage + d], nor[(s + 1) * per_stage + d])
            tiers[t] = tiers.get(t, 0) + 1
        mix = ", ".join(f"{LinkTier(t).name} x{c}" for t, c in sorted(tiers.items()))
        lanes = f"{per_stage} pipelines" if tp == 1 else f"{per_stage} lanes (dp x tp)"
        lines.append(f"  {s} -> {s + 1}: worst {LinkTier(ev.boundary_levels[s]).name} "
                     f"({mix} of {lanes}), {ev.p2p_s[s]:.4g} s/step")
    ratio = ev.total / naive_s if naive_s > 0 else 1.0
    gap = (ev.total - lower_bound) / lower_bound if lower_bound > 0 else 0.0
    extra = ((f" + HSDP {sum(ev.replica_s):.4g} s" if reps > 1 else "")
             + (f" + TP {ev.tp_total:.4g} s" if tp > 1 else ""))
    lines.append(f"modeled comm per step: {ev.total:.4g} s (FSDP {sum(ev.fsdp_s):.4g} s{extra} + pipeline "
                 f"{sum(ev.p2p_s):.4g} s); naive PACK in node order: {naive_s:.4g} s "
                 f"(this plan = {ratio:.2f}x naive); lower bound {lower_bound:.4g} s "
                 f"({'optimal' if optimal else f'gap {gap:.1%}'})"
                 + ("; with HSDP the bound floors each stage's shard + replicate cost, and a plan is proven "
                    "optimal only when it meets it" if reps > 1 else ""))
    return "\n".join(lines)


def _hsdp_why(costs: TierCosts, s: int, shard_lv: int, rep_lv: int, span: int, shard: int, reps: int) -> str:
    """Why HSDP here: the shard groups' traffic stays in the fast tier, and only 1/shard of it
    crosses the stage's widest link (what plain FSDP over the same ranks would pay in full)."""
    plain = costs.plain[s][span]
    return (f"plain FSDP over these ranks would ring all {shard * reps} at {LinkTier(span).name}: "
            f"{plain:.4g} s/step")
