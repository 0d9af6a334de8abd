"""What a spot-preemption notice means for the run.

While an attempt trains: with time for a step, an emergency checkpoint and a margin, the
run stops at the next step boundary (the stop leaves a checkpoint) while replacements
warm; with less, the node's ranks count as lost now and the restart restores the last
committed checkpoint. A notice for a node without workers only excludes it from placement.

Between attempts (a restart under way) nothing trains, so nothing can be saved: the node
is left out of the next placement and the notice is named as such. Notices that arrive
while a new attempt starts are kept for its first poll, which acts on them as above.
"""

from __future__ import annotations

from typing import Optional

from rayflex.control.warming import warm_standbys
from rayflex.faults.detector import Fault
from rayflex.faults.preemption import Notice
from rayflex.telemetry import events as ev


def take_notices(ctx) -> list[Notice]:
    """Notices not acted on yet: those kept while an attempt started, then new ones."""
    kept, ctx.pending_notices = ctx.pending_notices, []
    return kept + (ctx.watcher.poll() if ctx.watcher is not None else [])


def keep_notices_for_the_attempt(ctx) -> None:
    """While the ranks of a new attempt start and restore: a notice is kept for the
    attempt's first poll (the watcher reports a node once, and Ray forgets a drained node
    once it is gone); its node is excluded now, so no growth plans on it meanwhile."""
    if ctx.watcher is None:
        return
    for notice in ctx.watcher.poll():
        ctx.excluded.add(notice.node_id)
        ctx.pending_notices.append(notice)


def exclude_noticed_nodes(ctx) -> None:
    """Before a placement, no attempt running: every notice not acted on leaves its node
    out of the placement, named (the restart restores the last committed checkpoint; there
    is no running attempt to save)."""
    for notice in take_notices(ctx):
        ctx.excluded.add(notice.node_id)
        left = notice.seconds_left(ctx.clock.time())
        ctx.record(ev.PreemptionNotice(
            step=ctx.ledger.step, node_id=notice.node_id, deadline=notice.deadline, source=notice.source,
            seconds_left=left, action="excluded_from_placement",
            reason=(f"arrived while the run was restarting ({left:.1f}s left): no attempt is training, so "
                    f"there is nothing to save; node {notice.node_id[:12]} is left out of the next placement "
                    f"and its warm workers are let go")))


def handle_notices(ctx, loop) -> Optional[Fault]:
    """Act on new notices; returns a fault when a node goes before a checkpoint could."""
    group = loop.attempt.group
    notices = take_notices(ctx)
    for i, notice in enumerate(notices):
        ranks = sorted(r for r, n in group.node_of.items() if n == notice.node_id)
        ctx.excluded.add(notice.node_id)
        left = notice.seconds_left(ctx.clock.time())
        step_s, estimate = ctx.ledger.step_time_estimate_s(), ctx.ledger.emergency_save_estimate_s()
        margin = ctx.spec.elastic.emergency_margin_s
        needed = ctx.ledger.emergency_notice_s(margin)
        base = dict(step=ctx.ledger.step, node_id=notice.node_id, deadline=notice.deadline, source=notice.source,
                    ranks=ranks, seconds_left=left, needed_s=needed)
        decision = ctx.policies.notice.decide(ranks=ranks, seconds_left=left, needed_s=needed, step_s=step_s,
                                              save_s=estimate, margin_s=margin, saving=loop.preempting is not None,
                                              committed_step=ctx.ledger.committed_step, node_id=notice.node_id)
        ctx.record(ev.PreemptionNotice(**base, action=decision.action, reason=decision.reason))
        if decision.action == "emergency_checkpoint":
            group.broadcast("request_stop", "preemption", sorted(ctx.excluded))  # its ranks' uploads go elsewhere too
            if not decision.joins:
                loop.preempting, loop.grow_to = notice, None  # the restart after the checkpoint picks the size
                warm_standbys(ctx, ctx.best_size())  # the node's replacements start during the checkpoint
        elif decision.action == "restore_last_committed":
            # Notices read in the same poll are the restart's to act on (found by the overlap
            # chaos run: a second node's notice 0.1 s after a short one was dropped here).
            ctx.pending_notices[:0] = notices[i + 1:]
            return Fault(bad_ranks=set(ranks), kind="preemption", error=decision.reason)
    return None


def preemption_fault(ctx, group, notice) -> Fault:
    """The emergency checkpoint is done: the ranks on excluded nodes are to be replaced."""
    ranks = {r for r, n in group.node_of.items() if n in ctx.excluded}
    return Fault(bad_ranks=ranks, kind="preemption",
                 error=f"spot preemption of node {notice.node_id[:12]} ({notice.source})")
