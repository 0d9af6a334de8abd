"""Naming the nodes a run lost: a machine that vanished is seen first as its ranks' deaths,
a survivor's broken collective or its ranks' silence, and declared dead by Ray seconds
later; whichever state is then running names it once."""

from __future__ import annotations

from rayflex.planning.placement.planner import ranks_by_node
from rayflex.telemetry import events as ev


def since_last_attempt(ctx) -> list:
    """The newest attempt this controller started (its ``plan_chosen``) and every event after
    it; empty before its first. A resumed run's timeline also holds the attempts of the
    controllers before this one, on the nodes of clusters that may be gone."""
    mine = ev.Timeline(ctx.recorder.timeline.since_last(ev.RunStarted))
    return mine.since_last(ev.PlanChosen)


def name_vanished_nodes(ctx) -> None:
    """Name once each node of the last attempt that Ray no longer lists. What is seen first
    of a vanished machine is its ranks' deaths, a survivor's broken collective, or its ranks'
    silence while the others leave; Ray declares the node dead seconds later, before this
    restart decides or before the next start plans, so both look: the timeline says that a
    whole node went, not only that processes did."""
    recent = since_last_attempt(ctx)
    if not recent:
        return
    rank_to_node = recent[0].rank_to_node
    reported = {e.node_id for e in recent if isinstance(e, ev.NodeLost)}
    ranks_on = ranks_by_node(rank_to_node)
    for node in sorted(set(filter(None, rank_to_node)) - ctx.alive_nodes() - reported):
        ctx.record(ev.NodeLost(step=ctx.ledger.step + 1, node_id=node, ranks=ranks_on[node]))


def implicated_nodes(ctx) -> set[str]:
    """The nodes of the last attempt's fault: where a rank died, raised, hung or was lost,
    by the events since this controller's last attempt started."""
    recent = since_last_attempt(ctx)
    if not recent:
        return set()
    rank_to_node = recent[0].rank_to_node
    nodes = set()
    for e in recent[1:]:
        if isinstance(e, (ev.WorkerDied, ev.WorkerFailed, ev.NodeLost)):
            nodes.add(e.node_id)
        if isinstance(e, ev.HangDetected):
            nodes.update(rank_to_node[r] for r in e.ranks if 0 <= r < len(rank_to_node))
    return nodes - {""}

