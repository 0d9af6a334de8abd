"""RESTARTING: end the broken attempt, keep what survived, and decide the next size.

Dead or frozen ranks are killed; the others are asked to leave the attempt and kept warm
for the next one. The failure policy then decides: restart at a size the mesh allows with
the slots usable now, wait for resources, or fail the run.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from rayflex.constants import knob
from rayflex.control.handoff import commit_handed_off
from rayflex.control.states import Attempt, Failed, Placing, Restarting
from rayflex.control.warming import warm_replacements, warm_standbys
from rayflex.errors import RayflexError, WorkerError
from rayflex.faults.policy import Fail, Restart, WaitForResources, best_world_size
from rayflex.group.worker_group import Release
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
    survivors = collect_survivors(ctx, attempt, set(fault.bad_ranks), raised,
                                  warm=(lambda: warm_replacements(ctx, node_of, gone)) if gone else None)
    name_vanished_nodes(ctx)
    commit_handed_off(ctx)  # an emergency save's keepers upload it: committed before a step is chosen
    decision = ctx.policy.decide(kind=fault.kind, step=ctx.ledger.step + 1, committed_step=ctx.ledger.committed_step,
                                 usable_slots=ctx.usable_slots(), error=fault.error, diagnosis=fault.diagnosis)
    return follow_decision(ctx, decision, survivors, state.fault_time, lambda: worker_error(fault))


def follow_decision(ctx, decision, survivors: dict, fault_time: float, error: Callable[[], Any]):
    """Act on the failure policy's decision: wait for resources (asking the autoscaler),
    fail the run (with ``error()`` as its cause), or restart at the size it chose."""
    deadline = None
    while isinstance(decision, WaitForResources):
        if deadline is None:
            deadline = ctx.clock.time() + decision.timeout_s
            ctx.request_capacity()
            log.warning("waiting up to %.0fs for resources: %s", decision.timeout_s, decision.reason)
        if ctx.clock.time() > deadline or ctx.stop_requested.is_set():
            _kill_all(ctx, survivors)
            return Failed(f"gave up waiting for resources after {decision.timeout_s:.0f}s: {decision.reason}")
        ctx.clock.sleep(knob("RESOURCE_POLL_S"))
        decision = ctx.policy.resize(usable_slots=ctx.usable_slots())
    if isinstance(decision, Fail):
        _kill_all(ctx, survivors)
        return Failed(decision.reason, error())
    assert isinstance(decision, Restart)
    placing = Placing(world_size=decision.world_size, restart_reason=decision.reason, fault_time=fault_time,
                      survivors=survivors)
    return with_what_is_up(ctx, placing) or placing


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
    for node in sorted(set(rank_to_node) - ctx.alive_nodes() - reported):
        ctx.record(ev.NodeLost(step=ctx.ledger.step + 1, node_id=node,
                               ranks=[r for r, n in enumerate(rank_to_node) if n == node]))


def _leave_out_unreachable_nodes(ctx, fault, node_of: dict[int, str]) -> set[str]:
    """A node every rank of which froze may be frozen itself (Ray still lists it until its
    health check gives up, up to a minute): one that does not run a probe task within
    ``NODE_PROBE_TIMEOUT_S`` is named lost and left out of placement until it answers."""
    if fault.hang != "frozen":
        return set()
    alive = ctx.alive_nodes()
    ranks_on = {}
    for rank, node in node_of.items():
        ranks_on.setdefault(node, []).append(rank)
    silent = {n for n, ranks in ranks_on.items() if n in alive and set(ranks) <= set(fault.bad_ranks)}
    timeout_s = knob("NODE_PROBE_TIMEOUT_S")
    unreachable = ctx.unreachable.check(silent, timeout_s)
    for node in sorted(unreachable):
        log.warning("node %s ran no task within %.0fs after its ranks froze: leaving it out", node[:12], timeout_s)
        ctx.record(ev.NodeLost(step=ctx.ledger.step + 1, node_id=node, ranks=sorted(ranks_on[node]),
                               reason=f"unreachable: its ranks froze and it ran no task within {timeout_s:.0f}s; "
                                      "left out of placement until it answers (Ray still lists it)"))
    return unreachable


def _kill_all(ctx, survivors: dict) -> None:
    for actor in survivors.values():
        ctx.cluster.kill(actor)


def collect_survivors(ctx, attempt: Attempt, bad_ranks: set[int], raised: frozenset = frozenset(),
                      warm: Optional[Callable[[], None]] = None) -> dict[str, Any]:
    """Kill the dead or frozen ranks; ask the others to leave the attempt and keep the ones
    that could (actor id -> handle). Ranks whose loop *raised* are alive: they leave like
    the others (so a checkpoint they are still uploading can commit), then are replaced."""
    group, reservation, cluster = attempt.group, ctx.reservation, ctx.cluster
    kill_now = set(bad_ranks) - set(raised)
    group.kill(sorted(kill_now))
    for r in kill_now:
        reservation.vacate(cluster.actor_id(group.actors[r]))
    if warm is not None:
        warm()  # the dead ranks' bundles are free now; the survivors may take seconds to leave
    others = [r for r in range(attempt.plan.world_size) if r not in kill_now]
    # With a peer dead an in-flight save cannot commit: leave at once, so the sockets the
    # other survivors are blocked on close now. A dead or raising peer leaves the others in
    # collectives that cannot complete: abort them (after the checkpoint grace, so a save
    # in flight can still commit). A growth stop is at a step boundary and leaves gracefully.
    grace = 0.0 if kill_now else knob("RELEASE_CHECKPOINT_GRACE_S")
    released = (group.release(others, timeout_s=knob("RELEASE_TIMEOUT_S"), checkpoint_grace_s=grace,
                              abort=bool(kill_now or raised)) if others else Release())
    survivors = {}
    for r in others:
        actor = group.actors[r]
        if r in released.left and r not in raised:
            survivors[cluster.actor_id(actor)] = actor
            continue
        if r in released.died:  # a second fault while the first is handled: named like the first
            ctx.record(ev.WorkerDied(step=ctx.ledger.step, rank=r, node_id=group.node_of.get(r, ""),
                                     error=f"while leaving the failed attempt: {released.died[r]}"))
        elif r in released.uploading:  # it left; its process goes with the upload it still ran
            log.info("rank %d left the failed attempt with a checkpoint upload still running; its process is "
                     "replaced", r)
        elif r not in released.left:  # frozen (or stuck) while leaving: named as a hang, then replaced
            timeout_s = knob("RELEASE_TIMEOUT_S")
            log.warning("rank %d did not leave the failed attempt within %.0fs; killing it", r, timeout_s)
            ctx.record(ev.HangDetected(step=ctx.ledger.step, ranks=[r], phases={str(r): "leaving"},
                                       stalled_s=timeout_s, timeout_s=timeout_s))
        group.kill([r])
        reservation.vacate(cluster.actor_id(actor))
    ctx.note_attempt(None, None)
    return survivors


def with_what_is_up(ctx, placing: Placing) -> Optional[Placing]:
    """With ``restart_while_warming``: if the restart needs workers that are not up, start
    them as standbys and restart now at the largest valid size the survivors and warm
    standbys fill; the run grows to the full size once the newcomers are warm."""
    size = placing.world_size
    if not ctx.warm_restarts:
        return None
    standby = ctx.standby
    if standby is not None:
        standby.poll()
    up = len(placing.survivors) + (standby.ready if standby is not None else 0)
    if up >= size:
        return None
    now = best_world_size(ctx.spec, up)
    if now is None or now < ctx.spec.scaling.min_size:
        return None  # too few to train with: wait for the new workers
    current: dict[str, int] = {}
    for aid in placing.survivors:
        node = ctx.reservation.node_of_actor(aid) if ctx.reservation else None
        if node is not None:
            current[node] = current.get(node, 0) + 1
    up_slots = dict(current)
    for node in standby.nodes() if standby is not None else ():
        up_slots[node] = up_slots.get(node, 0) + standby.count_ready(node)
    if not warm_standbys(ctx, size, current):
        return None  # cannot place the newcomers now: restart at ``size`` as usual
    reason = (f"{placing.restart_reason}; restarting at once with the {now} workers that are up, growing to "
              f"{size} when {size - up} more are warm")
    return Placing(world_size=now, restart_reason=reason, fault_time=placing.fault_time,
                   survivors=placing.survivors, workers_up=up_slots, full_size=size)


def worker_error(fault) -> Optional[BaseException]:
    failed = [e for e in fault.events if isinstance(e, ev.WorkerFailed)]
    if failed:
        e = failed[0]
        return WorkerError(e.rank, e.node_id, e.step or 0, e.error)
    return RayflexError(fault.error) if fault.error else None
