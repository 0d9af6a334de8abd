"""RESTARTING: end the broken attempt, keep what survived, and decide the next size.

Dead or frozen ranks are killed; the others are asked to leave the attempt and kept warm
for the next one. The failure policy then decides: restart at a size the mesh allows with
the slots usable now, wait for resources, or fail the run.
"""

from __future__ import annotations

import logging
from typing import Optional

from rayflex.constants import knob
from rayflex.control.decisions import follow_decision
from rayflex.control import live_state
from rayflex.control.handoff import commit_handed_off
from rayflex.control.lost_nodes import name_vanished_nodes, watch_failed_attempt
from rayflex.control.states import Attempt, Restarting
from rayflex.control.survivors import collect_survivors
from rayflex.control.warming import warm_replacements
from rayflex.errors import RayflexError, WorkerError
from rayflex.planning.placement.planner import ranks_by_node
from rayflex.telemetry import events as ev

log = logging.getLogger(__name__)


def restart(ctx, state: Restarting):
    fault, attempt = state.fault, state.attempt
    node_of = dict(attempt.group.node_of)
    raised = frozenset(e.rank for e in fault.events if isinstance(e, ev.WorkerFailed))
    # Replacements are warmed only for the ranks killed now: a rank that raised still
    # holds its slot until it has left, so a bundle reserved there would only time out.
    gone = set(fault.bad_ranks) - raised
    _drain(ctx, attempt)
    _leave_out_unreachable_nodes(ctx, fault, node_of)  # before warming replacements there
    # A rank that raised still holds a finished step's state: only the killed ones lose theirs.
    ask, chosen = live_state.worth_asking(ctx, attempt.plan, gone)
    snapshots: Optional[dict] = {} if ask else None
    survivors = collect_survivors(ctx, attempt, set(fault.bad_ranks), raised,
                                  warm=(lambda: warm_replacements(ctx, node_of, gone)) if gone else None,
                                  snapshots=snapshots)
    live = None
    if snapshots is not None:
        live, chosen = live_state.choose(ctx, attempt.plan, snapshots)
    watch_failed_attempt(ctx)
    name_vanished_nodes(ctx)
    commit_handed_off(ctx)  # an emergency save's keepers upload it: committed before a step is chosen
    decision = ctx.policies.failure.decide(kind=fault.kind, step=ctx.ledger.step + 1, committed_step=ctx.ledger.committed_step,
                                 usable_slots=ctx.usable_slots(), error=fault.error, diagnosis=fault.diagnosis)
    next_state = follow_decision(ctx, decision, survivors, state.fault_time, lambda: worker_error(fault), live=live)
    live_state.record(ctx, chosen, next_state)
    return next_state


def _drain(ctx, attempt: Attempt) -> None:
    """Fold in what the ranks reported since the last poll (finished steps, committed
    checkpoints) before they leave: a rank forgets unpolled records when it is given its
    next attempt, and a step whose checkpoint committed is never trained again."""
    try:
        result = attempt.group.poll()
    except Exception as e:  # noqa: BLE001 - a broken attempt may not answer; recovery goes on
        log.info("last poll of the failed attempt: %s", e)
        return
    for rank, st in sorted(result.statuses.items()):
        ctx.ledger.absorb(rank, st, attempt.plan, attempt.detector)


def _leave_out_unreachable_nodes(ctx, fault, node_of: dict[int, str]) -> set[str]:
    """A node every rank of which froze may be frozen itself (Ray still lists it until its
    health check gives up, up to a minute): one that does not run a probe task within
    ``NODE_PROBE_TIMEOUT_S`` is named lost and left out of placement until it answers."""
    if fault.hang != "frozen":
        return set()
    alive = ctx.alive_nodes()
    ranks_on = ranks_by_node(node_of)
    silent = {n for n, ranks in ranks_on.items() if n in alive and set(ranks) <= set(fault.bad_ranks)}
    timeout_s = knob("NODE_PROBE_TIMEOUT_S")
    unreachable = ctx.unreachable.check(silent, timeout_s)
    for node in sorted(unreachable):
        log.warning("node %s ran no task within %.0fs after its ranks froze: leaving it out", node[:12], timeout_s)
        ctx.record(ev.NodeLost(step=ctx.ledger.step + 1, node_id=node, ranks=sorted(ranks_on[node]),
                               reason=f"unreachable: its ranks froze and it ran no task within {timeout_s:.0f}s; "
                                      "left out of placement until it answers (Ray still lists it)"))
    return unreachable


def worker_error(fault) -> Optional[BaseException]:
    failed = [e for e in fault.events if isinstance(e, ev.WorkerFailed)]
    if failed:
        e = failed[0]
        return WorkerError(e.rank, e.node_id, e.step or 0, e.error)
    return RayflexError(fault.error) if fault.error else None
