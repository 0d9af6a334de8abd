"""Naming the nodes a run lost: a machine that vanished is seen first as its ranks' deaths,
a survivor's broken collective or its ranks' silence, and declared dead by Ray seconds
later; whichever state is then running names it once.

When an attempt fails, its nodes are watched (``RunContext.vanishing``) for
``VANISHED_NODE_WINDOW_S``: the restart's decision, the next start's plan and every node
refresh of the next attempt look, so a node Ray declares dead only after the next attempt
started without it is still named. Nodes with a spot notice are not watched (they are
expected to go), nor nodes the next attempt runs on (its own fault detection covers them)."""

from __future__ import annotations

from rayflex.constants import knob
from rayflex.planning.placement.planner import ranks_by_node
from rayflex.telemetry import events as ev


def since_last_attempt(ctx) -> list:
    """The newest attempt this controller started (its ``plan_chosen``) and every event after
    it; empty before its first. A resumed run's timeline also holds the attempts of the
    controllers before this one, on the nodes of clusters that may be gone."""
    mine = ev.Timeline(ctx.recorder.timeline.since_last(ev.RunStarted))
    return mine.since_last(ev.PlanChosen)


def watch_failed_attempt(ctx) -> None:
    """At a restart: watch the failed attempt's nodes not named lost yet (module docstring)."""
    recent = since_last_attempt(ctx)
    if not recent:
        return
    reported = {e.node_id for e in recent if isinstance(e, ev.NodeLost)}
    until = ctx.clock.time() + knob("VANISHED_NODE_WINDOW_S")
    for node, ranks in ranks_by_node(recent[0].rank_to_node).items():
        if node and node not in reported and node not in ctx.excluded:
            ctx.vanishing[node] = (ranks, until)


def stop_watching(ctx, nodes) -> None:
    """The nodes a new attempt runs on: their loss is that attempt's fault to detect."""
    for node in nodes:
        ctx.vanishing.pop(node, None)


def name_vanished_nodes(ctx, alive=None) -> None:
    """Name once each watched node that Ray no longer lists (``alive``: the listing just
    read, else read now): the timeline then says that a whole node went, not only that
    processes did."""
    if not ctx.vanishing:
        return
    now = ctx.clock.time()
    alive = ctx.alive_nodes() if alive is None else alive
    for node, (ranks, until) in sorted(ctx.vanishing.items()):
        if node not in alive:
            ctx.record(ev.NodeLost(step=ctx.ledger.step + 1, node_id=node, ranks=ranks))
        if node not in alive or now > until:
            del ctx.vanishing[node]


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

